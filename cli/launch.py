"""Where `gptkit train` runs: the torchrun or deepspeed command for local and multi-node runs, and the job files
(`--emit slurm`, `--emit k8s`) that start the same command on a cluster. gptkit invents no cluster machinery: the
scheduler starts one launcher per node, the launcher starts the processes, torch.distributed connects them."""
from __future__ import annotations

import atexit
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from gptkit.errors import ConfigError

LAUNCHERS = ('torchrun', 'deepspeed')
EMITS = ('slurm', 'k8s')
DEFAULT_PORT = 29500          # torchrun's and DeepSpeed's own default
# Options that say where to run, not what: dropped from the command a launcher or a job file runs on each node
LAUNCH_OPTIONS = ('--nproc', '--launcher', '--nnodes', '--node-rank', '--master-addr', '--master-port', '--hostfile',
                  '--emit', '--image', '--max-restarts')
LAUNCH_FLAGS = ('--dry-run',)


@dataclass
class Launch:
    "How many processes on how many nodes, and how they find each other"
    launcher: str = 'torchrun'
    nproc: int = 1                 # processes on each node
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None # the node that node rank 0 runs on (default 127.0.0.1 for one node)
    master_port: int | None = None
    hostfile: Path | None = None   # DeepSpeed's: one line 'host slots=N' per node; deepspeed starts them all by ssh
    max_restarts: int = 0          # torchrun restarts every process this often when one fails (they resume)

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    @property
    def nodes(self) -> int:
        "Machines the launch spans: --nnodes, or the hosts a DeepSpeed hostfile names"
        if self.hostfile is None or not self.hostfile.is_file():
            return self.nnodes
        lines = self.hostfile.read_text(errors='replace').splitlines()
        return max(self.nnodes, sum(1 for line in lines if line.strip() and not line.lstrip().startswith('#')))

    def problems(self, launching: bool = True) -> list[tuple[str, str]]:
        "What cannot work; `launching` False (a job file) leaves the master to the scheduler"
        out = []
        if self.launcher not in LAUNCHERS:
            out.append(('launcher', f'{{key}} must be torchrun or deepspeed, not '
                                                                   f'{self.launcher!r}'))
        if self.nproc < 1:
            out.append(('nproc', f'{{key}} must be at least 1, not {self.nproc}'))
        if self.nnodes < 1:
            out.append(('nnodes', f'{{key}} must be at least 1, not {self.nnodes}'))
        elif not 0 <= self.node_rank < self.nnodes:
            out.append(('node_rank', f'{{key}} must be from 0 to {self.nnodes - 1} (--nnodes {self.nnodes}), '
                                     f'not {self.node_rank}'))
        if self.master_port is not None and not 0 < self.master_port < 65536:
            out.append(('master_port', f'{{key}} must be a TCP port from 1 to 65535, not {self.master_port}'))
        if launching and self.nnodes > 1 and not self.master_addr and self.hostfile is None:
            out.append(('master_addr', '{key} is needed with --nnodes above 1: the address of the node with '
                                       '--node-rank 0, the same on every node'))
        if self.max_restarts < 0:
            out.append(('max_restarts', f'{{key}} must be 0 or more, not {self.max_restarts}'))
        elif self.max_restarts and self.launcher != 'torchrun':
            out.append(('max_restarts', "{key} is torchrun's (its elastic agent restarts the processes); use "
                                        '--launcher torchrun'))
        if self.hostfile is not None:
            if self.launcher != 'deepspeed':
                out.append(('hostfile', "{key} is DeepSpeed's (it starts every node by ssh); add --launcher deepspeed"))
            elif not self.hostfile.is_file():
                out.append(('hostfile', f'{{key}} {self.hostfile}: no such file'))
        return out

    def command(self, argv: list[str], port: int) -> list[str]:
        "The launcher command that runs `gptkit train argv` on this node (all nodes, with a DeepSpeed hostfile)"
        if self.launcher == 'torchrun':
            head = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(self.nproc),
                    '--master_port', str(port)] + _restarts(self.max_restarts)
            if self.nnodes > 1:
                head += ['--nnodes', str(self.nnodes), '--node_rank', str(self.node_rank),
                         '--master_addr', self.master_addr]
            head.append('-m')
        else:
            head = [sys.executable, '-m', 'deepspeed.launcher.runner', '--num_gpus', str(self.nproc),
                    '--master_port', str(port)]
            if self.hostfile is not None:
                head += ['--hostfile', str(self.hostfile)] + (['--master_addr', self.master_addr]
                                                               if self.master_addr else [])
            elif self.nnodes > 1:
                head += ['--no_ssh', '--num_nodes', str(self.nnodes), '--node_rank', str(self.node_rank),
                         '--master_addr', self.master_addr]
            head.append('--module')
        return head + ['gptkit_cli.main', 'train'] + argv


def _restarts(k: int) -> list[str]:
    return ['--max_restarts', str(k)] if k else []


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


def _with_resume(argv: list[str]) -> list[str]:
    "A job that the scheduler may restart continues from its newest checkpoint (none yet: it starts afresh)"
    return argv if '--resume' in argv else argv + ['--resume']


def slurm_script(launch: Launch, argv: list[str], name: str) -> str:
    """An sbatch script: one srun task per node runs torchrun, which starts `launch.nproc` processes there.
    SLURM's SIGTERM two minutes before the time limit makes the run save and exit 143; --requeue and --resume
    continue it in a new job"""
    port = launch.master_port or DEFAULT_PORT
    cmd = ['torchrun', '--nnodes', '"$SLURM_NNODES"', '--nproc_per_node', str(launch.nproc),
           *_restarts(launch.max_restarts),
           '--rdzv_id', '"$SLURM_JOB_ID"', '--rdzv_backend', 'c10d', '--rdzv_endpoint', '"$MASTER_ADDR:$MASTER_PORT"',
           '-m', 'gptkit_cli.main', 'train', *map(shlex.quote, _with_resume(argv))]
    return '\n'.join([
        '#!/bin/bash',
        f'#SBATCH --job-name={name}',
        f'#SBATCH --nodes={launch.nnodes}',
        '#SBATCH --ntasks-per-node=1',
        f'#SBATCH --gpus-per-node={launch.nproc}',
        '#SBATCH --signal=TERM@120',
        '#SBATCH --requeue',
        '#SBATCH --output=%x-%j.out',
        'set -euo pipefail',
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export MASTER_PORT={port}',
        'srun ' + ' '.join(cmd),
        ''])


def k8s_manifest(launch: Launch, argv: list[str], name: str, image: str) -> str:
    """A Kubeflow PyTorchJob: a Master and `nnodes - 1` Workers, one pod per node, each running torchrun with
    `nproc` processes (the training operator sets the PET_* variables torchrun reads: nodes, node rank, master)"""
    import yaml
    def replica(n: int) -> dict:
        container = {'name': 'pytorch', 'image': image,
                     'command': ['torchrun', *_restarts(launch.max_restarts), '-m', 'gptkit_cli.main', 'train',
                                 *_with_resume(argv)],
                     'resources': {'limits': {'nvidia.com/gpu': launch.nproc}}}
        return {'replicas': n, 'restartPolicy': 'OnFailure', 'template': {'spec': {'containers': [container]}}}
    specs = {'Master': replica(1)}
    if launch.nnodes > 1:
        specs['Worker'] = replica(launch.nnodes - 1)
    job = {'apiVersion': 'kubeflow.org/v1', 'kind': 'PyTorchJob', 'metadata': {'name': name},
           'spec': {'nprocPerNode': str(launch.nproc), 'pytorchReplicaSpecs': specs}}
    return yaml.safe_dump(job, sort_keys=False)


def job_name(out: str | None) -> str:
    "A job name from the run folder: lower case letters, digits and dashes, as Kubernetes requires"
    base = re.sub(r'[^a-z0-9-]+', '-', Path(out or 'run').name.lower()).strip('-') or 'run'
    return f'gptkit-{base}'[:63].rstrip('-')


def emit(kind: str, launch: Launch, argv: list[str], out: str | None, image: str | None) -> str:
    "The job file `--emit kind` prints"
    if kind not in EMITS:
        raise ConfigError([('emit', f'{{key}} must be slurm or k8s, not {kind!r}')])
    if kind == 'slurm':
        return slurm_script(launch, argv, job_name(out))
    if not image:
        raise ConfigError([('image', '{key} is needed with --emit k8s: the container image with gptkit '
                                               'installed that every pod runs')])
    return k8s_manifest(launch, argv, job_name(out), image)


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


# torchrun's own log lines ('W1124 17:17:54.413000 16720 .../torch/distributed/elastic/...] Sending process ...')
_LAUNCHER_LOG = re.compile(r'^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/')
_SIGNALLED = re.compile(r'SignalException: Process \d+ got signal: (\d+)')
_ROOT_CAUSE = re.compile(r'Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)', re.S)


class _LauncherOutput:
    """The processes' messages on stderr as they come, without the launcher's own report of a failure (its log
    lines, its traceback and its table of ranks), which says nothing a user can act on once a rank has said what
    went wrong; an error line that several ranks print alike is shown once. GPTKIT_DEBUG=1 shows everything"""
    def __init__(self, debug: bool):
        self.debug, self.held, self.errors = debug, [], set()

    def relay(self, stream):
        for line in stream:
            if self.debug:
                self._write(line)
            elif _LAUNCHER_LOG.match(line):
                continue
            elif self.held or line.startswith('Traceback'):
                self.held.append(line)   # shown at the end
            elif line.startswith('error:'):
                if line not in self.errors:
                    self.errors.add(line)
                    self._write(line)
            else:
                self._write(line)

    @staticmethod
    def _write(text: str):
        sys.stderr.write(text)
        sys.stderr.flush()

    def finish(self, code: int) -> int:
        """After the launcher exited with `code`: a process's own traceback as it was, the launcher's as one line;
        the exit code to give (128 + the signal when the launcher was stopped by one, as its processes were)"""
        for b in filter(None, re.split(r'(?m)^(?=Traceback)', ''.join(self.held))):
            if 'torch/distributed/run.py' not in b and 'ChildFailedError' not in b:
                self._write(b)
                continue
            signalled = _SIGNALLED.search(b)
            if signalled:
                code = 128 + int(signalled[1])
                continue     # the processes said what they did with it
            why = self._why(b)
            if why and code:
                self._write(f'error: {why}\n')
        return code

    def _why(self, report: str) -> str | None:
        "One sentence for the launcher's report, or None when a process has already said why it stopped"
        m = _ROOT_CAUSE.search(report)
        if m is None:
            last = report.strip().splitlines()[-1] if report.strip() else 'failed'
            return f'torchrun: {last} (GPTKIT_DEBUG=1 shows its traceback)'
        rank, code = int(m[1]), int(m[2])
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f'signal {-code}'
            hint = ' (the kernel kills with SIGKILL when memory runs out)' if name == 'SIGKILL' else ''
            return f'rank {rank} was stopped by {name}{hint}, so torchrun stopped the other processes'
        if self.errors:
            return None
        return (f'rank {rank} exited with code {code}, so torchrun stopped the other processes (its messages, if any, '
                'are above; GPTKIT_DEBUG=1 shows torchrun\'s report)')


def run_launcher(cmd: list[str], env: dict | None = None, own_session: bool = False) -> int:
    """Run a launcher (torchrun, deepspeed) to its end, showing its processes' messages (`_LauncherOutput`); its exit
    code, 130 after Ctrl-C. `own_session`: the launcher does not get the terminal's Ctrl-C; this process hands it one
    SIGINT to pass on (else the terminal sends it to every process, which each finish their step and save)"""
    output = _LauncherOutput(bool(os.environ.get('GPTKIT_DEBUG')))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors='replace',
                            start_new_session=own_session)
    # A scheduler's SIGTERM or SIGUSR1 reaches this process too: it stays until the launcher ends, since the
    # processes write to it while they save (and passes the signal on when the launcher is in a session of its own)
    def pass_on(sig, frame):
        if own_session:
            os.kill(proc.pid, sig)
    before = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGUSR1)}
    t = threading.Thread(target=output.relay, args=(proc.stderr,), daemon=True)
    t.start()
    interrupted = False
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                if own_session and not interrupted:
                    os.kill(proc.pid, signal.SIGINT)
                interrupted = True
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    t.join(timeout=5)
    if interrupted:
        return 130
    return output.finish(code)


def leave_group():
    "Destroy the process group this rank joined, if it is still there (no barrier: a failed rank must not wait)"
    dist = sys.modules.get('torch.distributed')       # never imported: no group (and no import while exiting)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_group_at_exit():
    """Have the interpreter destroy the process group as it exits (once, however many commands ran in this process):
    gloo's threads are stopped, not torn down by the exit (a rank's SIGABRT), and NCCL warns of leaked communicators.
    Not sooner: DeepSpeed keeps the group, and a later run in the same process would find it destroyed"""
    atexit.unregister(leave_group)
    atexit.register(leave_group)


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
