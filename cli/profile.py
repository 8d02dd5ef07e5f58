"""`gptkit profile`: train a few steps under torch.profiler; traces, the top operators, TFLOP/s and MFU."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.table import Table

from gptkit.files import json_text
from gptkit_cli import format as fmt
from gptkit_cli.app import app, err, handles_errors, out
from gptkit_cli.train import RichProgress, request_of

Opt = typer.Option


@app.command()
@handles_errors
def profile(
    preset: Annotated[Optional[str], Opt(
        help='Model and recipe: tiny, small, 125m ... 175b, llama-tiny, llama-3.2-1b, llama-3.1-8b, smollm2-135m, '
             'tinyllama-1.1b, qwen2.5-0.5b, qwen3-0.6b, mistral-7b, moe-tiny, mixtral-8x7b, qwen3-30b-a3b, '
             'olmoe-1b-7b '
             '(default tiny when no --config).')] = None,
    config: Annotated[Optional[Path], Opt(
        help='A JSON or YAML run config (sections model, data, parallel, train, optim).')] = None,
    set_: Annotated[Optional[List[str]], Opt('--set', help='Override one setting: section.key=value (repeat).')] = None,
    steps: Annotated[str, Opt(
        help='Steps to record, counted from 0 like ProfilerStep#N: ranges A-B or N, comma-separated '
             '(2-4,7-9).')] = '3-5',
    data: Annotated[Optional[str], Opt(
        help='Dataset PREFIX (default: the built-in KJV text, tokenized into OUT/data).')] = None,
    tokenizer: Annotated[Optional[str], Opt(
        help="Tokenizer folder or 'gpt2' (default: a BPE trained on the built-in text).")] = None,
    out_dir: Annotated[Path, Opt(
        '--out', help='Folder for the traces, summary.json and the run.')] = Path('gptkit-profile'),
    deepspeed_flops: Annotated[bool, Opt(
        '--deepspeed-flops',
        help="Also run DeepSpeed's flops profiler on one extra step (report in OUT/deepspeed_flops.txt).")] = False,
    stack: Annotated[bool, Opt('--stack/--no-stack', help='Record Python stacks (bigger, slower traces).')] = True,
    top: Annotated[int, Opt(help='Operators in each table.')] = 12,
    force: Annotated[bool, Opt(
        '--force', help='Run even when the estimate says the model does not fit this machine.')] = False,
    as_json: Annotated[bool, Opt('--json', help='Print summary.json only.')] = False,
):
    ("""Profile training steps with torch.profiler: Chrome and TensorBoard traces, top operators by time and """
     """memory, TFLOP/s and MFU.""")
    from gptkit.diagnose.profile import parse_steps, prepare_builtin, profile_run  # torch: only when a profile runs
    ranges = parse_steps(steps)                       # bad --steps fails before anything is built
    if data is None:
        with err.status('tokenizing the built-in KJV text'):
            data, tokenizer = prepare_builtin(out_dir / 'data', tokenizer=tokenizer)
    from gptkit.machine.choices import settle_precision  # off the start-up path
    cfg, why = settle_precision(request_of(preset, config, set_, data=data, tokenizer=tokenizer).run_config())
    callbacks = [] if as_json else [RichProgress()]
    if not as_json:
        out.print(f'[bold]{fmt.text(cfg.preset or "custom")}[/]: profiling '
                  f'step{"s" if len(ranges) > 1 or ranges[0][0] != ranges[0][1] else ""} '
                  f'{steps} of {ranges[-1][1] + 1 + deepspeed_flops} on {cfg.train.precision} -> {fmt.text(out_dir)}')
    if why is not None and not as_json:
        out.print(fmt.text(why))
    res = profile_run(cfg, ranges, out_dir, deepspeed_flops=deepspeed_flops, stack=stack, callbacks=callbacks,
                      force=force)
    if as_json:
        print(json_text(res.to_dict(), indent=1))   # NaN as null
        return
    _report(res, top)


def _report(res, n: int):
    dev = res.device == 'cuda'
    where = 'CUDA' if dev else 'CPU'
    steps = len(res.profiled)
    total = sum((o.self_device_us if dev else o.self_cpu_us) for o in res.ops) or 1.0
    t = Table(title=f'Top operators by self {where} time (per step, over steps '
                    f'{", ".join(_span(r) for r in res.ranges)})', title_justify='left')
    for col, j in (('operator', 'left'), ('category', 'left'), ('calls', 'right'), ('self time', 'right'), ('share',
                                                                                                            'right'),
                   ('FLOPs', 'right')):
        t.add_column(col, justify=j, overflow='fold')
    for o in res.top('time', n):
        us = o.self_device_us if dev else o.self_cpu_us
        t.add_row(fmt.text(o.name), o.category, f'{o.calls / steps:,.0f}', f'{us / steps / 1e3:,.2f} ms',
                  f'{us / total:.1%}',
                  fmt.flops(o.flops / steps) if o.flops else '')
    out.print(t)
    t = Table(title=f'Top operators by self {where} memory (allocated minus freed, per step)', title_justify='left')
    for col, j in (('operator', 'left'), ('calls', 'right'), ('self memory', 'right')):
        t.add_column(col, justify=j,
                                                                                                     overflow='fold')
    for o in res.top('memory', n):
        b = o.self_device_memory if dev else o.self_cpu_memory
        t.add_row(fmt.text(o.name), f'{o.calls / steps:,.0f}', f'{b / steps / 2**20:,.1f} MiB')
    out.print(t)
    if res.categories:
        out.print('[bold]time by category[/] (self time per step, from the traces): '
                  + ', '.join(f'{k} {v * 1e3:,.1f} ms' for k, v in sorted(res.categories.items(),
                                                                          key=lambda kv: -kv[1]) if v > 0))
    per_step = res.seconds / steps
    mfu = f'MFU {res.mfu:.1%} of {res.peak_flops / 1e12:,.0f} TFLOP/s' if res.mfu is not None else \
        'MFU n/a (no known peak for this device' + (': a CPU)' if not dev else ')')
    out.print(f'[bold]throughput[/]: {per_step:.3f} s per profiled step, {fmt.flops(res.flops_per_step)} per step '
              f'(Narayanan et al.) '
              f'-> [bold]{res.tflops:.4f} TFLOP/s[/] per device, {mfu}; the profiler counted '
              f'{fmt.flops(res.profiler_flops_per_step)} per step (matrix multiplications only)', soft_wrap=True)
    if res.plain_tflops is not None:
        plain = res.plain_steps
        out.print(f'[dim]without the profiler (step{"s" if len(plain) > 1 else ""} {", ".join(map(str, plain))}): '
                  f'{sum(res.step_seconds[s] for s in plain) / len(plain):.3f} s per step, {res.plain_tflops:.4f} '
                  f'TFLOP/s[/]')
    if res.deepspeed_flops:
        ds = (f'{fmt.flops(res.deepspeed_fwd_flops)} forward per micro-batch (formula '
              f'{fmt.flops(res.flops_per_step / 3 / res.micro_batches)})'
              if res.deepspeed_fwd_flops else 'no forward FLOPs found in its report')
        out.print(f"[bold]DeepSpeed flops profiler[/]: {ds}; report {fmt.text(res.deepspeed_flops)}")
    out.print(f'traces: {fmt.text(", ".join(res.traces))} (chrome://tracing or ui.perfetto.dev); '
              f'[bold]tensorboard --logdir {fmt.text(res.tensorboard)}[/] (profile plugin); summary '
              f'{fmt.text(Path(res.out) / "summary.json")}', soft_wrap=True)


def _span(r) -> str:
    return f'{r[0]}-{r[1]}' if r[1] > r[0] else str(r[0])
