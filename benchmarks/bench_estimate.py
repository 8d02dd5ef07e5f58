"""How fast `gptkit estimate` answers, against DeepSpeed's own memory estimator measured in the same run.

Targets (issue 2): `gptkit estimate --params 13B` under 0.5 s wall; `--search` for 175B on 1024 GPUs under 2 s.
The peer is DeepSpeed's `estimate_zero2_model_states_mem_needs_all_cold` for the same 13B model, run the way a
user runs it: a fresh Python process that imports DeepSpeed (and so torch). `python -c pass` is the floor.
Issue 31's families (a Mistral with its sliding window) are searched the same way.
Run: .venv/bin/python benchmarks/bench_estimate.py [--repeat N]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
GPTKIT = str(BIN / 'gptkit') if (BIN / 'gptkit').exists() else shutil.which('gptkit')
DEEPSPEED = ('from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold as f; '
             'f(total_params=12_853_626_880, num_gpus_per_node=8, num_nodes=1)')


def wall(cmd: list[str], repeat: int) -> float:
    "Median wall-clock seconds of `cmd` over `repeat` runs (after one warm-up run)"
    env = {'DS_ACCELERATOR': 'cpu', 'PATH': str(BIN) + ':/usr/bin:/bin'}
    subprocess.run(cmd, capture_output=True, check=True, env=env)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, env=env)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--repeat', type=int, default=5)
    n = ap.parse_args().repeat
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    floor = wall([sys.executable, '-c', 'pass'], n)
    ours = wall([GPTKIT, 'estimate', '--params', '13B'], n)
    search = wall([GPTKIT, 'estimate', '--params', '175B', '--search', '--gpus', '1024'], n)
    family = wall([GPTKIT, 'estimate', '--preset', 'mistral-7b', '--sliding-window', '4096', '--search', '--gpus', '64'], n)
    peer = wall([sys.executable, '-c', DEEPSPEED], max(1, n // 2))
    from gptkit.config.sections import PRESETS
    from gptkit.estimate.sizing import search as run_search
    from gptkit.estimate.perf import GPUS
    t = time.perf_counter(); run_search(PRESETS['175b'].model, GPUS['a100-80gb'], 1024, global_batch=1536); inproc = time.perf_counter() - t
    print(f'python -c pass                                     {floor:7.3f} s')
    print(f'gptkit estimate --params 13B                       {ours:7.3f} s   target < 0.5 s: {"ok" if ours < 0.5 else "MISSED"}')
    print(f'gptkit estimate --params 175B --search --gpus 1024 {search:7.3f} s   target < 2 s: {"ok" if search < 2 else "MISSED"}'
          f'   (search itself {inproc * 1000:.0f} ms in process)')
    print(f'gptkit estimate --preset mistral-7b --sliding-window 4096 --search --gpus 64 {family:7.3f} s')
    print(f'DeepSpeed zero2 estimator, 13B (peer)              {peer:7.3f} s')
    print(f'ratio gptkit estimate / DeepSpeed estimator: {ours / peer:.3f} ({peer / ours:.1f}x faster)')


if __name__ == '__main__':
    main()
