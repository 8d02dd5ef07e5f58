"""Hostile and careless cases around the data and the run folder, run as a user runs them (the CLI, real processes):
two writers of one run, resuming with another tokenizer, replacing a dataset, merging tokenizers, truncated and
non-regular inputs, temporaries a SIGKILL left, and XML in the encodings the MediaWiki reader reads."""
import bz2
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import TINY_SETS, run_here, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
BG = ROOT / 'tests' / 'data' / 'mediawiki' / 'bgwiki-latest-pages-articles-shortened.xml.bz2'
DIST_ENV = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'LOCAL_WORLD_SIZE')


def _env():
    return {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, 'PYTHONUNBUFFERED': '1'}


def _gptkit(*args, **kw):
    "A real `gptkit ARGS` process (Popen)"
    return subprocess.Popen([sys.executable, '-m', 'gptkit_cli.main', *map(str, args)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _train_args(tiny_data, out, *extra):
    prefix, tok = tiny_data
    return ['train', '--data', prefix, '--tokenizer', tok, '--out', out, *[a for s in TINY_SETS for a in ('--set', s)],
            *extra]


def _one_line_error(r) -> str:
    "The error a command printed: one line, no traceback"
    err = re.sub(r'SystemExit\(\d+\)$', '', r.stderr.strip()).strip()   # run_here adds the exit it caught
    assert 'Traceback' not in r.stderr and err.startswith('error:') and len(err.splitlines()) == 1, r.stderr
    return err


@pytest.fixture(scope='module')
def other_tokenizers(tmp_path_factory):
    "(a 512-entry BPE trained on Milton: same size as tiny_data's, other tokens; a 600-entry one)"
    d = tmp_path_factory.mktemp('tokenizers')
    return train_tokenizer('milton', 512, d / 'milton512'), train_tokenizer('milton', 600, d / 'milton600')


# --- item 4: one writer per run folder ---------------------------------------------------------------------------

@contextmanager
def training(tiny_data, run: Path):
    "A `gptkit train` process into `run` that holds the run's lock while the block runs; SIGKILLed after it"
    from gptkit.store.folders import lock_holder
    first = _gptkit(*_train_args(tiny_data, run, '--iters', '100000'))
    try:
        deadline = time.time() + 120
        while lock_holder(run) is None:
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.1)
        yield first
    finally:
        first.kill()
        first.communicate()


def test_second_training_on_a_run_folder_is_refused_naming_the_holder(tiny_data, tmp_path):
    from gptkit.store.folders import lock_holder
    run = tmp_path / 'run'
    with training(tiny_data, run) as first:
        r = run_here(*_train_args(tiny_data, run, '--iters', '4', '--resume'))
        assert r.returncode == 1, r.stdout + r.stderr
        msg = _one_line_error(r)
        assert f'{run} is in use by process {first.pid} on ' in msg and '(gptkit train --data ' in msg, msg
        assert 'since 20' in msg and '--out' in msg, msg
        r = run_here(*_train_args(tiny_data, run, '--iters', '4', '--resume', '--nproc', '2'))   # the launching side
        assert r.returncode == 1 and f'is in use by process {first.pid}' in r.stderr, r.stdout + r.stderr
    assert lock_holder(run) is None                    # SIGKILL: the kernel dropped the lock


def test_resume_with_another_tokenizer_is_refused_naming_the_flag(tiny_data, other_tokenizers, tmp_path):
    run = tmp_path / 'run'
    r = run_here(*_train_args(tiny_data, run, '--iters', '2'))
    assert r.returncode == 0, r.stdout + r.stderr
    before = (run / 'tokenizer' / 'tokenizer.json').read_bytes()
    same_size, other_size = other_tokenizers
    for tok, what in ((same_size, 'the same 512 entries but other tokens'), (other_size, '600 entries, not its 512')):
        args = _train_args(tiny_data, run, '--iters', '4', '--resume')
        args[args.index('--tokenizer') + 1] = str(tok)
        r = run_here(*args)
        assert r.returncode == 2, r.stdout + r.stderr
        msg = _one_line_error(r)
        assert msg.startswith(f'error: --tokenizer {tok} is not the tokenizer') and what in msg, msg
        assert 'wte.weight' not in msg
    assert (run / 'tokenizer' / 'tokenizer.json').read_bytes() == before       # the run's tokenizer kept
    r = run_here(*_train_args(tiny_data, run, '--iters', '3', '--resume'))    # its own tokenizer: continues
    assert r.returncode == 0 and 'resumed from' in r.stdout, r.stdout + r.stderr


def test_a_killed_saves_staging_folder_is_removed_by_the_next_training(tiny_data, tmp_path):
    run = tmp_path / 'run'
    r = run_here(*_train_args(tiny_data, run, '--iters', '2'))
    assert r.returncode == 0, r.stdout + r.stderr
    ckpts = run / 'checkpoints'
    staged = ckpts / '.tmp-iter_0000003'      # what SIGKILL during a save leaves: the folder, without state.json
    shutil.copytree(ckpts / 'iter_0000002', staged)
    (staged / 'state.json').unlink()
    (run / '.config.json.tmp').write_text('{"half": ')
    from gptkit.store.folders import stale_temporaries
    assert [p.name for p in stale_temporaries(run)] == ['.config.json.tmp', '.tmp-iter_0000003']
    r = run_here('checkpoint', 'inspect', run)                     # shown before anything removes them
    shown = ''.join(r.stdout.split())                               # the table wraps at 80 columns
    assert r.returncode == 0 and 'leftbyakilledrun' in shown and '.tmp-iter_0000003' in shown, r.stdout + r.stderr
    r = run_here('checkpoint', 'inspect', run, '--json')
    assert [Path(p).name for p in json.loads(r.stdout)['stale_temporaries']] == ['.config.json.tmp', '.tmp-iter_0000003']
    r = run_here(*_train_args(tiny_data, run, '--iters', '3', '--resume'))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not staged.exists() and not (run / '.config.json.tmp').exists()
    assert sorted(p.name for p in ckpts.iterdir()) == ['iter_0000002', 'iter_0000003', 'latest']


# --- item 4: datasets ------------------------------------------------------------------------------------------

def _prepare(*args):
    return run_here('data', 'prepare', *args)


def test_prepare_onto_an_existing_dataset_is_refused_unless_overwrite(tmp_path):
    from gptkit.data.indexed import IndexedDataset
    out = tmp_path / 'corpus'
    assert _prepare('--input', 'builtin:kjv', '--output-prefix', out).returncode == 0
    r = _prepare('--input', 'builtin:milton', '--output-prefix', out)
    assert r.returncode == 1
    msg = _one_line_error(r)
    assert f'{out}_text_document.bin already exists and holds 1,189 documents' in msg and '--overwrite' in msg, msg
    assert IndexedDataset(f'{out}_text_document').num_documents == 1189
    r = _prepare('--input', 'builtin:milton', '--output-prefix', out, '--overwrite')
    assert r.returncode == 0, r.stderr
    assert IndexedDataset(f'{out}_text_document').num_documents == 7


def test_merge_of_different_tokenizers_is_refused_unless_asked(tiny_data, tmp_path):
    from gptkit.data.indexed import IndexedDataset, read_metadata
    prefix, tok = tiny_data
    gpt2 = tmp_path / 'gpt2'
    assert _prepare('--input', 'builtin:milton', '--output-prefix', gpt2).returncode == 0
    assert IndexedDataset(prefix).dtype == IndexedDataset(f'{gpt2}_text_document').dtype   # uint16 both
    r = run_here('data', 'merge', '-i', f'{gpt2}_text_document', '-i', prefix, '--output-prefix', tmp_path / 'm')
    assert r.returncode == 1
    msg = _one_line_error(r)
    assert f'{prefix} was prepared with the tokenizer {tok} (512 entries)' in msg, msg
    assert 'the tokenizer gpt2 (50,257 entries)' in msg and '--mixed-tokenizers' in msg, msg
    assert not list(tmp_path.glob('m.*'))
    r = run_here('data', 'merge', '-i', f'{gpt2}_text_document', '-i', prefix, '--output-prefix', tmp_path / 'm',
                 '--mixed-tokenizers')
    assert r.returncode == 0, r.stderr
    assert read_metadata(tmp_path / 'm') is None                        # a mix records no tokenizer
    r = run_here('data', 'merge', '-i', prefix, '-i', prefix, '--output-prefix', tmp_path / 'same')
    assert r.returncode == 0 and read_metadata(tmp_path / 'same')['vocab_size'] == 512, r.stderr


def test_merge_onto_an_existing_dataset_is_refused_unless_overwrite(tiny_data, tmp_path):
    "The merge's output prefix is checked as prepare's is; the dataset there stays whole"
    from gptkit.data.indexed import IndexedDataset
    prefix, _ = tiny_data
    out = tmp_path / 'out[/]m'                       # rich markup in the name: printed as written
    assert run_here('data', 'merge', '-i', prefix, '--output-prefix', out).returncode == 0
    before = IndexedDataset(out).num_documents
    r = run_here('data', 'merge', '-i', prefix, '-i', prefix, '--output-prefix', out)
    assert r.returncode == 1
    msg = _one_line_error(r)
    assert f'{out}.bin already exists and holds {before:,} documents' in msg and '--overwrite' in msg, msg
    assert IndexedDataset(out).num_documents == before
    r = run_here('data', 'merge', '-i', prefix, '-i', prefix, '--output-prefix', out, '--overwrite')
    assert r.returncode == 0 and 'out[/]m.bin/.idx' in r.stdout, r.stdout + r.stderr
    assert IndexedDataset(out).num_documents == 2 * before
    r = run_here('data', 'inspect', out)
    assert r.returncode == 0 and 'out[/]m' in r.stdout, r.stdout + r.stderr


def test_truncated_gzip_fails_unless_keep_truncated(tmp_path):
    from gptkit.data.indexed import IndexedDataset
    text = ''.join(json.dumps({'text': f'document {i} ' * 20}) + '\n' for i in range(5000))
    cut = tmp_path / 'cut.jsonl.gz'
    cut.write_bytes(gzip.compress(text.encode())[:-2000])
    r = _prepare('--input', cut, '--output-prefix', tmp_path / 'out')
    assert r.returncode == 1
    msg = _one_line_error(r)
    assert msg.startswith(f'error: {cut}: truncated file: EOFError') and '--keep-truncated' in msg, msg
    assert not list(tmp_path.glob('out*'))
    r = _prepare('--input', cut, '--output-prefix', tmp_path / 'out', '--keep-truncated')
    assert r.returncode == 0 and 'truncated file' in r.stdout, r.stdout + r.stderr
    assert 0 < IndexedDataset(tmp_path / 'out_text_document').num_documents < 5000


def test_temporaries_of_a_killed_prepare_are_removed_by_the_next_one(tmp_path):
    out = tmp_path / 'data'
    out.mkdir()
    proc = _gptkit('data', 'prepare', *['--input', 'builtin:kjv'] * 6, '--output-prefix', out / 'big',
                   '--workers', '1')
    deadline = time.time() + 120
    while not list(out.glob('big_text_document.bin.tmp-*')):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    left = list(out.glob('big_text_document.*'))
    assert [p.name for p in left] == [f'big_text_document.bin.tmp-{proc.pid}']
    r = _prepare('--input', 'builtin:milton', '--output-prefix', out / 'small')
    assert r.returncode == 0, r.stderr
    assert not left[0].exists() and f'removed {left[0]}, left by a run that was killed' in r.stdout, r.stdout


# --- item 3 (data): non-regular input ---------------------------------------------------------------------------

@pytest.mark.parametrize('kind', ['fifo', 'device'])
def test_non_regular_input_is_refused_without_hanging(tmp_path, kind):
    if kind == 'fifo':
        src = tmp_path / 'stream.jsonl'
        os.mkfifo(src)
        what = 'a named pipe (FIFO)'
    else:
        src, what = Path('/dev/zero'), 'a character device'
    try:
        r = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'data', 'prepare', '--input', str(src),
                            '--output-prefix', str(tmp_path / 'out')], capture_output=True, text=True, env=_env(),
                           timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f'gptkit data prepare hung on {src}')
    assert r.returncode == 1
    msg = _one_line_error(r)
    assert msg == f'error: {src}: is {what}, not a file; gptkit reads regular files (write the stream to a file first)'


# --- item 6: what the readers read, the CLI accepts ------------------------------------------------------------

def test_shipped_bgwiki_sample_prepares_through_the_cli(tmp_path):
    from gptkit.data.indexed import IndexedDataset
    from gptkit.tokenizer.bpe import gpt2
    assert bz2.decompress(BG.read_bytes())[:2] == b'\xff\xfe'          # UTF-16 with a byte-order mark
    for extra in ([], ['--format', 'mediawiki']):
        out = tmp_path / f'bg{len(extra)}'
        r = _prepare('--input', BG, '--output-prefix', out, *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        ds = IndexedDataset(f'{out}_text_document')
        assert ds.num_documents == 1
        assert gpt2().decode(ds.document(0)).startswith('Григорианският календар')


PAGE = ('<mediawiki><page><title>T</title><ns>0</ns><revision><text>{}</text></revision></page>'
        '</mediawiki>')


@pytest.mark.parametrize('encoding,declared,text', [
    ('utf-32', False, 'Привет, café'),                 # a byte-order mark
    ('utf-16-be', False, 'Привет, café'),              # no mark: the XML's first bytes say it
    ('iso-8859-1', True, 'déjà vu, café'),             # what the XML declaration names
    ('windows-1251', True, 'Привет, мир'),
])
def test_xml_in_other_encodings_prepares_through_the_cli(tmp_path, encoding, declared, text):
    from gptkit.data.indexed import IndexedDataset
    from gptkit.tokenizer.bpe import gpt2
    decl = f'<?xml version="1.0" encoding="{encoding}"?>' if declared else '<?xml version="1.0"?>'
    src = tmp_path / 'dump.xml'
    src.write_bytes((decl + PAGE.format(text)).encode(encoding))
    r = _prepare('--input', src, '--output-prefix', tmp_path / 'out')
    assert r.returncode == 0, r.stdout + r.stderr
    ds = IndexedDataset(tmp_path / 'out_text_document')
    assert gpt2().decode(ds.document(0)[:-1]) == text


def test_text_in_an_encoding_the_reader_does_not_read_is_refused_in_one_sentence(tmp_path):
    src = tmp_path / 'notes.txt'
    src.write_bytes('hello'.encode('utf-16'))
    r = _prepare('--input', src, '--output-prefix', tmp_path / 'out')
    assert r.returncode == 1
    msg = _one_line_error(r)
    assert msg == (f'error: {src}: its content is UTF-16-LE text, but gptkit reads text as UTF-8; convert it '
                   '(iconv -f utf-16-le -t utf-8)')
    src = tmp_path / 'dump.xml'
    src.write_bytes(b'<?xml version="1.0" encoding="klingon-8"?><mediawiki/>')
    r = _prepare('--input', src, '--output-prefix', tmp_path / 'out')
    assert r.returncode == 1 and "declares the encoding 'klingon-8', which Python does not know" in r.stderr


# --- item 4: a refused resume writes nothing; outputs never go where training prunes -----------------------------

def _tree(folder: Path) -> dict:
    "Every file under `folder` and its bytes"
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


def test_resume_with_another_model_is_refused_before_anything_is_written(tiny_data, tmp_path):
    run = tmp_path / 'run'
    r = run_here(*_train_args(tiny_data, run, '--iters', '2'))
    assert r.returncode == 0, r.stdout + r.stderr
    before = _tree(run)
    prefix, tok = tiny_data
    ckpt = run / 'checkpoints' / 'iter_0000002'
    # the tiny preset's defaults (hidden 128, 4 heads, context 256), not the run's: refused, nothing rewritten
    r = run_here('train', '--resume', '--out', run, '--data', prefix, '--tokenizer', tok, '--iters', '4',
                 '--preset', 'tiny')
    assert r.returncode == 1, r.stdout + r.stderr
    msg = _one_line_error(r)
    assert msg.startswith(f'error: {ckpt} holds another model than this run describes (model.hidden 128 here, 32 '
                          'there, model.heads 4 here, 2 there, model.seq_len 256 here, 32 there)'), msg
    assert f'--config {ckpt}/config.json' in msg and 'does not fit' not in msg, msg
    assert _tree(run) == before                                   # config.json, ds_config.json, tokenizer: as they were
    # the same shapes but another function (more heads of the same width): refused as well, not trained on
    r = run_here(*_train_args(tiny_data, run, '--iters', '4', '--resume', '--set', 'model.heads=4'))
    assert r.returncode == 1 and 'model.heads 4 here, 2 there' in _one_line_error(r), r.stdout + r.stderr
    assert _tree(run) == before
    # neither --preset nor --config: the run's own config.json, the flags on top
    r = run_here('train', '--resume', '--out', run, '--data', prefix, '--tokenizer', tok, '--iters', '4')
    assert r.returncode == 0 and 'resumed from' in r.stdout, r.stdout + r.stderr
    saved = json.loads((run / 'config.json').read_text())
    assert (saved['model']['hidden'], saved['model']['heads'], saved['train']['iters']) == (32, 2, 4)
    assert (run / 'checkpoints' / 'iter_0000004').is_dir()


def test_outputs_inside_a_runs_checkpoints_are_refused(tiny_data, tmp_path):
    "export, import, reshard, tokenizer train, data prepare and merge: training would replace or prune them there"
    run = tmp_path / 'run'
    r = run_here(*_train_args(tiny_data, run, '--iters', '2'))
    assert r.returncode == 0, r.stdout + r.stderr
    ckpts = run / 'checkpoints'
    before = _tree(run)
    hf = tmp_path / 'hf'
    assert run_here('checkpoint', 'export', run, hf, '--to', 'hf').returncode == 0       # outside: written
    prefix, _ = tiny_data
    cases = [('OUT', ckpts / 'iter_0000099', ('checkpoint', 'reshard', run, ckpts / 'iter_0000099', '--tp', '1')),
             ('OUT', ckpts / 'iter_0000002' / 'hf', ('checkpoint', 'export', run, ckpts / 'iter_0000002' / 'hf',
                                                     '--to', 'hf')),
             ('OUT', ckpts / 'mega', ('checkpoint', 'export', run, ckpts / 'mega', '--to', 'megatron')),
             ('OUT', ckpts / 'imported', ('checkpoint', 'import', hf, ckpts / 'imported', '--from', 'hf')),
             ('--output', ckpts / 'iter_0000002' / 'tokenizer',
              ('tokenizer', 'train', '-i', 'builtin:milton', '--output', ckpts / 'iter_0000002' / 'tokenizer',
               '--vocab-size', '300', '--overwrite')),
             ('--output-prefix', ckpts / 'd', ('data', 'prepare', '-i', 'builtin:milton', '--output-prefix',
                                               ckpts / 'd', '--overwrite')),
             ('--output-prefix', ckpts / 'm', ('data', 'merge', '-i', prefix, '--output-prefix', ckpts / 'm'))]
    for flag, path, args in cases:
        r = run_here(*args)
        assert r.returncode == 1, (args, r.stdout + r.stderr)
        msg = _one_line_error(r)
        assert msg.startswith(f'error: {flag} {path}') and f'is inside {ckpts}, the checkpoints of run {run}, ' in msg, msg
        assert _tree(run) == before, args             # nothing written into the run, not even a lock file
    r = run_here('generate', '--checkpoint', run, '--prompt', 'In the beginning', '--max-new-tokens', '2')
    assert r.returncode == 0, r.stdout + r.stderr


def test_writing_into_a_run_another_process_trains_is_refused(tiny_data, tmp_path):
    run = tmp_path / 'run'
    with training(tiny_data, run) as first:
        deadline = time.time() + 60                  # the lock is taken first, the run's tokenizer written just after
        while not (run / 'tokenizer' / 'tokenizer.json').is_file():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.1)
        tok = (run / 'tokenizer' / 'tokenizer.json').read_bytes()
        r = run_here('tokenizer', 'train', '-i', 'builtin:milton', '--output', run / 'tokenizer', '--vocab-size',
                     '300', '--overwrite')
        assert r.returncode == 1, r.stdout + r.stderr
        msg = _one_line_error(r)
        assert msg.startswith(f'error: --output {run}/tokenizer is inside run {run}, which process {first.pid} on '), msg
        assert (run / 'tokenizer' / 'tokenizer.json').read_bytes() == tok
        r = run_here('data', 'prepare', '-i', 'builtin:milton', '--output-prefix', run / 'extra')
        assert r.returncode == 1 and f'inside run {run}, which process {first.pid}' in r.stderr, r.stderr
        assert not list(run.glob('extra*'))


def test_tokenizer_train_refuses_to_replace_a_tokenizer_unless_overwrite(tmp_path):
    out = tmp_path / 'tok'
    args = ('tokenizer', 'train', '-i', 'builtin:milton', '--output', out, '--vocab-size', '300')
    assert run_here(*args).returncode == 0
    before = _tree(out)
    r = run_here(*args[:-1], '400')
    assert r.returncode == 2, r.stdout + r.stderr
    assert _one_line_error(r) == (f'error: --output {out} already holds a tokenizer (tokenizer.json); add --overwrite '
                                  'to replace it (data prepared with it would no longer match), or choose another '
                                  'folder')
    assert _tree(out) == before
    r = run_here(*args[:-1], '400', '--overwrite')
    assert r.returncode == 0 and '400 entries' in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not os.path.isdir('/sys'), reason='needs /sys, where no process can make a folder')
def test_an_output_that_cannot_be_made_is_named_as_given(tiny_checkpoint, tmp_path):
    for args in (('export', tiny_checkpoint, '/sys/gptkit-exp', '--to', 'hf'),
                 ('reshard', tiny_checkpoint, '/sys/gptkit-exp', '--tp', '1')):
        r = run_here('checkpoint', *args)
        assert r.returncode == 1, r.stdout + r.stderr
        msg = _one_line_error(r)
        assert msg.startswith('error: OUT /sys/gptkit-exp: ') and '.tmp-' not in msg, msg
    long = tmp_path / ('é' * 127)                 # 254 bytes: a valid name, longer once staged as .NAME.tmp-PID
    r = run_here('checkpoint', 'export', tiny_checkpoint, long, '--to', 'hf')
    assert r.returncode == 0 and (long / 'model.safetensors').is_file(), r.stdout + r.stderr
    assert [p.name for p in tmp_path.iterdir()] == [long.name]
