"""`gptkit estimate`: parameters, memory per GPU, FLOPs and time to train, and the best layouts."""
from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from gptkit.config import ParallelConfig, TrainConfig, parse_size
from gptkit.estimate import (
    Estimate,
    GiB,
    data_parallel,
    estimate as run_estimate,
    get_gpu,
    kv_cache_bytes,
    resolve_model,
    search as run_search,
    train_flags,
)
from gptkit_cli import format as fmt
from gptkit_cli.app import app, handles_errors, out

Opt = typer.Option
MODEL, LAYOUT, HW = 'Model', 'Layout', 'Hardware and budget'


@app.command()
@handles_errors
def estimate(
    params: Annotated[Optional[str], Opt(
        help='Model size such as 13B; picks the nearest GPT-3 preset.', rich_help_panel=MODEL)] = None,
    preset: Annotated[Optional[str], Opt(
        help='125m, 350m, 760m, 1.3b, 2.7b, 6.7b, 13b, 175b (or tiny, small).', rich_help_panel=MODEL)] = None,
    layers: Annotated[Optional[int], Opt(help='Transformer layers.', rich_help_panel=MODEL)] = None,
    hidden: Annotated[Optional[int], Opt(help='Hidden size.', rich_help_panel=MODEL)] = None,
    heads: Annotated[Optional[int], Opt(help='Attention heads.', rich_help_panel=MODEL)] = None,
    seq_len: Annotated[Optional[int], Opt(help='Sequence length [default: 2048].', rich_help_panel=MODEL)] = None,
    vocab: Annotated[Optional[int], Opt(
        help='Vocabulary size before padding [default: 50257].', rich_help_panel=MODEL)] = None,
    ffn_hidden: Annotated[Optional[int], Opt(
        help='MLP hidden size [default: 4 x hidden].', rich_help_panel=MODEL)] = None,
    make_vocab_size_divisible_by: Annotated[Optional[int], Opt(
        help='Pad the vocabulary to a multiple of this x TP [default: 128].', rich_help_panel=MODEL)] = None,
    gpus: Annotated[Optional[int], Opt(
        help='Number of GPUs [default: tp x pp x dp; one node with --search].', rich_help_panel=LAYOUT)] = None,
    gpus_per_node: Annotated[int, Opt(
        help='GPUs per node; tensor parallelism stays inside one.', rich_help_panel=LAYOUT)] = 8,
    tp: Annotated[int, Opt(help='Tensor-parallel degree.', rich_help_panel=LAYOUT)] = 1,
    pp: Annotated[int, Opt(help='Pipeline-parallel degree.', rich_help_panel=LAYOUT)] = 1,
    dp: Annotated[Optional[int], Opt(
        help='Data-parallel degree [default: gpus / (tp x pp)].', rich_help_panel=LAYOUT)] = None,
    zero: Annotated[int, Opt(help='ZeRO stage 0-3.', rich_help_panel=LAYOUT)] = 0,
    balance: Annotated[str, Opt(help="Pipeline stages balanced by 'layers' (equal counts) or 'parameters'.",
                                rich_help_panel=LAYOUT)] = 'layers',
    sequence_parallel: Annotated[bool, Opt(
        '--sequence-parallel/--no-sequence-parallel',
        help='Megatron sequence parallelism (with TP).',
        rich_help_panel=LAYOUT)] = False,
    recompute: Annotated[str, Opt(
        help='Activation recomputation: none, selective or full.', rich_help_panel=LAYOUT)] = 'none',
    flash: Annotated[bool, Opt(
        '--flash/--no-flash', help='Fused attention that stores no s x s scores.', rich_help_panel=LAYOUT)] = True,
    micro_batch: Annotated[int, Opt(help='Sequences per GPU per forward/backward.', rich_help_panel=LAYOUT)] = 1,
    global_batch: Annotated[Optional[int], Opt(
        help="Sequences per step [default: the preset's, else micro-batch x dp].", rich_help_panel=LAYOUT)] = None,
    precision: Annotated[str, Opt(help='fp32, fp16 or bf16.', rich_help_panel=LAYOUT)] = 'bf16',
    offload: Annotated[str, Opt(help='none, optimizer or optimizer+params (ZeRO-3).', rich_help_panel=LAYOUT)] = 'none',
    gpu: Annotated[str, Opt(help='a100-40gb, a100-80gb, h100-80gb or h200-141gb.', rich_help_panel=HW)] = 'a100-80gb',
    gpu_memory: Annotated[Optional[float], Opt(help='GPU memory in GiB (overrides --gpu).', rich_help_panel=HW)] = None,
    gpu_tflops: Annotated[Optional[float], Opt(
        help='Dense 16-bit peak TFLOP/s (overrides --gpu).', rich_help_panel=HW)] = None,
    tokens: Annotated[str, Opt(help='Training tokens, such as 300B.', rich_help_panel=HW)] = '300B',
    mfu: Annotated[float, Opt(help='Assumed model FLOPs utilization.', rich_help_panel=HW)] = 0.4,
    search: Annotated[bool, Opt('--search', help='Rank every layout that fits --gpus GPUs and show the best.')] = False,
    top: Annotated[int, Opt(help='How many layouts --search shows.')] = 10,
    as_json: Annotated[bool, Opt('--json', help='Print JSON instead of tables.')] = False,
):
    """Parameters, memory per GPU, FLOPs and time to train a GPT, before renting a GPU."""
    model, base, note = resolve_model(params, preset, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                                      vocab=vocab, ffn_hidden=ffn_hidden,
                                      make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    device = get_gpu(gpu, None if gpu_memory is None else round(gpu_memory * GiB), gpu_tflops)
    n_tokens = parse_size(tokens, 'tokens')
    batch = global_batch or (base.global_batch if base else None)
    if search:
        n = gpus or gpus_per_node
        results = run_search(model, device, n, gpus_per_node, precision=precision, flash=flash, tokens=n_tokens,
                             mfu=mfu, top=top, **({'global_batch': batch} if batch else {}))
        if as_json:
            out.print_json(json.dumps([e.to_dict() for e in results]))
        else:
            _print_search(results, note, n, device.name)
        return
    par = ParallelConfig(tp=tp, pp=pp, dp=data_parallel(gpus, tp, pp, dp), zero=zero,
                         sequence_parallel=sequence_parallel, offload=offload, balance=balance)
    train = TrainConfig(micro_batch=micro_batch, global_batch=batch, precision=precision, recompute=recompute,
                        flash=flash)
    est = run_estimate(model, par, train, device, n_tokens, mfu, gpus_per_node)
    if as_json:
        out.print_json(json.dumps(est.to_dict()))
    else:
        _print_estimate(est, note)


def family(m) -> str:
    "The model's architecture in a few words: its position embedding, norm, MLP, attention heads and output layer"
    pos = 'learned positions' if m.position == 'learned' else f'rotary positions (base {m.rope_theta:g})'
    mlp = f'SwiGLU MLP {m.ffn}' if m.gated else f'{m.activation.replace("_", " ").upper()} MLP {m.ffn}'
    att = 'multi-head' if m.kv == m.heads else 'multi-query' if m.kv == 1 else f'grouped-query ({m.kv} KV heads)'
    return (f"{pos}, {'RMSNorm' if m.norm == 'rmsnorm' else 'LayerNorm'}, {mlp}, {att} attention, "
            f"{'biases' if m.bias else 'no biases'}, {'tied' if m.tie_embeddings else 'untied'} embeddings")


def _table(title: str) -> Table:
    t = Table(title=title, title_justify='left', title_style='bold', show_header=False, box=None, padding=(0, 2))
    t.add_column(style='cyan')
    t.add_column(justify='right')
    t.add_column(style='dim')
    return t


def _print_estimate(e: Estimate, note: str):
    d, m, gpus = e.to_dict(), e.memory, e.parallel.world_size
    par, tr = e.parallel, e.train
    mo = e.model
    out.print(f'[bold]{fmt.text(note)}[/]: {mo.layers} layers, hidden {mo.hidden}, {mo.heads} heads, '
              f'sequence {mo.seq_len}, vocabulary {mo.vocab}')
    out.print(f'[bold]architecture[/]: {family(mo)}')
    stages = ' (stages by parameters)' if par.pp > 1 and par.balance == 'parameters' else ''
    out.print(f'[bold]layout[/]: {gpus} x {e.gpu.name}, tp {par.tp} pp {par.pp}{stages} dp {par.dp}, ZeRO {par.zero}'
              f'{", sequence parallel" if par.sequence_parallel else ""}, recompute {tr.recompute}, '
              f'{"flash" if tr.flash else "unfused"} attention, {tr.precision}, micro-batch {tr.micro_batch}, '
              f'global batch {e.batch}, offload {par.offload}\n')
    p = _table('Parameters')
    p.add_row('total', f'{e.params.total:,}', fmt.count(e.params.total))
    p.add_row('  embeddings', f'{e.params.embedding:,}',
              f'vocabulary {e.model.vocab} padded to {e.params.vocab_padded}')
    p.add_row('  transformer', f'{e.params.transformer:,}', f'{e.model.layers} layers + final norm')
    p.add_row('total, vocabulary unpadded', f'{e.params.unpadded:,}', '')
    p.add_row('most loaded rank', f'{e.params.per_rank_max:,}',
              f'stages: {", ".join(fmt.count(n) for n in d["params"]["per_stage"][:8])}'
              + (' ...' if par.pp > 8 else ''))
    out.print(p)
    out.print()
    t = _table(f'Memory per GPU (pipeline stage {m.stage})' if par.pp > 1 else 'Memory per GPU')
    why = {'weights': f'{tr.precision}, ZeRO {par.zero}', 'gradients': '',
           'optimizer': 'Adam: master, fp32 grads, m, v' if tr.precision != 'fp32' else 'Adam m, v',
           'activations': f'Korthikanti et al., recompute {tr.recompute}', 'logits': 'output layer and loss',
           'other': 'CUDA context, workspaces, fragmentation'}
    for k in ('weights', 'gradients', 'optimizer', 'activations', 'logits', 'other'):
        t.add_row(k, fmt.gib(getattr(m, k)), why[k])
    verdict = (f'[green]fits[/], {fmt.gib(m.headroom)} to spare' if m.fits else f'[red]does not fit[/], '
                                                                                f'{fmt.gib(-m.headroom)} over')
    t.add_row('[bold]total[/]', f'[bold]{fmt.gib(m.total)}[/]', f'of {fmt.gib(m.capacity)}: {verdict}')
    out.print(t)
    out.print()
    kv = kv_cache_bytes(mo, 1, precision=tr.precision, tp=par.tp)
    g = _table('Generation')
    g.add_row('KV cache per sequence', fmt.gib(kv), f'{mo.seq_len} tokens, {mo.kv} KV heads of {mo.head_dim}, '
              f'{tr.precision}' + (f', on each of {par.tp} TP ranks' if par.tp > 1 else ''))
    out.print(g)
    out.print()
    c = _table('Compute and time')
    c.add_row('FLOPs per iteration', fmt.flops(e.flops_per_iteration),
              f'with recompute {tr.recompute} (model: {fmt.flops(e.model_flops_per_iteration)})')
    c.add_row('FLOPs per token', fmt.flops(d['flops']['per_token']), '')
    c.add_row('iterations', f'{e.iterations:,}', f'{fmt.count(e.tokens)} tokens / ({e.batch} x {e.model.seq_len})')
    c.add_row('time at MFU', fmt.duration(e.seconds),
              f'MFU {e.mfu:.0%} of {e.gpu.peak(tr.precision) / 1e12:.0f} TFLOP/s')
    c.add_row('GPU-hours', f'{d["time"]["gpu_hours"]:,.0f}', f'{gpus} GPUs')
    c.add_row('with this layout', fmt.duration(e.layout_seconds),
              f'step {e.step.total:.2f} s: bubble {e.step.bubble_fraction:.1%}, TP comm {e.step.tp_comm:.2f} s, '
              f'exposed DP comm {e.step.dp_comm:.2f} s')
    out.print(c)
    if not m.fits:
        out.print('\n[yellow]Try[/] gptkit estimate ... --search --gpus N to find layouts that fit.')


def _print_search(results: list[Estimate], note: str, gpus: int, gpu: str):
    if not results:
        out.print(f'[red]No layout of {fmt.text(note)} fits in {gpus} x {gpu}[/]: add GPUs, choose a bigger GPU or a '
                  f'smaller model.')
        return
    t = Table(title=f'Best layouts for {fmt.text(note)} on {gpus} x {gpu}', title_justify='left', title_style='bold')
    for col in ('#', 'tp', 'pp', 'dp', 'ZeRO', 'recompute', 'micro', 'GiB/GPU', 'step s', 'bubble', 'days'):
        t.add_column(col, justify='right')
    for i, e in enumerate(results, 1):
        t.add_row(str(i), str(e.parallel.tp), str(e.parallel.pp), str(e.parallel.dp), str(e.parallel.zero),
                  e.train.recompute,
                  str(e.train.micro_batch), f'{e.memory.total / GiB:.1f}', f'{e.step.total:.2f}',
                  f'{e.step.bubble_fraction:.1%}',
                  f'{e.layout_seconds / 86400:,.1f}')
    out.print(t)
    out.print('[dim]Sequence parallelism on when tp > 1. Time: compute at the assumed MFU, plus TP communication and '
              'exposed data-parallel traffic, stretched by the pipeline bubble (see nbs/01_estimate.ipynb).[/]')
    out.print(f'\n[bold]As gptkit train options[/] (on {gpus} processes; dp = processes / (tp x pp)):')
    for i, e in enumerate(results, 1):
        out.print(f'{i:>2}  {train_flags(e.parallel, e.train)}', soft_wrap=True, highlight=False)
