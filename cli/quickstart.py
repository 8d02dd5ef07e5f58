"""`gptkit quickstart`: the whole pipeline on the built-in corpus, on this machine, as far as it is built."""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gptkit.config import GPT3_PRESETS, LLAMA_PRESETS, PRECISIONS, PRESETS, ParallelConfig, TrainConfig
from gptkit.engine import device_type
from gptkit.errors import ConfigError
from gptkit.estimate import count_params, estimate, search
from gptkit.machine import this_cpu
from gptkit.perf import GPUS
from gptkit_cli import format as fmt
from gptkit_cli.app import app, handles_errors, out
from gptkit_cli.train import RichProgress

HELD_OUT_ARTICLES = 24   # of the built-in held-out text's 96: the step-4 loss to two decimals in seconds
QUICK_PRESETS = ('tiny', 'llama-tiny', 'moe-tiny')   # the CPU-sized models of each family
# Sequences per step. Measured on 2 cores (held-out margin over the unigram model, at about 1M tokens): batch 16
# 0.92, 8 1.07, 4 1.13, 2 1.09 nats; 4 also runs the most tokens a second, its logits fitting the caches better.
QUICK_BATCH = 4


@app.command()
@handles_errors
def quickstart(
    out_dir: Annotated[Path, typer.Option(
        '--out', help='Where the tokenizer and the dataset go.')] = Path('gptkit-quickstart'),
    vocab_size: Annotated[int, typer.Option(help='Entries in the tokenizer trained on the built-in corpus.')] = 4096,
    iters: Annotated[int, typer.Option(
        help=f'Training steps of the tiny model ({QUICK_BATCH} x 256 tokens each).')] = 1700,
    preset: Annotated[str, typer.Option(help="The model trained: 'tiny' (GPT), 'llama-tiny' (rotary, RMSNorm, "
                                             "SwiGLU, grouped-query attention) or 'moe-tiny' (llama-tiny's choices "
                                             'with 8 experts, 2 per token).')] = 'tiny',
    precision: Annotated[str, typer.Option(help='auto (on a CPU: bf16 where this machine runs its products 1.3x as '
                                                'fast as fp32, else fp32), fp32 or bf16.')] = 'auto',
):
    ("""The pipeline on the built-in corpus, on this machine: tokenizer, dataset, training the tiny model, """
     """evaluation, sizing real runs, and a sample of text from the model.""")
    if preset.lower() not in QUICK_PRESETS:
        choices = ', '.join(QUICK_PRESETS)
        raise ConfigError([('preset', f'{{key}} must be one of {choices} (CPU-sized), not {preset!r}')])
    if precision not in PRECISIONS:
        raise ConfigError([('precision', f"{{key}} must be one of {', '.join(PRECISIONS)}, not {precision!r}")])
    preset = preset.lower()
    start = time.perf_counter()
    _data_stage(out_dir, vocab_size)
    _train_stage(out_dir, iters, preset, precision)
    _estimate_stage()
    run = out_dir / 'run'
    o, r = fmt.text(out_dir), fmt.text(run)    # user text inside markup
    cpu = this_cpu()
    out.print(f'\nDone in {time.perf_counter() - start:.1f} s on this {fmt.text(cpu.name)} (machine class '
              f'{cpu.machine_class}, {_torch_threads()} threads). Next: [bold]gptkit train --preset {preset} '
              f'--set train.micro_batch={QUICK_BATCH} --set train.global_batch={QUICK_BATCH} --data '
              f'{o}/data/corpus_text_document '
              f'--tokenizer {o}/tokenizer --out {r} --resume --iters {2 * iters}[/] to train on, '
              f'[bold]gptkit generate --checkpoint {r}[/] (an interactive prompt), [bold]gptkit serve --checkpoint '
              f'{r}[/] '
              f'(a web page and the Megatron and OpenAI APIs), [bold]gptkit eval --checkpoint {r}[/], '
              f'[bold]gptkit checkpoint export {r} {o}/hf --to hf[/], [bold]gptkit estimate --help[/], and the '
              f'notebooks in nbs/.')
    _sample_stage(run)


def _torch_threads() -> int:
    "torch's threads, torch imported only now (off the CLI's start-up path)"
    import torch
    return torch.get_num_threads()


def _data_stage(out_dir: Path, vocab_size: int):
    from gptkit.data.corpus import DEFAULT_CORPUS, HELD_OUT, clean_text, read_documents  # ftfy: off the start-up path
    from gptkit.data.document import Tally
    from gptkit.data.prepare import PrepareConfig, prepare
    from gptkit.tokenizer import bytes_per_token, gpt2, save, train_bpe
    out.rule('[bold]gptkit quickstart[/]: a tokenizer and a dataset from the built-in corpus')
    corpus = ', '.join(DEFAULT_CORPUS)
    t0, tally = time.perf_counter(), Tally()
    with out.status(f'1. training a {vocab_size}-entry byte-level BPE on {corpus}'):
        tok = train_bpe((clean_text(d.text) for d in read_documents(DEFAULT_CORPUS, tally)), vocab_size)
        save(tok, out_dir / 'tokenizer')
    held = [d.text for d in read_documents([HELD_OUT])]
    out.print(f'1. tokenizer: {tok.vocab_size:,} entries from {tally.documents:,} documents ({tally.bytes / 2**20:.1f} '
              f'MB) in '
              f'{time.perf_counter() - t0:.1f} s -> {fmt.text(out_dir / "tokenizer")}; bytes per token on {HELD_OUT}: '
              f'{bytes_per_token(tok, held):.2f} (GPT-2: {bytes_per_token(gpt2(), held):.2f})')
    with out.status('2. tokenizing the corpus into Megatron .bin/.idx'):
        data = PrepareConfig(DEFAULT_CORPUS, str(out_dir / 'data' / 'corpus'), str(out_dir / 'tokenizer'),
                             overwrite=True)        # a rerun on one --out: the dataset of the tokenizer just trained
        res = prepare(data)
    out.print(f'2. dataset: {res.documents:,} documents, {res.tokens:,} tokens in {res.seconds:.1f} s '
              f'({res.mb_per_s:.1f} MB/s) -> {fmt.text(res.prefix)}.bin/.idx\n')


def _train_stage(out_dir: Path, iters: int, preset: str = 'tiny', precision: str = 'auto'):
    from gptkit.data.corpus import HELD_OUT, clean_text, read_documents
    from gptkit.evaluate import text_loss, token_counts, unigram_loss
    from gptkit.plan import plan_run, run_config
    from gptkit.train import train
    run = out_dir / 'run'
    shutil.rmtree(run, ignore_errors=True)           # the quickstart always starts its run afresh
    cfg = run_config(preset, sets=[f'train.iters={iters}', f'train.eval_interval={max(1, iters // 3)}',
                                   'train.eval_iters=8', f'train.log_interval={max(1, min(10, iters // 20))}',
                                   f'train.micro_batch={QUICK_BATCH}', f'train.global_batch={QUICK_BATCH}',
                                   'optim.warmup=0.05', f'train.precision={precision}'],
                     overrides={'data': {'prefix': str(out_dir / 'data' / 'corpus_text_document'),
                                         'tokenizer': str(out_dir / 'tokenizer')}}, vocab=False, out=str(run))
    plan = plan_run(cfg)                             # the tokenizer read once, for the run and the held-out text
    cfg, tok = plan.cfg, plan.tokenizer
    out.print(f'3. training the {preset} preset ({cfg.model.layers} layers, hidden {cfg.model.hidden}, context '
              f'{cfg.model.seq_len}) '
              f'for {iters} steps of {cfg.tokens_per_step:,} tokens on DeepSpeed, on this {device_type().upper()} '
              f'in {cfg.train.precision}')
    if plan.precision_why is not None:
        out.print(f'   {fmt.text(plan.precision_why)}')
    result = train(plan, callbacks=[RichProgress()])
    held = []
    for d in list(read_documents([HELD_OUT]))[:HELD_OUT_ARTICLES]:
        held += tok.encode(clean_text(d.text)) + [tok.eod]
    ours = text_loss(result.engine.module, held, cfg.model.seq_len)
    base = unigram_loss(token_counts(cfg.data.prefix, cfg.data.split, tok.vocab_size), held)
    out.print(f'   trained in {result.seconds:.1f} s: validation loss {result.valid_loss:.3f}, test loss '
              f'{result.test_loss:.3f}; '
              f'checkpoint {fmt.text(result.checkpoint)}')
    out.print(f'4. held-out text (the first {HELD_OUT_ARTICLES} articles of {HELD_OUT}, {len(held):,} tokens): '
              f'loss [bold]{ours:.3f}[/] (perplexity '
              f'{math.exp(ours):,.0f}) '
              f'against [bold]{base:.3f}[/] (perplexity {math.exp(base):,.0f}) for a unigram model of the training '
              f'data: {base - ours:.2f} nats better\n')
    return ours, base


def _sample_stage(run: Path, prompt: str = 'And the king said unto', tokens: int = 80):
    "Stream a sample from the trained checkpoint, loaded by its path as `gptkit generate` does"
    from gptkit.generate import Generator
    from gptkit.sampling import Sampling
    gen = Generator.from_checkpoint(run, device='cpu', dtype='auto')
    out.print(f'\n[bold]9. A sample from the model trained above[/] (gptkit generate --checkpoint {fmt.text(run)} '
              '--top-k 40 '
              f'--temperature 0.8 '
              '--seed 0):', soft_wrap=True)
    out.print(f'[bold]{prompt}[/]', end='')
    for c in gen.stream([prompt], Sampling(max_new_tokens=tokens, temperature=0.8, top_k=40, seed=0)):
        out.print(c.text, end='', markup=False, highlight=False)
    out.print()


def _estimate_stage():
    t = Table(title='5. The GPT-3 family (Brown et al. 2020), parameters counted as Megatron counts them',
              title_justify='left')
    for col in ('preset', 'layers', 'hidden', 'heads', 'parameters', 'padded vocabulary'):
        t.add_column(col, justify='right')
    for name in GPT3_PRESETS:
        m = PRESETS[name].model
        c = count_params(m)
        t.add_row(name, str(m.layers), str(m.hidden), str(m.heads), f'{c.total:,}', str(c.vocab_padded))
    out.print(t)
    t = Table(title='   and the Llama family: Llama 3, SmolLM2, TinyLlama, Qwen2.5, Qwen3, Mistral '
                    '(rotary, RMSNorm, SwiGLU, grouped-query attention)',
              title_justify='left')
    for col in ('preset', 'layers', 'hidden', 'heads / KV', 'SwiGLU', 'parameters'):
        t.add_column(col, justify='right')
    for name in LLAMA_PRESETS:
        m = PRESETS[name].model
        t.add_row(name, str(m.layers), str(m.hidden), f'{m.heads} / {m.kv}', str(m.ffn), f'{count_params(m).total:,}')
    out.print(t)

    m125 = PRESETS['125m'].model
    t = Table(title='6. GPT-3 125M on one A100-80GB: memory per GPU against micro-batch '
                    '(bf16, ZeRO 0, flash attention)',
              title_justify='left')
    for col in ('micro-batch', 'model states', 'activations', 'logits', 'total', 'fits'):
        t.add_column(col, justify='right')
    overtaken = None
    for mb in (1, 2, 4, 8, 16, 64):
        mem = estimate(m125, ParallelConfig(), TrainConfig(micro_batch=mb, global_batch=256), GPUS['a100-80gb']).memory
        states = mem.weights + mem.gradients + mem.optimizer
        if overtaken is None and mem.logits > states:
            overtaken = mb
        t.add_row(str(mb), fmt.gib(states), fmt.gib(mem.activations),
                  fmt.gib(mem.logits), fmt.gib(mem.total), '[green]yes[/]' if mem.fits else '[red]no[/]')
    out.print(t)
    if overtaken:
        out.print(f"[dim]From micro-batch {overtaken} the logits (batch x sequence x vocabulary, with the loss's fp32 "
                  'copies) take more memory than all the model states.[/]\n')

    e = estimate(PRESETS['13b'].model, ParallelConfig(tp=8, pp=2, dp=4, zero=1, sequence_parallel=True),
                 TrainConfig(micro_batch=1, global_batch=1024, recompute='selective'), GPUS['a100-80gb'])
    out.print(f'[bold]7. GPT-3 13B on 64 A100-80GB[/] (tp 8, pp 2, ZeRO 1, selective recompute): '
              f'{fmt.gib(e.memory.total)} per GPU, {fmt.flops(e.flops_per_iteration)} per step, '
              f'{e.iterations:,} steps for 300B tokens, {fmt.duration(e.seconds)} at 40% MFU '
              f'({e.to_dict()["time"]["gpu_hours"]:,.0f} GPU-hours).\n')

    best = search(PRESETS['13b'].model, GPUS['a100-80gb'], 64, global_batch=1024, top=3)
    t = Table(title='8. The three fastest layouts for 13B on 64 A100-80GB (gptkit estimate --params 13B --search '
                    '--gpus 64)',
              title_justify='left')
    for col in ('tp', 'pp', 'dp', 'ZeRO', 'recompute', 'micro', 'memory/GPU', 'days'):
        t.add_column(col, justify='right')
    for b in best:
        t.add_row(str(b.parallel.tp), str(b.parallel.pp), str(b.parallel.dp), str(b.parallel.zero), b.train.recompute,
                  str(b.train.micro_batch), fmt.gib(b.memory.total), f'{b.layout_seconds / 86400:.1f}')
    out.print(t)
