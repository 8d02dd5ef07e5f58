"""Re-execute the notebooks in place on CPU so that they keep their outputs and plots, then nbdev-clean them.

Each notebook runs top to bottom in its own Jupyter kernel (nbclient), in nbs/, with IN_TEST=1 (so a notebook's
own `nbdev_export()` cell does nothing) and matplotlib's inline backend (plots are kept as PNG). The cells that
nbdev-test leaves out are not run and keep no output: those flagged with a `tst_flags` flag from pyproject.toml
[tool.nbdev] (`#| gpu`, `#| slow`, `#| notest`) unless named in --flags, and `#| eval: false` cells. A notebook
with a failing cell is left as it was, and the command exits 1. nbdev-clean then strips execution counts and
metadata but keeps the outputs, so the diff is the outputs themselves.

Usage: python tools/run_notebooks.py [NOTEBOOK ...] [--jobs 2] [--timeout SECONDS] [--flags "gpu slow"]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'
SKIP_TAG = 'gptkit-run-notebooks-skip'   # set only while running: nbdev-clean would drop it anyway
INLINE = 'module://matplotlib_inline.backend_inline'
ANSI = r'\x1b\[[0-9;]*m'   # the colours of a kernel's traceback
# stderr lines that say nothing about the chapter: DeepSpeed probing for libaio when it builds its op list, and
# the Kineto profiler's trace markers
NOISE = re.compile(r'^(/usr/bin/ld: cannot find -laio.*|collect2: error: ld returned 1 exit status'
                   r'|USDT:.*SyncActivityProfilerHandler.*)$')


def drop_noise(nb) -> None:
    "Remove NOISE lines from the stderr outputs of notebook `nb`, and the stderr outputs left empty"
    for cell in nb.cells:
        if cell.cell_type != 'code': continue
        kept = []
        for o in cell.outputs:
            if o.get('output_type') == 'stream' and o.get('name') == 'stderr':
                o['text'] = ''.join(line for line in o['text'].splitlines(keepends=True)
                                    if not NOISE.match(line.rstrip('\n')))
                if not o['text'].strip(): continue
            kept.append(o)
        cell.outputs = kept


def cells_to_run(path: Path, force_flags: list[str] = ()) -> set[int]:
    "Indices of the cells of the notebook at `path` that nbdev-test runs (nbdev's own rule, with its tst_flags)"
    from nbdev.config import get_config
    from nbdev.test import nb_test_cells
    skip_flags = get_config(path.parent).tst_flags.split()
    return {c.idx_ for c in nb_test_cells(path, skip_flags, list(force_flags))}


def execute(path: Path, timeout: int = 600, force_flags: list[str] = ()) -> int:
    """Run the notebook at `path` in a fresh kernel in its own folder and write it back with its outputs.

    Cells that nbdev-test would skip are not run and lose any old output. Raises nbclient's CellExecutionError
    (notebook untouched) when a cell fails; returns the number of cells run."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    run = cells_to_run(path, force_flags)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != 'code' or i in run: continue
        cell.outputs, cell.execution_count = [], None
        cell.metadata.setdefault('tags', []).append(SKIP_TAG)
    env = {'IN_TEST': '1', 'MPLBACKEND': INLINE}
    NotebookClient(nb, timeout=timeout, kernel_name='python3', skip_cells_with_tag=SKIP_TAG, record_timing=False,
                   resources={'metadata': {'path': str(path.parent)}}).execute(env={**os.environ, **env})
    for cell in nb.cells:
        tags = cell.metadata.get('tags')
        if tags and SKIP_TAG in tags:
            tags.remove(SKIP_TAG)
            if not tags: del cell.metadata['tags']
    drop_noise(nb)
    tmp = path.with_name(path.name + '.tmp')
    nbformat.write(nb, tmp)
    tmp.replace(path)
    return len(run)


def clean(paths: list[Path]):
    "nbdev-clean each notebook: outputs stay, execution counts and metadata go (tests/test_sync.py checks this)"
    for p in paths:
        r = subprocess.run([str(Path(sys.executable).parent / 'nbdev-clean'), '--fname', str(p)], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode or 'Failed' in r.stderr: raise RuntimeError(f'nbdev-clean failed on {p}: {r.stderr.strip()}')


def resolve(names: list[str]) -> list[Path]:
    "The notebooks named (a path, a file name in nbs/ or a stem such as 04_data.indexed), or every one in nbs/"
    if not names: return sorted(p for p in NBS.glob('*.ipynb') if not p.name.startswith(('_', '.')))
    out = []
    for n in names:
        cands = [Path(n), NBS / n, NBS / f'{n}.ipynb']
        p = next((c for c in cands if c.is_file() and c.suffix == '.ipynb'), None)
        if p is None: raise SystemExit(f'{n}: no such notebook (give a path, a name in nbs/ or a stem)')
        out.append(p.resolve())
    return out


def main(argv=None) -> int:
    from nbdev.config import get_config
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('notebooks', nargs='*', help='notebooks to run (default: every notebook in nbs/)')
    ap.add_argument('--jobs', type=int, default=2, help='notebooks run at once (at most 2; default 2)')
    ap.add_argument('--timeout', type=int, default=int(get_config(NBS).cell_timeout),
                    help='seconds one cell may run (default [tool.nbdev] cell_timeout)')
    ap.add_argument('--flags', default='', help='tst_flags whose cells run too, as with nbdev-test (e.g. "gpu")')
    args = ap.parse_args(argv)
    paths = resolve(args.notebooks)
    jobs = max(1, min(args.jobs, 2))
    lock, done, failed = threading.Lock(), [], []
    t_all = time.perf_counter()

    def run_one(path: Path):
        t0 = time.perf_counter()
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        with lock: print(f'start  {rel}', flush=True)
        try: n, err = execute(path, args.timeout, args.flags.split()), None
        except Exception as e: n, err = 0, e
        with lock:
            (failed if err else done).append(path)
            k = len(done) + len(failed)
            secs = time.perf_counter() - t0
            if err is None: print(f'[{k}/{len(paths)}] {rel}: {n} cells in {secs:.1f} s', flush=True)
            else: print(f'[{k}/{len(paths)}] {rel}: FAILED after {secs:.1f} s, left as it was\n'
                        f'{re.sub(ANSI, "", str(err))[-3000:]}', flush=True)

    with ThreadPoolExecutor(jobs) as pool: list(pool.map(run_one, paths))
    clean(sorted(done))
    print(f'{len(done)} of {len(paths)} notebooks executed and cleaned in {time.perf_counter() - t_all:.1f} s'
          + (f'; failed: {", ".join(p.name for p in sorted(failed))}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
