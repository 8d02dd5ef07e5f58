"""`gptkit doctor`: what this machine can do for training, checked in under a minute."""
from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from gptkit.train.launch import leave_group_at_exit
from gptkit_cli import format as fmt
from gptkit_cli.app import app, handles_errors, out

STYLE = {'ok': '[green]ok[/]', 'failed': '[bold red]FAILED[/]', 'skipped': '[dim]skipped[/]'}


@app.command()
@handles_errors
def doctor(
    steps: Annotated[int, typer.Option(help='Training steps timed for TFLOP/s and MFU (the last half count).',
                                       min=2)] = 20,
    as_json: Annotated[bool, typer.Option('--json', help='Print JSON instead of lines.')] = False,
):
    """Versions, CUDA, NCCL and Triton; every kernel against its reference on this device; a short training run with
    TFLOP/s and MFU; all-reduce bandwidth between local GPUs. On a CPU, what applies, and what was skipped and why."""
    from gptkit.diagnose.doctor import doctor as run

    def show(checks):
        if as_json:
            return
        for c in checks:
            out.print(f'{" " * (7 - len(c.status))}{STYLE[c.status]}  [bold]{fmt.text(c.name)}[/]: '
                      f'{fmt.text(c.detail)}', soft_wrap=True)

    if not as_json:
        out.rule('[bold]gptkit doctor[/]')
    leave_group_at_exit()             # the training check's group
    with out.status('checking...') if not as_json else contextlib.nullcontext():
        checks = run(steps=steps, report=show)
    failed = [c.name for c in checks if c.status == 'failed']
    if as_json:
        out.print_json(json.dumps({'checks': [c.to_dict() for c in checks], 'failed': failed}))
    else:
        skipped = sum(c.status == 'skipped' for c in checks)
        out.print(f'\n{len(checks) - len(failed) - skipped} ok, {skipped} skipped, {len(failed)} failed'
                  + (f': {", ".join(failed)}' if failed else ''))
    if failed:
        raise typer.Exit(1)
