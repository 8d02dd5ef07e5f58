"""Calibration on this machine (issue 33, item 4): train the `tiny` preset for a few dozen steps, fit the `cpu` profile
to it (`gptkit.estimate.calibrate`), then predict runs the fit never saw (other widths and depths, the `small` preset
shortened, other micro-batches, two data-parallel processes) and print predicted against measured.

    .venv/bin/python benchmarks/bench_calibrate.py [--steps 30] [--only tiny,wide] [--keep DIR]

Each run is `gptkit train` in its own process (as a user runs it; `--nproc 2` through torchrun), on the built-in KJV
text with a 512-entry BPE; its step is the median of metrics.jsonl's reports after the first (gptkit.estimate.calibrate)."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptkit.estimate.calibrate import calibrate, predicted_step, read_run  # noqa: E402
from gptkit.estimate.perf import GPUS  # noqa: E402

# name: (preset, --set overrides, processes); the first is the one calibrated on
RUNS = {
    'tiny':        ('tiny', ['train.micro_batch=4', 'train.global_batch=4'], 1),
    'tiny mb 1':   ('tiny', ['train.micro_batch=1', 'train.global_batch=1'], 1),
    'tiny mb 16':  ('tiny', ['train.micro_batch=16', 'train.global_batch=16'], 1),
    'tiny x4 acc': ('tiny', ['train.micro_batch=2', 'train.global_batch=8'], 1),
    'wide 256':    ('tiny', ['model.hidden=256', 'train.micro_batch=4', 'train.global_batch=4'], 1),
    'deep 6':      ('tiny', ['model.layers=6', 'train.micro_batch=4', 'train.global_batch=4'], 1),
    'seq 512':     ('tiny', ['model.seq_len=512', 'train.micro_batch=2', 'train.global_batch=2'], 1),
    'small 2L':    ('small', ['model.layers=2', 'train.micro_batch=4', 'train.global_batch=4'], 1),
    'small':       ('small', ['train.micro_batch=2', 'train.global_batch=2'], 1),
    'tiny dp 2':   ('tiny', ['train.micro_batch=4', 'train.global_batch=8'], 2),
}


def data(folder: Path) -> tuple[str, str]:
    "(dataset prefix, tokenizer folder): the built-in KJV with a 512-entry BPE trained on it (as tests/conftest.py)"
    from gptkit.data.corpus import clean_text, read_documents
    from gptkit.data.prepare import PrepareConfig, prepare
    from gptkit.tokenizer.bpe import save_tokenizer, train_bpe
    save_tokenizer(train_bpe((clean_text(x.text) for x in read_documents(['builtin:kjv'])), 512), folder / 'tok')
    res = prepare(PrepareConfig(inputs=('builtin:kjv',), output_prefix=str(folder / 'kjv'),
                                tokenizer=str(folder / 'tok')))
    return str(res.prefix), str(folder / 'tok')


def train(name: str, preset: str, sets: list[str], nproc: int, steps: int, prefix: str, tok: str, out: Path) -> Path:
    "One `gptkit train` run of `steps` steps into out/NAME, reporting every step, no evaluation"
    run = out / name.replace(' ', '_')
    cmd = [str(ROOT / '.venv/bin/gptkit'), 'train', '--preset', preset, '--data', prefix, '--tokenizer', tok,
           '--out', str(run), '--iters', str(steps), '--force', *(['--nproc', str(nproc)] if nproc > 1 else [])]
    for s in ['train.log_interval=1', f'train.eval_interval={steps + 1}', 'train.eval_iters=1',
              'train.precision=fp32', *sets]:
        cmd += ['--set', s]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f'{name}: gptkit train failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}')
    print(f'  trained {name} in {time.time() - t:.0f} s', file=sys.stderr)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--steps', type=int, default=30)
    ap.add_argument('--only', default='', help='comma-separated run names (the first is calibrated on)')
    ap.add_argument('--keep', default=None, help='keep the run folders here (default: a temporary folder)')
    args = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    names = [n for n in args.only.split(',') if n] or list(RUNS)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        prefix, tok = data(Path(tmp))
        runs = {n: read_run(train(n, *RUNS[n], args.steps, prefix, tok, out)) for n in names}
    first = runs[names[0]]
    fitted = calibrate(first, GPUS['cpu'])
    print(f'calibrated on {names[0]!r} ({first.step_seconds * 1e3:.1f} ms a step): profile cpu -> {fitted.name}, '
          f'GEMM efficiency {GPUS["cpu"].gemm_efficiency:.3f} -> {fitted.gemm_efficiency:.3f}, launch '
          f'{GPUS["cpu"].launch * 1e6:.1f} -> {fitted.launch * 1e6:.1f} us')
    print(f'| run | processes | measured ms | predicted ms (cpu) | ratio | predicted ms (calibrated) | ratio |')
    print('|---|---|---|---|---|---|---|')
    worst = 0.0
    for n, r in runs.items():
        before = predicted_step(r.cfg, r.world, GPUS['cpu']).total
        after = predicted_step(r.cfg, r.world, fitted).total
        if n != names[0]:
            worst = max(worst, abs(after / r.step_seconds - 1))
        print(f'| {n} | {r.world} | {r.step_seconds * 1e3:.1f} | {before * 1e3:.1f} | {before / r.step_seconds:.2f} '
              f'| {after * 1e3:.1f} | {after / r.step_seconds:.2f} |')
    print(f'worst error on the runs not calibrated on: {worst:.1%}')


if __name__ == '__main__':
    main()
