"""Hostile cases around one dataset prefix, run as a user runs them (the CLI, real processes): two writers of one
prefix at once, the temporaries a killed prepare left as `data inspect` sees them, and an .idx whose pointers or
document index do not describe its .bin."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_SETS, run_here

DIST_ENV = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'LOCAL_WORLD_SIZE')

# A prepare that writes its first batch, says so and then waits (a slow prepare, paused mid-write, holding the lock)
PAUSED = '''
import sys
from gptkit.data.prepare import PrepareConfig, prepare
def paused(p):
    print('writing', flush=True)
    sys.stdin.readline()
prepare(PrepareConfig(inputs=(sys.argv[1],), output_prefix=sys.argv[2], tokenizer='gpt2', overwrite=True), paused, every=0)
'''


def _one_line_error(r) -> str:
    "The error a command printed: one line, no traceback"
    err = re.sub(r'SystemExit\(\d+\)$', '', r.stderr.strip()).strip()   # run_here adds the exit it caught
    assert 'Traceback' not in r.stderr and err.startswith('error:') and len(err.splitlines()) == 1, r.stderr
    return err


def _paused_prepare(src: Path, out: Path) -> subprocess.Popen:
    "A real process that prepares `src` onto `out`, stopped after its first batch until its stdin gets a line"
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    proc = subprocess.Popen([sys.executable, '-c', PAUSED, str(src), str(out)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line == 'writing\n', line + proc.communicate()[1]
    return proc


def _docs(path: Path, n: int) -> Path:
    path.write_text(''.join(json.dumps({'text': f'document {i} of a small corpus'}) + '\n' for i in range(n)))
    return path


def test_a_second_writer_of_one_prefix_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / 'cc' / 'a'
    prefix = tmp_path / 'cc' / 'a_text_document'
    one = tmp_path / 'one.txt'
    one.write_text('one document')
    first = _paused_prepare(_docs(tmp_path / 'big.jsonl', 300), out)
    try:
        for extra in ([], ['--overwrite']):                          # --overwrite replaces a dataset, not a writer
            r = run_here('data', 'prepare', '-i', one, '--tokenizer', 'gpt2', '--output-prefix', out, *extra)
            assert r.returncode == 1, r.stdout + r.stderr
            msg = _one_line_error(r)
            assert msg.startswith(f'error: {prefix} is in use by process {first.pid} on '), msg
            assert 'since ' in msg and '--output-prefix' in msg, msg
        r = run_here('data', 'prepare', '-i', one, '--tokenizer', 'gpt2', '--output-prefix', tmp_path / 'b')
        assert r.returncode == 0, r.stderr                             # another prefix: written
        r = run_here('data', 'merge', '-i', tmp_path / 'b_text_document', '--output-prefix', prefix)
        assert r.returncode == 1 and f'is in use by process {first.pid}' in _one_line_error(r), r.stdout + r.stderr
        r = run_here('data', 'inspect', prefix)                       # not there yet: who is writing it
        assert r.returncode == 1, r.stdout
        msg = _one_line_error(r)
        assert msg.startswith(f'error: {prefix}: not written yet, it is being written by process {first.pid} on '), msg
        first.communicate('go\n', timeout=60)
        assert first.returncode == 0
    finally:
        first.kill()
        first.wait()
    r = run_here('data', 'inspect', prefix)
    assert r.returncode == 0 and '300 documents' in ' '.join(r.stdout.split()), r.stdout   # the first run's, whole
    r = run_here('data', 'prepare', '-i', one, '--tokenizer', 'gpt2', '--output-prefix', out)
    assert r.returncode == 1 and 'already exists and holds 300 documents' in _one_line_error(r)


def test_inspect_says_a_prepare_was_killed(tmp_path):
    out = tmp_path / 'a'
    prefix = tmp_path / 'a_text_document'
    killed = _paused_prepare(_docs(tmp_path / 'big.jsonl', 300), out)
    killed.send_signal(signal.SIGKILL)                                # mid-write: only its temporary is left
    killed.communicate()
    tmp = Path(f'{prefix}.bin.tmp-{killed.pid}')
    assert tmp.is_file()
    r = run_here('data', 'inspect', prefix)
    assert r.returncode == 1, r.stdout
    msg = _one_line_error(r)
    assert msg.startswith(f'error: {prefix}.bin: no such file, only {tmp.name} (') and 'that was killed' in msg, msg
    assert 'run it again' in msg, msg
    r = run_here('data', 'prepare', '-i', tmp_path / 'big.jsonl', '--tokenizer', 'gpt2', '--output-prefix', out)
    assert r.returncode == 0 and not tmp.exists(), r.stdout + r.stderr   # the rerun removed it
    # a dataset, and beside it the temporary of a killed --overwrite: both shown
    killed = _paused_prepare(_docs(tmp_path / 'small.jsonl', 7), out)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    tmp = Path(f'{prefix}.bin.tmp-{killed.pid}')
    r = run_here('data', 'inspect', prefix)
    assert r.returncode == 0 and '300 documents' in ' '.join(r.stdout.split()), r.stdout + r.stderr
    shown = ' '.join(r.stdout.split())
    assert f'{tmp.name} (0.0 MB): left by a prepare or merge of this prefix that was killed' in shown, shown


def test_a_live_writers_temporary_is_not_called_killed(tmp_path):
    out = tmp_path / 'a'
    prefix = tmp_path / 'a_text_document'
    assert run_here('data', 'prepare', '-i', _docs(tmp_path / 'd.jsonl', 5), '--tokenizer', 'gpt2',
                    '--output-prefix', out).returncode == 0
    live = _paused_prepare(tmp_path / 'd.jsonl', out)                 # --overwrite, still writing
    try:
        r = run_here('data', 'inspect', prefix)
        assert r.returncode == 0 and '5 documents' in ' '.join(r.stdout.split()), r.stdout + r.stderr
        shown = ' '.join(r.stdout.split())
        assert 'killed' not in shown and f'is being written again by process {live.pid}' in shown, shown
    finally:
        live.kill()
        live.wait()


def _lie(dst: Path, src: Path, change):
    "Copy dataset `src` to `dst` with `change(lengths, pointers, document_indices)` applied to its .idx"
    from gptkit.data.indexed import HEADER
    for ext in ('.bin', '.metadata'):
        shutil.copy(f'{src}{ext}', f'{dst}{ext}')
    idx = bytearray(Path(f'{src}.idx').read_bytes())
    _, _, _, n, d = HEADER.unpack(bytes(idx[:HEADER.size]))
    lengths = np.frombuffer(idx, np.int32, n, HEADER.size)
    pointers = np.frombuffer(idx, np.int64, n, HEADER.size + 4 * n)
    docs = np.frombuffer(idx, np.int64, d, HEADER.size + 12 * n)
    change(lengths, pointers, docs)
    Path(f'{dst}.idx').write_bytes(bytes(idx))
    return dst


LIES = {
    'docsbad': (lambda lens, ptrs, docs: docs.__setitem__(3, 10**9),
                'its document index goes down at entry 4 (from 1,000,000,000 to 4)'),
    'docsdesc': (lambda lens, ptrs, docs: docs.__setitem__(2, 0),
                 'its document index goes down at entry 2 (from 1 to 0)'),
    'docsstart': (lambda lens, ptrs, docs: docs.__setitem__(0, 1), 'its document index runs from 1 to '),
    'ptrall': (lambda lens, ptrs, docs: ptrs.__iadd__(10**12), 'sequence 0 points at byte 1,000,000,000,000, but'),
    'ptrshift': (lambda lens, ptrs, docs: ptrs.__setitem__(slice(1, None), ptrs[1:] + 2), 'sequence 1 points at byte'),
}


@pytest.mark.parametrize('lie', LIES)
def test_inspect_refuses_an_index_that_lies_about_its_bin(tmp_path, tiny_data, lie):
    change, why = LIES[lie]
    bad = _lie(tmp_path / f'x_{lie}', Path(tiny_data[0]), change)
    r = run_here('data', 'inspect', bad)
    assert r.returncode == 1, r.stdout + r.stderr
    msg = _one_line_error(r)
    assert msg.startswith(f'error: {bad}.idx: corrupt index, {why}') and 'again' in msg, msg


def test_train_refuses_an_index_with_pointers_beyond_its_bin(tmp_path, tiny_data):
    change, why = LIES['ptrall']
    bad = _lie(tmp_path / 'x_ptrall', Path(tiny_data[0]), change)
    r = run_here('train', '--data', bad, '--tokenizer', tiny_data[1], '--out', tmp_path / 'run',
                 *[a for s in [*TINY_SETS, 'data.split=100,0,0'] for a in ('--set', s)])
    assert r.returncode == 1, r.stdout + r.stderr
    msg = _one_line_error(r)
    assert f'{bad}.idx: corrupt index, {why}' in msg, msg


def test_the_datasets_prepare_and_merge_write_still_open_fast(tmp_path, tiny_data):
    from gptkit.data.indexed import IndexedDataset
    r = run_here('data', 'merge', '-i', tiny_data[0], '-i', tiny_data[0], '--output-prefix', tmp_path / 'twice')
    assert r.returncode == 0, r.stderr
    for prefix in (tiny_data[0], tmp_path / 'twice'):
        t0 = time.perf_counter()
        ds = IndexedDataset(prefix)
        assert time.perf_counter() - t0 < 0.5 and ds.num_documents > 1000
