"""The launch options of `gptkit train` read from click, and commands run again in tensor-parallel processes. What a
launch is, its launcher commands, job files and output live in the library (gptkit.train.launch, chapter 11f)."""
from __future__ import annotations

import os
import sys

from gptkit.train.launch import leave_group_at_exit, run_launcher

LAUNCH_OPTIONS = ('--nproc', '--launcher', '--nnodes', '--node-rank', '--master-addr', '--master-port', '--hostfile',
                  '--emit', '--image', '--max-restarts')
LAUNCH_FLAGS = ('--dry-run',)


def train_argv(ctx) -> list[str]:
    """The `gptkit train` options this command was given (click's parsed values, not sys.argv, so it is right
    however the command was called), without those that say where to run (they become the launcher's)"""
    argv = []
    for p in ctx.command.params:
        value = ctx.params.get(p.name)
        opt = p.opts[0]
        if value is None or value == p.default or opt in LAUNCH_OPTIONS + LAUNCH_FLAGS or p.hidden:
            continue
        if getattr(p, 'is_flag', False):
            if value:
                argv.append(opt)
            elif p.secondary_opts:
                argv.append(p.secondary_opts[0])
        elif getattr(p, 'multiple', False):
            argv += [a for v in value for a in (opt, str(v))]
        else:
            argv += [opt, str(value)]
    return argv


def _free_port() -> int:
    "A free TCP port (gptkit.train.engine imported only now: off the CLI's start-up path)"
    from gptkit.train.engine import free_port
    return free_port()


def launch_tp(ctx, command: str, tp: int, extra: list[str] = ()) -> int:
    """`gptkit COMMAND` with this command's options again, in `tp` processes on this machine under torchrun (each
    finds RANK set and joins with `join_tp`); its exit code"""

    argv = [a for a in train_argv(ctx) if a not in extra]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(tp), '--master_port',
           str(_free_port()), '-m', 'gptkit_cli.main', command] + argv + list(extra)
    env = {**os.environ, 'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS', '1')}
    return run_launcher(cmd, env, own_session=True)


def join_tp(device: str | None) -> tuple[int, str]:
    "Join the torchrun job; only rank 0 prints. (this rank, its device: its local GPU, or the CPU)"
    import torch

    from gptkit.train.engine import init_distributed
    from gptkit_cli.app import err, out
    rank, _, local = init_distributed()
    leave_group_at_exit()
    if rank != 0:
        out.quiet = err.quiet = True
    if (device or ('cuda' if torch.cuda.is_available() else 'cpu')) == 'cpu':
        return rank, 'cpu'
    torch.cuda.set_device(local)
    return rank, f'cuda:{local}'
