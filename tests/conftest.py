import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the tests measure about this machine (train.precision=auto, the decode layout) goes to a cache of their own,
# not the user's ~/.cache/gptkit; notebooks run by nbdev-test inherit it
MEASURE_CACHE = tempfile.mkdtemp(prefix='gptkit-test-cache-')
os.environ['GPTKIT_CACHE'] = MEASURE_CACHE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(MEASURE_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption('--nb-flags', default=os.environ.get('GPTKIT_NB_FLAGS', ''),
                     help='nbdev test flags to run that are skipped by default, e.g. "gpu slow"')


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: a test that takes long; it runs with --nb-flags slow, as the notebooks\' '
                            'cells flagged slow do')


def pytest_collection_modifyitems(config, items):
    "Tests marked slow are skipped unless --nb-flags names slow"
    if 'slow' in config.getoption('--nb-flags').split():
        return
    for item in items:
        if item.get_closest_marker('slow'):
            item.add_marker(pytest.mark.skip(reason='slow: runs with --nb-flags slow'))


@pytest.fixture
def pin_cpu(monkeypatch, tmp_path):
    "pin_cpu(cpu): gptkit sees `cpu` as this machine's, whatever this one is, through the /proc/cpuinfo it reads"
    from gptkit.machine import cpu as machine_cpu

    def pin(cpu):
        path = tmp_path / f'cpuinfo-{len(list(tmp_path.glob("cpuinfo-*")))}'
        path.write_text(f'model name\t: {cpu.name}\nflags\t\t: {" ".join(sorted(cpu.flags))}\n')
        monkeypatch.setattr(machine_cpu, 'CPUINFO', path)
    return pin


@pytest.fixture(scope='session')
def root() -> Path:
    return ROOT


def train_tokenizer(corpus: str, size: int, folder: Path) -> Path:
    "A `size`-entry byte-level BPE trained on the built-in `corpus`, saved in `folder`"
    from gptkit.data.corpus import clean_text, read_documents
    from gptkit.tokenizer.bpe import save_tokenizer, train_bpe
    save_tokenizer(train_bpe((clean_text(x.text) for x in read_documents([f'builtin:{corpus}'])), size), folder)
    return folder


@pytest.fixture(scope='session')
def tiny_data(tmp_path_factory):
    "(dataset prefix, tokenizer folder): the built-in KJV tokenized with a 512-entry BPE trained on it"
    from gptkit.data.prepare import PrepareConfig, prepare
    d = tmp_path_factory.mktemp('tiny_data')
    train_tokenizer('kjv', 512, d / 'tok')
    res = prepare(PrepareConfig(inputs=('builtin:kjv',), output_prefix=str(d / 'kjv'), tokenizer=str(d / 'tok')))
    return str(res.prefix), str(d / 'tok')


TINY_SETS = ['model.layers=2', 'model.hidden=32', 'model.heads=2', 'model.seq_len=32', 'model.dropout=0',
             'train.micro_batch=2', 'train.global_batch=4', 'train.precision=fp32', 'train.iters=6',
             'train.eval_interval=3', 'train.eval_iters=1', 'train.log_interval=1', 'optim.lr=3e-3', 'optim.warmup=2']


@pytest.fixture(scope='session')
def tiny_checkpoint(tiny_data, tmp_path_factory) -> Path:
    "A gptkit run folder: a random 2-layer GPT (context 64), the tiny_data tokenizer, written by interop.write_run"
    import torch
    from gptkit.interop.hf import write_run
    from gptkit.config.sections import ModelConfig
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tiny_data[1])
    torch.manual_seed(0)
    cfg = ModelConfig(layers=2, hidden=32, heads=2, seq_len=64, vocab=tok.vocab_size, dropout=0.0)
    return write_run(GPT(cfg).state_dict(), cfg, tok, tmp_path_factory.mktemp('ckpt') / 'run', 'a random tiny GPT')


@contextmanager
def torch_threads(n: int):
    "torch on `n` threads inside the block: tiny models run fastest on one, and do not stall when other processes share the cores"
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try: yield
    finally: torch.set_num_threads(old)


def run_here(*args):
    """`gptkit ARGS` in this process, as a CompletedProcess: the same command as a subprocess, without an interpreter's
    start-up (for one process: a launcher starts its own)"""
    import subprocess
    from typer.testing import CliRunner
    from gptkit_cli.main import app
    r = CliRunner().invoke(app, [str(a) for a in args])
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout,
                                       r.stderr + (repr(r.exception) if r.exception else ''))
