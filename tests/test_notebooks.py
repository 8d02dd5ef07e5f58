"""Every notebook in nbs/ runs through nbdev's test runner, one pytest test each.

They run one after another in one runner process (tests/notebook_runner.py), as in each of `nbdev-test`'s workers, so
torch, DeepSpeed and transformers are imported once and not sixty times. A notebook that fails there is run again alone
by `nbdev-test`, as a user runs it: the test fails when it fails alone too, with nbdev-test's report; one that passes
alone warns that it failed after the others (state one notebook left for the next). A runner that crashed, or has grown
past RUNNER_MOST_BYTES, is replaced by a fresh one; the notebooks in ALONE always run by themselves."""
import json
import os
import selectors
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / 'nbs').glob('*.ipynb'))
NOTEBOOK_SECONDS = 1800           # the most one notebook may take
RUNNER_MOST_BYTES = 6 << 30       # a runner resident past this is replaced before the next notebook
# notebooks that set TRITON_INTERPRET=1, which Triton reads once, when it is first imported: each runs alone
ALONE = {'09_kernels.fused', '09b_kernels.qk', '09c_kernels.moe'}


def environment() -> dict:
    return {**os.environ, 'MPLBACKEND': 'Agg'}


class Runner:
    "The runner process, started when first needed and again after a crash, a failure or too much memory"
    def __init__(self):
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / 'tests' / 'notebook_runner.py')], cwd=ROOT / 'nbs',
                                     env=environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def run(self, nb: Path, flags: str) -> dict:
        "One notebook's reply, or a failed one naming why the runner gave none"
        if self.proc is None:
            self.start()
        self.proc.stdin.write(json.dumps({'nb': str(nb), 'flags': flags}) + '\n')
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:     # epoll: select() refuses descriptors past 1,023, which a long
            sel.register(self.proc.stdout, selectors.EVENT_READ)      # session of tests reaches
            ready = sel.select(NOTEBOOK_SECONDS)
        line = self.proc.stdout.readline() if ready else ''
        if not line:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {'ok': False, 'error': 'the runner ended or timed out without a reply', 'rss': 0}
        reply = json.loads(line)
        if not reply['ok'] or reply['rss'] > RUNNER_MOST_BYTES:
            self.stop()
        return reply


@pytest.fixture(scope='module')
def runner():
    r = Runner()
    yield r
    r.stop()


def alone(nb: Path, flags: str) -> subprocess.CompletedProcess:
    "The notebook in nbdev-test of its own, as a user runs it"
    cmd = [str(Path(sys.executable).parent / 'nbdev-test'), nb.name] + (['--flags', flags] if flags else [])
    return subprocess.run(cmd, cwd=nb.parent, env=environment(), capture_output=True, text=True,
                          timeout=NOTEBOOK_SECONDS)


@pytest.mark.parametrize('nb', NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(nb, runner, request):
    flags = request.config.getoption('--nb-flags')
    reply = runner.run(nb, flags) if nb.stem not in ALONE else {'ok': False, 'error': None}
    if reply['ok']:
        return
    r = alone(nb, flags)
    assert r.returncode == 0, f'{nb.name} failed:\n{r.stdout[-5000:]}\n{r.stderr[-10000:]}'
    if reply['error'] is not None:
        warnings.warn(f'{nb.name} failed after other notebooks in one process and passed alone:\n{reply["error"]}')
