"""Faults a run meets on real machines, injected: a diverging run (NaN weights), NaN steps at a save and at the end,
and a checkpoint holding NaN weights given to the tools that load one. Each ends with one sentence and no poisoned
output."""
import json
import logging
import os
import shutil
import signal

import pytest
import torch
from conftest import TINY_SETS
from typer.testing import CliRunner

from gptkit.store import folders as store
from gptkit.errors import ConfigError, DiskFullError
from gptkit.config.run import resolve
from gptkit.store.folders import CheckpointError
from gptkit.train.loop import TrainingError, train
from gptkit_cli.main import app

runner = CliRunner()
DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')   # set by in-process runs


def config(tiny_data, out, *sets):
    prefix, tok = tiny_data
    return resolve(sets=TINY_SETS + list(sets), overrides={'data': {'prefix': prefix, 'tokenizer': tok}}, out=str(out))


def strict_json(line: str):
    "JSON as the standard has it: NaN and Infinity are not JSON"
    def refuse(name): raise ValueError(f'{name} in {line!r}')
    return json.loads(line, parse_constant=refuse)


def test_a_diverging_run_stops_before_any_checkpoint_holds_nan(tiny_data, tmp_path):
    "lr 1e6: the weights blow up within a few steps; no checkpoint is written from then on, the metrics hold null"
    out = tmp_path / 'run'
    with pytest.raises(TrainingError, match=r'step \d+: [\d,]+ of the [\d,]+ weights are NaN or infinite .*so no '
                                            r'checkpoint was written\. No checkpoint was saved\. Lower optim.lr'):
        train(config(tiny_data, out, 'optim.lr=1e6', 'optim.warmup=0', 'train.iters=30', 'train.save_interval=2',
                     'train.eval_iters=0'))
    assert not store.checkpoints(out / 'checkpoints')     # every due save fell in the NaN streak
    rows = [strict_json(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    train_rows = [r for r in rows if r['kind'] == 'train']
    assert train_rows[0]['loss'] is not None and any(r['loss'] is None for r in train_rows)
    assert all(r['grad_norm'] is None for r in train_rows if r['loss'] is None)


def test_nan_steps_skip_a_due_save_and_a_run_ending_on_one_saves_nothing(tiny_data, tmp_path, monkeypatch, caplog):
    from gptkit.model.decoder import GPT
    real, calls = GPT.loss, {'n': 0}
    def nan_at(self, logits, targets):
        calls['n'] += 1
        loss = real(self, logits, targets)
        return loss * float('nan') if calls['n'] in (3, 4, 11, 12) else loss   # every micro-batch of steps 2 and 6
    monkeypatch.setattr(GPT, 'loss', nan_at)
    out = tmp_path / 'run'
    with caplog.at_level(logging.WARNING), pytest.raises(
            TrainingError, match=r'step 6: the run ended on a step whose every micro-batch had a NaN or infinite loss, '
                                 r'so its state was not saved\. The newest checkpoint, with finite weights, is '
                                 r'.*iter_0000004\.'):
        train(config(tiny_data, out, 'train.iters=6', 'train.save_interval=2', 'train.eval_iters=0',
                     'model.kernels=torch'))   # the plain path's loss, which nan_at patches
    assert 'step 2: checkpoint skipped' in caplog.text
    assert [i for i, _ in store.checkpoints(out / 'checkpoints')] == [4]


@pytest.fixture(scope='module')
def nan_checkpoint(tiny_data, tmp_path_factory):
    "A run folder whose weights hold NaN, as a diverged run saved by an older gptkit would be"
    from gptkit.config.sections import ModelConfig
    from gptkit.interop.hf import write_run
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tiny_data[1])
    cfg = ModelConfig(layers=2, hidden=32, heads=2, seq_len=64, vocab=tok.vocab_size, dropout=0.0)
    weights = GPT(cfg).state_dict()
    weights['blocks.1.mlp.fc1.weight'] = torch.full_like(weights['blocks.1.mlp.fc1.weight'], float('nan'))
    return write_run(weights, cfg, tok, tmp_path_factory.mktemp('nan') / 'run', 'a tiny GPT with NaN weights')


def test_tools_refuse_a_checkpoint_with_nan_weights(nan_checkpoint, tmp_path):
    from gptkit.checkpoint.checkpointing import load_model
    with pytest.raises(CheckpointError, match=r'iter_0000000: 4,096 of its [\d,]+ weights are NaN or infinite '
                                              r'\(first in blocks\.1\.mlp\.fc1\.weight\).*Use an earlier checkpoint'):
        load_model(nan_checkpoint)
    text = tmp_path / 'a.txt'; text.write_text('And God said, Let there be light. ' * 10)
    for args in (['generate', '--checkpoint', nan_checkpoint, '--prompt', 'And'],
                 ['eval', '--checkpoint', nan_checkpoint, '--text', text, '--json']):
        r = runner.invoke(app, [str(a) for a in args])
        assert r.exit_code == 1, r.output
        assert 'weights are NaN or infinite' in r.output and 'Traceback' not in r.output
    from gptkit.inference.generator import Generator  # what gptkit serve loads its model with, before it listens
    with pytest.raises(CheckpointError, match='weights are NaN or infinite'): Generator.from_checkpoint(nan_checkpoint)


@pytest.mark.parametrize('signum', [signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_finishes_the_step_saves_and_sets_the_exit_code(tiny_data, tmp_path, signum):
    "SLURM's warning before the time limit (SIGUSR1) or Ctrl-C: the run saves after the step and exits 128 + signal"
    from gptkit.train.callbacks import Callback
    class SignalAt(Callback):
        def on_train_step(self, iteration):
            if iteration == 2: os.kill(os.getpid(), signum)
    r = train(config(tiny_data, tmp_path / 'run', 'train.iters=50', 'train.eval_iters=0'), callbacks=[SignalAt()])
    assert r.interrupted and r.signal == signum and r.exit_code == 128 + signum
    # it arrived after step 2 agreed on stopping (ranks decide together), so step 3 runs, then the save
    assert r.iteration == 3 and [i for i, _ in store.checkpoints(tmp_path / 'run' / 'checkpoints')] == [3]
    assert store.verify(r.checkpoint) is None


def test_a_resumed_run_logs_each_step_once(tiny_data, tmp_path):
    "Killed after step 5 with step 4 its newest checkpoint: the resumed run logs steps 5 and 6 again, and only once"
    import shutil
    out = tmp_path / 'run'
    cfg = config(tiny_data, out, 'train.iters=6', 'train.save_interval=2', 'train.eval_iters=0')
    train(cfg, stop_after=5)
    shutil.rmtree(out / 'checkpoints' / 'iter_0000005')           # the kill came before step 5's save
    (out / 'checkpoints' / 'latest').write_text('iter_0000004')
    with open(out / 'metrics.jsonl', 'a') as f: f.write('{"kind": "train", "iterat')   # a row cut by the kill
    train(cfg, resume=True)
    rows = [strict_json(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['iteration'] for r in rows if r['kind'] == 'train'] == [1, 2, 3, 4, 5, 6]
    assert [r['iteration'] for r in rows if r['kind'] == 'checkpoint'] == [2, 4, 6]


def test_a_full_disk_at_a_checkpoint_is_one_sentence_and_keeps_the_previous_one(tiny_data, tmp_path, monkeypatch):
    "torch.save's own full-disk error (a RuntimeError), and the free-space check made before writing"
    import dataclasses
    from collections import namedtuple

    import gptkit.checkpoint.checkpointing as ck
    cfg = config(tiny_data, tmp_path / 'run', 'train.iters=2', 'train.eval_iters=0')
    train(cfg)
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iters=3))
    root = tmp_path / 'run' / 'checkpoints'
    real_save = torch.save
    def full(obj, f, *a, **k):
        if 'rng_rank' in str(f):
            raise RuntimeError('[enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file '
                               'data/0: file write failed')
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, 'save', full)
    with pytest.raises(CheckpointError, match=r'could not write checkpoint .*iter_0000003: .*file write failed; '
                                              r'the previous checkpoint .*iter_0000002 is intact'):
        train(more, resume=True)
    monkeypatch.setattr(torch, 'save', real_save)
    Usage = namedtuple('Usage', 'total used free')
    monkeypatch.setattr(ck.shutil, 'disk_usage', lambda p: Usage(2**30, 2**30 - 4096, 4096))
    with pytest.raises(CheckpointError, match=r'iter_0000003: it needs about [\d.]+ GiB \(the size of iter_0000002\) '
                                              r'but .* has 0.00 GiB free; .*the previous checkpoint .* is intact'):
        train(more, resume=True)
    assert [i for i, _ in store.checkpoints(root)] == [2] and store.verify(root / 'iter_0000002') is None
    assert not list(root.glob('.tmp-*')) and (root / 'latest').read_text() == 'iter_0000002'


def test_hostile_paths_devices_and_sizes_get_one_sentence(tiny_data, tiny_checkpoint, tmp_path):
    "Found by trying: each used to give a traceback, a Rust abort, a run that never ends or a memory blow-up"
    prefix, tok = tiny_data
    afile = tmp_path / 'afile'; afile.write_text('not a folder')
    cases = [
        (['train', '--data', prefix, '--tokenizer', tok, '--out', afile, '--iters', 1], f'--out {afile} is a file'),
        (['train', '--data', prefix, '--tokenizer', tok, '--out', afile / 'run', '--iters', 1], 'which is a file'),
        (['tokenizer', 'train', '-i', 'builtin:milton', '--output', afile], f'--output {afile} is a file'),
        (['tokenizer', 'train', '-i', 'builtin:milton', '--output', tmp_path / 't', '--vocab-size', 10**9],
         '--vocab-size must be from 257'),
        (['data', 'prepare', '-i', 'builtin:milton', '--output-prefix', afile / 'x', '--tokenizer', tok],
         '--output-prefix'),
        (['profile', '--preset', 'tiny', '--data', prefix, '--tokenizer', tok, '--out', afile, '--steps', 1],
         f'--out {afile} is a file'),
        (['profile', '--preset', 'tiny', '--data', prefix, '--tokenizer', tok, '--out', tmp_path / 'p',
          '--steps', 10**9], 'a profile runs every step before it'),
        (['generate', '--checkpoint', tiny_checkpoint, '--prompt', 'a', '--device', 'cuda'],
         '--device cuda: this torch'),
        (['generate', '--checkpoint', tiny_checkpoint, '--prompt', 'a', '--device', 'tpu'], "--device 'tpu' is not"),
        (['generate', '--checkpoint', tiny_checkpoint, '--prompt', 'a', '--num-samples', 10**9],
         '--num-samples 1,000,000,000 is more than 100,000'),
        (['eval', '--checkpoint', tiny_checkpoint, '--device', 'cuda'], '--device cuda: this torch'),
        (['serve', '--checkpoint', tiny_checkpoint, '--max-prompts', 10**9], '--max-prompts 1,000,000,000: the KV cache of'),
        (['serve', '--checkpoint', tiny_checkpoint, '--max-batch', 10**9], '--max-batch 1,000,000,000: the KV cache of'),
        (['serve', '--checkpoint', tiny_checkpoint, '--max-batch', 0], '--max-batch must be at least 1, not 0'),
    ]
    if torch.cuda.is_available(): cases = [c for c in cases if 'cuda' not in c[0]]
    for args, sentence in cases:
        r = runner.invoke(app, [str(a) for a in args])
        said = ' '.join(r.output.split())
        assert r.exit_code in (1, 2) and sentence in said and 'Traceback' not in said, (args, r.output[-2000:])
    from gptkit.inference.generator import Generator
    gen = Generator.from_checkpoint(tiny_checkpoint)
    gen.check_batch(8)
    with pytest.raises(ConfigError, match=r'batch_size 1,000,000,000: the KV cache of 1,000,000,000 sequences of 64 '
                                          r'tokens needs [\d,.]+ GiB, and [\d,.]+ GiB is free; use at most about'):
        gen.check_batch(10**9)


def test_a_hand_edited_state_json_is_noticed(tiny_checkpoint, tmp_path):
    "state.json carries a checksum of its contents: an edit is refused, an older one without a checksum still loads"
    import shutil

    from gptkit.checkpoint.checkpointing import load_model
    copy = tmp_path / 'run'
    shutil.copytree(tiny_checkpoint, copy)
    folder = store.find(copy)
    state = json.loads((folder / 'state.json').read_text())
    assert store.verify(folder) is None and len(state['checksum']) == 64
    (folder / 'state.json').write_text(json.dumps({**state, 'iteration': 7}))
    assert 'was edited or damaged (its checksum does not match its contents)' in store.verify(folder)
    with pytest.raises(CheckpointError, match='was edited or damaged'): load_model(folder)
    (folder / 'state.json').write_text(json.dumps({k: v for k, v in state.items() if k != 'checksum'}))
    assert store.verify(folder) is None and load_model(copy).state['iteration'] == state['iteration']


def test_a_sample_index_too_big_is_refused_and_many_epochs_are_warned_of(tiny_data, tmp_path, caplog):
    "--tokens 300B on a small corpus used to build an 8.7 GiB index, then MemoryError"
    from gptkit.data.plan import data_plan, warn_repeats
    from gptkit.errors import DataError
    with pytest.raises(DataError, match=r'the train split would draw [\d,]+ samples of 33 tokens from .*kjv_text_'
                                        r'document, [\d,]+ passes over its data; building their index takes about '
                                        r'[\d,.]+ GiB and this machine has [\d,.]+ GiB\. Train on fewer tokens'):
        data_plan(config(tiny_data, tmp_path / 'a', 'train.iters=1000000000'))
    plan = lambda iters: data_plan(config(tiny_data, tmp_path / 'b', f'train.iters={iters}'))
    with caplog.at_level(logging.WARNING): warn_repeats(plan(2))
    assert not caplog.text
    with caplog.at_level(logging.WARNING): warn_repeats(plan(200_000))
    assert 'the train split passes over' in caplog.text and 'will memorize it' in caplog.text


def test_save_interval_minutes_saves_by_the_clock(tiny_data, tmp_path):
    "A job that may be killed at any time saves by wall clock too; a bad value names the flag"
    out = tmp_path / 'run'
    train(config(tiny_data, out, 'train.eval_iters=0', 'train.save_interval_minutes=1e-9'))   # due after every step
    rows = [strict_json(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['iteration'] for r in rows if r['kind'] == 'checkpoint'] == [1, 2, 3, 4, 5, 6]
    assert [i for i, _ in store.checkpoints(out / 'checkpoints')] == [4, 5, 6]                   # train.keep=3
    r = runner.invoke(app, ['train', '--preset', 'tiny', '--dry-run', '--save-interval-minutes', '0'])
    assert r.exit_code == 2 and '--save-interval-minutes must be a positive number of minutes, not 0' in r.output


# Loaded by every Python process of a `gptkit train` the tests below start (through PYTHONPATH): the rank named
# in GPTKIT_TEST_FAULT does the fault after that step, in the first attempt only (torchrun counts restarts)
FAULT_SITE = '''
import os
if os.environ.get('GPTKIT_TEST_FAULT') and ('RANK' in os.environ or os.environ.get('GPTKIT_TEST_ALONE')):
    import signal, time
    import gptkit.train.loop as t
    what, rank, step = os.environ['GPTKIT_TEST_FAULT'].split(':')
    real = t.train_step
    def train_step(loop, *args, **kw):
        loss = real(loop, *args, **kw)
        first = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
        if loop.iteration == int(step) and os.environ.get('RANK', '0') == rank and first:
            if what == 'kill': os.kill(os.getpid(), signal.SIGKILL)
            if what == 'hang': time.sleep(3600)
        return loss
    t.train_step = train_step
'''


def _train_with_fault(tiny_data, tmp_path, fault, *args, alone=False, timeout=300):
    import subprocess
    import sys
    prefix, tok = tiny_data
    (tmp_path / 'site').mkdir()
    (tmp_path / 'site' / 'sitecustomize.py').write_text(FAULT_SITE)
    env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, 'PYTHONUNBUFFERED': '1',
           'PYTHONPATH': str(tmp_path / 'site'), 'GPTKIT_TEST_FAULT': fault, 'GPTKIT_TEST_ALONE': '1' if alone else ''}
    cmd = [sys.executable, '-m', 'gptkit_cli.main', 'train', '--data', prefix, '--tokenizer', tok,
           '--out', str(tmp_path / 'run'), *[a for s in TINY_SETS for a in ('--set', s)], *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _metrics(run):
    return [strict_json(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]


def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(tiny_data, tmp_path):
    "--max-restarts: rank 1 of 2 is SIGKILLed after step 5; torchrun restarts both, they resume from step 3's checkpoint"
    sets = ['train.iters=8', 'train.save_interval=3', 'train.eval_iters=0']
    want = _metrics(train(config(tiny_data, tmp_path / 'one', *sets)).checkpoint.parents[1])
    r = _train_with_fault(tiny_data, tmp_path, 'kill:1:5', '--nproc', '2', '--max-restarts', '1',
                          *[a for s in sets for a in ('--set', s)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = r.stdout.replace('\n', '')                             # rich wraps long paths
    assert '--max_restarts 1' in said and 'restart 1: a process died or hung' in said
    assert 'resumed from' in said and 'iter_0000003 (step 3)' in said  # steps 4 and 5 were lost with the killed rank
    got = _metrics(tmp_path / 'run')
    steps = lambda rows: [(x['iteration'], x['loss']) for x in rows if x['kind'] == 'train']
    assert [i for i, _ in steps(got)] == list(range(1, 9))          # one row per step, the replayed ones once
    assert [l for _, l in steps(got)] == pytest.approx([l for _, l in steps(want)], rel=1e-5)
    assert [i for i, _ in store.checkpoints(tmp_path / 'run' / 'checkpoints')] == [3, 6, 8]


def test_a_hang_becomes_a_stack_dump_and_exit_124(tiny_data, tmp_path):
    "The watchdog: a step that does not finish within --watchdog-minutes prints where every thread is, exits 124"
    import time
    t = time.monotonic()
    r = _train_with_fault(tiny_data, tmp_path, 'hang:0:2', '--watchdog-minutes', '0.05', alone=True, timeout=120)
    assert r.returncode == 124, r.stdout[-3000:] + r.stderr[-3000:]
    assert ('rank 0: step 2 has not finished in 0.05 minutes (train.watchdog_minutes), so the run is taken to be '
            'hung: the stack of every thread follows, then exit 124') in r.stderr
    assert 'in train_step' in r.stderr and 'gptkit-watchdog' not in r.stdout   # the hung frame is named
    assert time.monotonic() - t < 60
    assert [i for i, _ in store.checkpoints(tmp_path / 'run' / 'checkpoints')] == []


@pytest.fixture
def small_disk(tmp_path):
    "A real full disk: a 1 MiB tmpfs (mounting needs root, as CI has; elsewhere the test is skipped, saying why)"
    import subprocess
    mnt = tmp_path / 'disk'; mnt.mkdir()
    r = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mnt)], capture_output=True, text=True)
    if r.returncode: pytest.skip(f'cannot mount a tmpfs here: {r.stderr.strip()}')
    yield mnt
    subprocess.run(['umount', '-l', str(mnt)], capture_output=True)


def _fill(disk, leave: int):
    "Take all but `leave` bytes of `disk`"
    import shutil
    (disk / 'filler').unlink(missing_ok=True)
    (disk / 'filler').write_bytes(b'\0' * max(0, shutil.disk_usage(disk).free - leave))


def _one_sentence(r, *said):
    flat = ' '.join(r.output.split())
    assert r.exit_code == 1 and 'Traceback' not in r.output and all(s in flat for s in said), r.output


def test_a_full_disk_on_every_write_path_is_one_sentence_and_keeps_what_was_there(tiny_data, tiny_checkpoint,
                                                                                   small_disk, tmp_path):
    prefix, tok = tiny_data
    disk, run = small_disk, lambda *a: runner.invoke(app, [str(x) for x in a])
    listing = lambda: sorted(p.name for p in disk.rglob('*'))
    # data prepare: an earlier dataset under the same prefix stays as it was; no temporary is left
    (tmp_path / 'small.txt').write_text('In the beginning was the word.\n')
    assert run('data', 'prepare', '-i', tmp_path / 'small.txt', '--output-prefix', disk / 'kjv', '--tokenizer', tok,
               '--format', 'txt').exit_code == 0
    before = {p.name: p.read_bytes() for p in disk.iterdir()}
    r = run('data', 'prepare', '-i', 'builtin:kjv', '--output-prefix', disk / 'kjv', '--tokenizer', tok, '--overwrite')
    _one_sentence(r, f'{disk}/kjv_text_document.bin: the disk is full (at least', 'needed,', 'free), so it was not '
                  'written; the existing kjv_text_document.bin/.idx/.metadata are as they were; free some space and run again')
    assert {p.name: p.read_bytes() for p in disk.iterdir()} == before
    # tokenizer train: no half-written tokenizer folder
    _fill(disk, 16 * 1024)
    r = run('tokenizer', 'train', '-i', 'builtin:kjv', '--vocab-size', '2000', '--output', disk / 'tok')
    _one_sentence(r, f'{disk}/tok: the disk is full (at least', 'so it was not written')
    assert listing() == sorted(['filler', *before])
    # checkpoint export: no half-written export folder
    r = run('checkpoint', 'export', tiny_checkpoint, disk / 'hf', '--to', 'hf')
    _one_sentence(r, f'{disk}/hf: the disk is full (at least', 'so it was not written')
    assert listing() == sorted(['filler', *before])
    # train: its config cannot be written (a run folder with no room at all), then its first checkpoint cannot
    _fill(disk, 0)
    sets = [a for s in TINY_SETS for a in ('--set', s)]
    r = run('train', '--data', prefix, '--tokenizer', tok, '--out', disk / 'run', *sets)
    _one_sentence(r, f"{disk}/run/config.json: the disk is full (at least", "so it was not written")
    _fill(disk, 64 * 1024)
    (disk / 'run2').mkdir()
    r = run('train', '--data', prefix, '--tokenizer', tok, '--out', disk / 'run2', *sets, '--set', 'train.save_interval=2')
    _one_sentence(r, f'could not write checkpoint {disk}/run2/checkpoints/iter_0000002: the disk is full (at least',
                  'no earlier checkpoint exists')
    assert not [p for p in (disk / 'run2' / 'checkpoints').iterdir()]
    # metrics.jsonl: the disk fills up during a run
    from gptkit.train.callbacks import Callback
    (disk / 'filler').unlink(); shutil.rmtree(disk / 'run2')
    class Fill(Callback):          # after the run folder is made (TensorBoard starts after it), or after step 1
        def __init__(self, at_start): self.at_start = at_start
        def on_start(self, info):
            if self.at_start: _fill(disk, 0)
        def on_train_step(self, iteration):
            if iteration == 1: _fill(disk, 0)
    with pytest.raises(DiskFullError, match=r'run3/tensorboard: the disk is full \(0 bytes free\), so it was not written'):
        train(config(tiny_data, disk / 'run3', 'train.eval_iters=0'), callbacks=[Fill(True)])
    (disk / 'filler').unlink()
    with pytest.raises(DiskFullError, match=r'run4/metrics\.jsonl: the disk is full \(0 bytes free\), so it was not '
                                            r'written; its earlier rows are intact'):
        train(config(tiny_data, disk / 'run4', 'train.eval_iters=0'), callbacks=[Fill(False)])
