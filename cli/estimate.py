"""`gptkit estimate`: parameters, memory per GPU, FLOPs and time to train, and the best layouts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gptkit.config.sections import GPT3_PRESETS, LLAMA_PRESETS, MOE_PRESETS, ParallelConfig, TrainConfig, parse_size
from gptkit.errors import ConfigError
from gptkit_cli import format as fmt
from gptkit_cli.app import app, handles_errors, out

if TYPE_CHECKING:       # the estimator itself is imported where it runs, off the start-up path
    from gptkit.estimate.sizing import Estimate

Opt = typer.Option
MODEL, LAYOUT, HW = 'Model', 'Layout', 'Hardware and budget'
MODEL_DIMS = ('layers', 'hidden', 'heads', 'seq_len', 'vocab', 'ffn_hidden', 'head_size', 'sliding_window',   # named
              'make_vocab_size_divisible_by', 'moe_experts', 'moe_top_k', 'moe_ffn_hidden')       # as ModelConfig's


def in_panel(panel: str):
    "A typer.Option maker for one help panel: `in_panel(MODEL)('help', '--flag')`; the help is plain text"
    return lambda help, *decls: Opt(*decls, help=escape(help), rich_help_panel=panel)   # '[default: 1]' shown


ModelOpt, LayoutOpt, HardwareOpt = in_panel(MODEL), in_panel(LAYOUT), in_panel(HW)
CalibrateOpt = in_panel('Calibration on this machine')


@app.command()
@handles_errors
def estimate(
    params: Annotated[Optional[str], ModelOpt('Model size such as 13B; picks the nearest GPT-3 preset.')] = None,
    preset: Annotated[Optional[str], ModelOpt(
        f"{', '.join(GPT3_PRESETS)} (or tiny, small); {', '.join(LLAMA_PRESETS)}; "
        f"mixture of experts: {', '.join(MOE_PRESETS)}.")] = None,
    layers: Annotated[Optional[int], ModelOpt('Transformer layers.')] = None,
    hidden: Annotated[Optional[int], ModelOpt('Hidden size.')] = None,
    heads: Annotated[Optional[int], ModelOpt('Attention heads.')] = None,
    seq_len: Annotated[Optional[int], ModelOpt('Sequence length [default: 2048].')] = None,
    vocab: Annotated[Optional[int], ModelOpt('Vocabulary size before padding [default: 50257].')] = None,
    ffn_hidden: Annotated[Optional[int], ModelOpt('MLP hidden size [default: 4 x hidden].')] = None,
    head_size: Annotated[Optional[int], ModelOpt('Width of each attention head [default: hidden / heads].')] = None,
    sliding_window: Annotated[Optional[int], ModelOpt(
        'Each token attends to this many latest tokens (Mistral) [default: the whole sequence].')] = None,
    make_vocab_size_divisible_by: Annotated[Optional[int], ModelOpt(
        'Pad the vocabulary to a multiple of this x TP [default: 128].')] = None,
    moe_experts: Annotated[Optional[int], ModelOpt('Routed experts in each MoE layer (0: dense).')] = None,
    moe_top_k: Annotated[Optional[int], ModelOpt('Experts each token goes through [default: 2].')] = None,
    moe_ffn_hidden: Annotated[Optional[int], ModelOpt("Each expert's MLP width [default: the MLP width].")] = None,
    gpus: Annotated[Optional[int], LayoutOpt('Number of GPUs [default: tp x pp x dp; one node with --search].')] = None,
    gpus_per_node: Annotated[int, LayoutOpt('GPUs per node; tensor parallelism stays inside one.')] = 8,
    tp: Annotated[int, LayoutOpt('Tensor-parallel degree.')] = 1,
    pp: Annotated[int, LayoutOpt('Pipeline-parallel degree.')] = 1,
    dp: Annotated[Optional[int], LayoutOpt('Data-parallel degree [default: gpus / (tp x pp)].')] = None,
    ep: Annotated[int, LayoutOpt('Expert-parallel degree: MoE experts split over this many data-parallel ranks.')] = 1,
    zero: Annotated[int, LayoutOpt('ZeRO stage 0-3.')] = 0,
    balance: Annotated[str, LayoutOpt(
        "Pipeline stages balanced by 'layers' (equal counts) or 'parameters'.")] = 'layers',
    sequence_parallel: Annotated[bool, LayoutOpt(
        'Megatron sequence parallelism (with TP).', '--sequence-parallel/--no-sequence-parallel')] = False,
    recompute: Annotated[str, LayoutOpt('Activation recomputation: none, selective or full.')] = 'none',
    flash: Annotated[bool, LayoutOpt('Fused attention that stores no s x s scores.', '--flash/--no-flash')] = True,
    micro_batch: Annotated[int, LayoutOpt('Sequences per GPU per forward/backward.')] = 1,
    global_batch: Annotated[Optional[int], LayoutOpt(
        "Sequences per step [default: the preset's, else micro-batch x dp].")] = None,
    precision: Annotated[str, LayoutOpt('fp32, fp16 or bf16.')] = 'bf16',
    offload: Annotated[str, LayoutOpt('none, optimizer or optimizer+params (ZeRO-3).')] = 'none',
    lora_rank: Annotated[int, LayoutOpt('LoRA rank: adapters trained on a frozen model (0: every weight trains).')] = 0,
    lora_targets: Annotated[str, LayoutOpt('Linear layers LoRA adapts, comma-separated.')] = 'qkv,proj,fc1,fc2',
    gpu: Annotated[Optional[str], HardwareOpt(
        'a100-40gb, a100-80gb, h100-80gb, h200-141gb, cpu or a profile of --hardware [default: a100-80gb; cpu with '
        '--calibrate].')] = None,
    hardware: Annotated[Optional[Path], HardwareOpt(
        'A JSON file of hardware profiles (--save-hardware writes one).')] = None,
    gpu_memory: Annotated[Optional[float], HardwareOpt('GPU memory in GiB (overrides --gpu).')] = None,
    gpu_tflops: Annotated[Optional[float], HardwareOpt('Dense 16-bit peak TFLOP/s (overrides --gpu).')] = None,
    tokens: Annotated[str, HardwareOpt('Training tokens, such as 300B.')] = '300B',
    search: Annotated[bool, Opt('--search', help='Rank every layout that fits --gpus GPUs and show the best.')] = False,
    top: Annotated[int, Opt(help='How many layouts --search shows.')] = 10,
    as_json: Annotated[bool, Opt('--json', help='Print JSON instead of tables.')] = False,
    calibrate: Annotated[Optional[Path], CalibrateOpt(
        "Fit --gpu's profile to a finished run's measured steps (its folder: config.json, metrics.jsonl).")] = None,
    save_hardware: Annotated[Optional[Path], CalibrateOpt('Save the fitted profile in this JSON file.')] = None,
    name: Annotated[Optional[str], CalibrateOpt("The fitted profile's name [default: GPU (calibrated)].")] = None,
):
    """Parameters, memory per GPU, FLOPs and time to train a GPT, before renting a GPU."""
    device = hardware_profile(gpu or ('cpu' if calibrate else 'a100-80gb'), hardware, gpu_memory, gpu_tflops)
    if calibrate is not None:
        return _calibrate(calibrate, device, save_hardware, name, as_json)
    _estimate_on(device, dict(locals()))


def hardware_profile(gpu: str, hardware: Optional[Path], memory_gib: Optional[float], tflops: Optional[float]):
    "The profile called `gpu`, among the known ones and those of the file `hardware`, memory or peak overridden"
    from gptkit.estimate.calibrate import load_hardware
    from gptkit.estimate.perf import GPUS, get_gpu
    from gptkit.estimate.sizing import GiB
    table = {**GPUS, **(load_hardware(hardware) if hardware is not None else {})}
    return get_gpu(gpu, None if memory_gib is None else round(memory_gib * GiB), tflops, table=table)


def _estimate_on(device, a: dict):
    "The estimate (or --search) of the model and layout the flags in `a` describe, on `device`"
    from gptkit.estimate.sizing import data_parallel, estimate as run_estimate, resolve_model, search as run_search
    if a['save_hardware'] is not None or a['name'] is not None:
        raise ConfigError([('save_hardware' if a['save_hardware'] else 'name', '{key} goes with --calibrate RUN')])
    if a['precision'] == 'auto':            # a CPU run's setting: a GPU estimate names its precision
        raise ConfigError([('precision', '{key} must be fp32, fp16 or bf16 for an estimate, not auto')])
    model, base, note = resolve_model(a['params'], a['preset'], **{k: v for k, v in a.items() if k in MODEL_DIMS})
    n_tokens, batch = parse_size(a['tokens'], 'tokens'), a['global_batch'] or (base.global_batch if base else None)
    gpus, per_node = a['gpus'], a['gpus_per_node']
    if a['search']:
        return _report_search(run_search(model, device, gpus or per_node, per_node, precision=a['precision'],
                                         flash=a['flash'], tokens=n_tokens, top=a['top'],
                                         **({'global_batch': batch} if batch else {})),
                              note, gpus or per_node, device.name, a['as_json'])
    par = ParallelConfig(tp=a['tp'], pp=a['pp'], dp=data_parallel(gpus, a['tp'], a['pp'], a['dp']), zero=a['zero'],
                         ep=a['ep'], sequence_parallel=a['sequence_parallel'], offload=a['offload'],
                         balance=a['balance'])
    train = TrainConfig(micro_batch=a['micro_batch'], global_batch=batch, precision=a['precision'],
                        recompute=a['recompute'], flash=a['flash'], lora_rank=a['lora_rank'],
                        lora_targets=a['lora_targets'])
    _report_estimate(run_estimate(model, par, train, gpu=device, tokens=n_tokens, gpus_per_node=per_node), note,
                     a['as_json'], model_flags(a))


def model_flags(a: dict) -> str:
    "The flags of `a` that name the model and the GPU, as typed: '--params 13B --gpu a100-40gb'"
    keys = ('params', 'preset', *MODEL_DIMS, 'gpu', 'hardware', 'gpu_memory', 'gpu_tflops')
    return ' '.join(f"--{k.replace('_', '-')} {a[k]}" for k in keys if a.get(k) is not None)


def _calibrate(folder: Path, base, save: Optional[Path], name: Optional[str], as_json: bool):
    "Fit `base` to the run in `folder`, show measured against predicted before and after, save it if asked"
    from gptkit.estimate.calibrate import calibrate, predicted_step, profile_dict, read_run, save_hardware
    run = read_run(folder)
    fitted = calibrate(run, base, name)
    before, after = predicted_step(run.cfg, run.world, base), predicted_step(run.cfg, run.world, fitted)
    if save is not None:
        save_hardware(save, {fitted.name: fitted})
    if as_json:
        return out.print_json(json.dumps({'run': str(folder), 'processes': run.world, 'reports': run.reports,
                                          'measured_s': run.step_seconds, 'before': before.to_dict(),
                                          'after': after.to_dict(), 'profile': {'name': fitted.name,
                                                                                **profile_dict(fitted)}}))
    t = _table(f'Calibration on {fmt.text(folder)} ({run.world} process{"es" if run.world > 1 else ""}, '
               f'median of {run.reports} reports after the first)')
    t.add_row('measured step', f'{run.step_seconds * 1e3:.1f} ms', '')
    t.add_row(f'predicted, {fmt.text(base.name)}', f'{before.total * 1e3:.1f} ms',
              f'{before.total / run.step_seconds:.2f} x measured')
    t.add_row(f'predicted, {fmt.text(fitted.name)}', f'{after.total * 1e3:.1f} ms',
              f'{after.total / run.step_seconds:.2f} x measured')
    for k in ('gemm_efficiency', 'attention_efficiency', 'memory_efficiency', 'launch', 'peak_tf32', 'hbm'):
        t.add_row(f'  {k}', f'{getattr(fitted, k):.4g}', f'was {getattr(base, k):.4g}')
    out.print(t)
    if save is not None:
        out.print(f'saved profile {fmt.text(fitted.name)!r} in {fmt.text(save)}: use it with --hardware '
                  f'{fmt.text(save)} --gpu {fmt.text(repr(fitted.name))}', soft_wrap=True, highlight=False)


def _report_estimate(est: Estimate, note: str, as_json: bool, hint: str):
    "Print one estimate as JSON or as tables"
    if as_json:
        out.print_json(json.dumps(est.to_dict()))
    else:
        _print_estimate(est, note, hint or '...')


def _report_search(results: list[Estimate], note: str, gpus: int, gpu: str, as_json: bool):
    "Print the layouts --search found, as JSON or as a ranked table"
    if as_json:
        out.print_json(json.dumps([e.to_dict() for e in results]))
    else:
        _print_search(results, note, gpus, gpu)

def family(m) -> str:
    "The model's architecture in a few words: its position embedding, norm, MLP, attention heads and output layer"
    scaled = f', {m.rope_scaling} x{m.rope_factor:g}' if m.rope_scaling != 'none' else ''
    pos = 'learned positions' if m.position == 'learned' else f'rotary positions (base {m.rope_theta:g}{scaled})'
    mlp = f'SwiGLU MLP {m.ffn}' if m.gated else f'{m.activation.replace("_", " ").upper()} MLP {m.ffn}'
    att = 'multi-head' if m.kv == m.heads else 'multi-query' if m.kv == 1 else f'grouped-query ({m.kv} KV heads)'
    att += f' attention, heads of {m.head_dim}' if m.head_dim * m.heads != m.hidden else ' attention'
    att += ', QK-norm' if m.qk_norm else ''
    att += f', sliding window {m.sliding_window}' if m.sliding_window else ''
    biases = {(True, True): 'biases', (False, False): 'no biases', (False, True): 'a bias on QKV only',
              (True, False): 'biases except on QKV'}[(m.bias, m.attn_bias)]
    return (f"{pos}, {'RMSNorm' if m.norm == 'rmsnorm' else 'LayerNorm'}, {mlp}, {att}, "
            f"{biases}, {'tied' if m.tie_embeddings else 'untied'} embeddings")


def _table(title: str) -> Table:
    t = Table(title=title, title_justify='left', title_style='bold', show_header=False, box=None, padding=(0, 2))
    t.add_column(style='cyan')
    t.add_column(justify='right')
    t.add_column(style='dim')
    return t


def _params_table(e: Estimate, d: dict) -> Table:
    "The parameters: total (and active, MoE), embeddings, transformer, unpadded, the most loaded rank"
    mo, par = e.model, e.parallel
    p = _table('Parameters')
    p.add_row('total', f'{e.params.total:,}', fmt.count(e.params.total))
    if mo.moe_experts:
        p.add_row('  active', f'{e.params.active:,}', f'{fmt.count(e.params.active)} a token: {mo.moe_top_k} of '
                  f'{mo.moe_experts} experts' + (f', every {mo.moe_every} layers' if mo.moe_every > 1 else '')
                  + (f', shared expert {mo.moe_shared_ffn}' if mo.moe_shared_ffn else ''))
    p.add_row('  embeddings', f'{e.params.embedding:,}',
              f'vocabulary {e.model.vocab} padded to {e.params.vocab_padded}')
    p.add_row('  transformer', f'{e.params.transformer:,}', f'{e.model.layers} layers + final norm')
    p.add_row('total, vocabulary unpadded', f'{e.params.unpadded:,}', '')
    if e.train.lora_rank:
        p.add_row('trainable (LoRA)', f'{d["params"]["trainable"]:,}', f'rank {e.train.lora_rank} on '
                  f'{e.train.lora_targets}; the rest frozen')
    p.add_row('most loaded rank', f'{e.params.per_rank_max:,}',
              f'stages: {", ".join(fmt.count(n) for n in d["params"]["per_stage"][:8])}'
              + (' ...' if par.pp > 8 else ''))
    return p


def not_yet(e: Estimate) -> str:
    "Why `gptkit train` does not run this expert-parallel layout yet, its own words; '' when it does"
    from gptkit.config.run import ep_engine_problems
    return '; '.join(m.replace('{key}', k) for k, m in ep_engine_problems(e.parallel, e.train))


def _print_estimate(e: Estimate, note: str, hint: str = '...'):
    from gptkit.estimate.sizing import kv_cache_bytes
    d, m, gpus = e.to_dict(), e.memory, e.parallel.world_size
    par, tr = e.parallel, e.train
    mo = e.model
    out.print(f'[bold]{fmt.text(note)}[/]: {mo.layers} layers, hidden {mo.hidden}, {mo.heads} heads, '
              f'sequence {mo.seq_len}, vocabulary {mo.vocab}')
    out.print(f'[bold]architecture[/]: {family(mo)}')
    stages = ' (stages by parameters)' if par.pp > 1 and par.balance == 'parameters' else ''
    experts = f' ep {par.ep}' if mo.moe_experts else ''
    out.print(f'[bold]layout[/]: {gpus} x {e.gpu.name}, tp {par.tp} pp {par.pp}{stages} dp {par.dp}{experts}, '
              f'ZeRO {par.zero}'
              f'{", sequence parallel" if par.sequence_parallel else ""}, recompute {tr.recompute}, '
              f'{"flash" if tr.flash else "unfused"} attention, {tr.precision}, micro-batch {tr.micro_batch}, '
              f'global batch {e.batch}, offload {par.offload}\n')
    out.print(_params_table(e, d))
    out.print()
    t = _table(f'Memory per GPU (pipeline stage {m.stage})' if par.pp > 1 else 'Memory per GPU')
    why = {'weights': f'{tr.precision}, ZeRO {par.zero}' + (f', experts / ep {par.ep}' if par.ep > 1 else '')
           + (': the frozen model and the adapters' if tr.lora_rank else ''),
           'gradients': '',
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
              f'{tr.precision}' + (f', on each of {par.tp} TP ranks' if par.tp > 1 else '')
              + (' (every position kept: the window does not shrink it)' if mo.sliding_window else ''))
    out.print(g)
    out.print()
    out.print(_compute_table(e, d))
    out.print()
    if m.fits:
        out.print(_step_table(e))
    else:         # the step, MFU and time of a layout that cannot run would be numbers about nothing
        out.print(f'[yellow]No step time, MFU or training time[/]: this layout needs {fmt.gib(-m.headroom)} more per '
                  f'GPU than {e.gpu.name} has. To make it fit, try gptkit estimate {fmt.text(hint)} --search --gpus N '
                  'to rank the layouts that fit on N GPUs, or more --tp/--pp, ZeRO (--zero 3) or --recompute full.',
                  soft_wrap=True)
    if not_yet(e):
        out.print(f'\n[yellow]gptkit train does not run this layout yet[/]: {fmt.text(not_yet(e))}')


def _compute_table(e: Estimate, d: dict) -> Table:
    "FLOPs and iterations; the step, MFU and time too when the layout fits (a layout that does not fit has none)"
    mo, tr, gpus = e.model, e.train, e.parallel.world_size
    c = _table('Compute and time' if e.memory.fits else 'Compute')
    window = mo.sliding_window is not None and mo.sliding_window < mo.seq_len
    c.add_row('FLOPs per iteration', fmt.flops(e.flops_per_iteration),
              f'with recompute {tr.recompute}' + (', the dense masked attention' if window else '')
              + f' (model: {fmt.flops(e.model_flops_per_iteration)}'
              + (f', {mo.sliding_window} keys a query' if window else '') + ')')
    c.add_row('FLOPs per token', fmt.flops(d['flops']['per_token']),
              'from the active parameters' if mo.moe_experts else '')
    c.add_row('iterations', f'{e.iterations:,}', f'{fmt.count(e.tokens)} tokens / ({e.batch} x {e.model.seq_len})')
    if e.memory.fits:
        c.add_row('step', f'{e.step.total:.3g} s', f'{fmt.count(d["time"]["tokens_per_s_per_gpu"])} tokens/s per GPU')
        c.add_row('MFU / HFU', f'{e.mfu:.1%} / {e.hfu:.1%}',
                  f'of {e.gpu.peak(tr.precision) / 1e12:,.0f} TFLOP/s; HFU counts the recomputed passes')
        c.add_row('time', fmt.duration(e.seconds), f'{d["time"]["gpu_hours"]:,.0f} GPU-hours on {gpus} GPUs')
    return c


STEP_PARTS = {'gemm': 'matrix products', 'attention': "attention's core", 'memory': 'memory-bound kernels',
              'recompute': 'recomputation', 'tp_comm': 'TP/SP traffic (NVLink)', 'ep_comm': 'EP all-to-all',
              'dp_comm': 'DP/ZeRO traffic', 'pp_comm': 'pipeline sends', 'bubble': 'pipeline bubble (1F1B)',
              'optimizer': 'optimizer step'}


def _step_table(e: Estimate) -> Table:
    "The predicted step time by part (gptkit.estimate.perf): seconds and share"
    t = _table(f'Step time on {e.gpu.name} (performance model, nbs/01b_estimate.perf.ipynb)')
    for k, label in STEP_PARTS.items():
        v = getattr(e.step, k)
        if v:
            t.add_row(label, f'{v:.3g} s', f'{v / e.step.total:.1%}')
    return t


def _print_search(results: list[Estimate], note: str, gpus: int, gpu: str):
    from gptkit.estimate.sizing import GiB, train_flags
    if not results:
        out.print(f'[red]No layout of {fmt.text(note)} fits in {gpus} x {gpu}[/]: add GPUs, choose a bigger GPU or a '
                  f'smaller model.')
        return
    t = Table(title=f'Best layouts for {fmt.text(note)} on {gpus} x {gpu}', title_justify='left', title_style='bold')
    moe = results[0].model.moe_experts > 0
    for col in ('#', 'tp', 'pp', 'dp', *(('ep',) if moe else ()), 'ZeRO', 'recompute', 'micro', 'GiB/GPU', 'step s',
                'MFU', 'bubble', 'days'):
        t.add_column(col, justify='right')
    for i, e in enumerate(results, 1):
        t.add_row(str(i), str(e.parallel.tp), str(e.parallel.pp), str(e.parallel.dp),
                  *((str(e.parallel.ep),) if moe else ()), str(e.parallel.zero),
                  e.train.recompute,
                  str(e.train.micro_batch), f'{e.memory.total / GiB:.1f}', f'{e.step.total:.2f}', f'{e.mfu:.1%}',
                  f'{e.step.bubble_fraction:.1%}',
                  f'{e.layout_seconds / 86400:,.1f}')
    out.print(t)
    out.print('[dim]Sequence parallelism on when tp > 1. Time: the performance model of nbs/01b_estimate.perf.ipynb '
              '(matrix products by shape, attention, memory-bound work, recomputation, TP, DP' + (', EP' if moe else '')
              + ' and PP traffic, the 1F1B bubble).[/]')
    out.print(f'\n[bold]As gptkit train options[/] (on {gpus} processes; dp = processes / (tp x pp)):')
    for i, e in enumerate(results, 1):
        out.print(f'{i:>2}  {train_flags(e.parallel, e.train)}', soft_wrap=True, highlight=False)
        if not_yet(e):
            out.print(f'    [yellow]not yet[/]: {fmt.text(not_yet(e))}', soft_wrap=True, highlight=False)
