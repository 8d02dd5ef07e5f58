"""The Triton kernels' tests (tests/kernels_interpreted.py) in their own process, with Triton's interpreter on from the start."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_kernels_forward_and_backward_in_the_triton_interpreter():
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'PYTHONUNBUFFERED': '1'}
    for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'): env.pop(k, None)
    r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-rs', '-p', 'no:cacheprovider', str(HERE / 'kernels_interpreted.py')],
                       env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert ' passed' in r.stdout and ' failed' not in r.stdout, r.stdout[-2000:]
