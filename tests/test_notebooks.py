"""Every notebook in nbs/ runs through nbdev's test runner, one pytest test each."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / 'nbs').glob('*.ipynb'))


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(nb, request):
    flags = request.config.getoption('--nb-flags')
    cmd = [str(Path(sys.executable).parent / 'nbdev-test'), nb.name] + (['--flags', flags] if flags else [])
    env = {**os.environ, 'MPLBACKEND': 'Agg'}
    r = subprocess.run(cmd, cwd=nb.parent, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f'{nb.name} failed:\n{r.stdout[-5000:]}\n{r.stderr[-10000:]}'
