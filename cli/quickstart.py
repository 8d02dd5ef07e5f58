"""`gptkit quickstart`: the guided tour. For now it tours the estimator; later stages join as they land."""
from __future__ import annotations

import time

from rich.table import Table

from gptkit.config import GPT3_PRESETS, PRESETS, ParallelConfig, TrainConfig
from gptkit.estimate import GPUS, count_params, estimate, search

from gptkit_cli import format as fmt
from gptkit_cli.app import app, handles_errors, out


@app.command()
@handles_errors
def quickstart():
    """The guided tour, run on this machine: for now, sizing GPT-3 models with the estimator."""
    start = time.perf_counter()
    out.rule('[bold]gptkit quickstart[/]: sizing GPT-3 models before renting a GPU')
    t = Table(title='1. The GPT-3 family (Brown et al. 2020), parameters counted as Megatron counts them', title_justify='left')
    for col in ('preset', 'layers', 'hidden', 'heads', 'parameters', 'padded vocabulary'): t.add_column(col, justify='right')
    for name in GPT3_PRESETS:
        m = PRESETS[name].model
        c = count_params(m)
        t.add_row(name, str(m.layers), str(m.hidden), str(m.heads), f'{c.total:,}', str(c.vocab_padded))
    out.print(t)

    m125 = PRESETS['125m'].model
    t = Table(title='2. GPT-3 125M on one A100-80GB: memory per GPU against micro-batch (bf16, ZeRO 0, flash attention)',
              title_justify='left')
    for col in ('micro-batch', 'model states', 'activations', 'logits', 'total', 'fits'): t.add_column(col, justify='right')
    overtaken = None
    for mb in (1, 2, 4, 8, 16, 64):
        mem = estimate(m125, ParallelConfig(), TrainConfig(micro_batch=mb, global_batch=256), GPUS['a100-80gb']).memory
        states = mem.weights + mem.gradients + mem.optimizer
        if overtaken is None and mem.logits > states: overtaken = mb
        t.add_row(str(mb), fmt.gib(states), fmt.gib(mem.activations),
                  fmt.gib(mem.logits), fmt.gib(mem.total), '[green]yes[/]' if mem.fits else '[red]no[/]')
    out.print(t)
    if overtaken:
        out.print(f"[dim]From micro-batch {overtaken} the logits (batch x sequence x vocabulary, with the loss's fp32 "
                  'copies) take more memory than all the model states.[/]\n')

    e = estimate(PRESETS['13b'].model, ParallelConfig(tp=8, pp=2, dp=4, zero=1, sequence_parallel=True),
                 TrainConfig(micro_batch=1, global_batch=1024, recompute='selective'), GPUS['a100-80gb'])
    out.print(f'[bold]3. GPT-3 13B on 64 A100-80GB[/] (tp 8, pp 2, ZeRO 1, selective recompute): '
              f'{fmt.gib(e.memory.total)} per GPU, {fmt.flops(e.flops_per_iteration)} per step, '
              f'{e.iterations:,} steps for 300B tokens, {fmt.duration(e.seconds)} at 40% MFU '
              f'({e.to_dict()["time"]["gpu_hours"]:,.0f} GPU-hours).\n')

    best = search(PRESETS['13b'].model, GPUS['a100-80gb'], 64, global_batch=1024, top=3)
    t = Table(title='4. The three fastest layouts for 13B on 64 A100-80GB (gptkit estimate --params 13B --search --gpus 64)',
              title_justify='left')
    for col in ('tp', 'pp', 'dp', 'ZeRO', 'recompute', 'micro', 'memory/GPU', 'days'): t.add_column(col, justify='right')
    for b in best:
        t.add_row(str(b.parallel.tp), str(b.parallel.pp), str(b.parallel.dp), str(b.parallel.zero), b.train.recompute,
                  str(b.train.micro_batch), fmt.gib(b.memory.total), f'{b.layout_seconds / 86400:.1f}')
    out.print(t)
    out.print(f'\nDone in {time.perf_counter() - start:.2f} s. Next: [bold]gptkit estimate --help[/], and the notebooks in nbs/.')
