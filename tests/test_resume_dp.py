"""Resuming a checkpoint on another number of data-parallel processes: 2 -> 1 and 1 -> 2 continue the uninterrupted run."""
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_SETS

from gptkit.checkpoint import checkpointing as ckpt

from gptkit.store import folders as store
from gptkit.config.run import resolve
from gptkit.train.loop import train

# 4 samples per step: 2 processes x micro-batch 2, or 1 process x micro-batch 2 x 2 accumulation steps
SETS = TINY_SETS + ['train.save_interval=3', 'train.eval_iters=0']
DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')   # set by in-process runs
REPARTITIONED = 'resuming a checkpoint from {} data-parallel ranks on {}: optimizer states consolidated and re-partitioned'


def _sets(zero):
    return [a for s in SETS + [f'parallel.zero={zero}'] for a in ('--set', s)]


def _two_processes(tiny_data, out, zero, *extra):
    "`gptkit train` on 2 processes (torchrun), as a user runs it"
    prefix, tok = tiny_data
    env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, 'PYTHONUNBUFFERED': '1'}
    r = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'train', '--data', prefix, '--tokenizer', tok, *_sets(zero),
                        '--out', str(out), '--nproc', '2', '--launcher', 'torchrun', *extra], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _one_process(tiny_data, out, zero, resume=False):
    prefix, tok = tiny_data
    cfg = resolve(sets=SETS + [f'parallel.zero={zero}'], overrides={'data': {'prefix': prefix, 'tokenizer': tok}},
                  out=str(out))
    return train(cfg, resume=resume)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
    return {r['iteration']: r['loss'] for r in rows if r['kind'] == 'train'}


def _from_step_3(run: Path, out: Path) -> Path:
    "A fresh run folder holding only `run`'s checkpoint of step 3"
    shutil.copytree(run / 'checkpoints' / 'iter_0000003', out / 'checkpoints' / 'iter_0000003')
    return out


def _same_losses(resumed: Path, full: Path):
    got, want = _losses(resumed), _losses(full)
    assert sorted(got) == [4, 5, 6] and sorted(want) == [1, 2, 3, 4, 5, 6]
    assert [got[i] for i in (4, 5, 6)] == pytest.approx([want[i] for i in (4, 5, 6)], rel=1e-5)


def _nothing_hidden_left(run: Path):
    assert [p.name for p in (run / 'checkpoints').iterdir() if p.name.startswith('.')] == []


@pytest.fixture(scope='module')
def two_ranks(tiny_data, tmp_path_factory):
    "zero stage -> run folder of an uninterrupted 6-step run on 2 processes, checkpointed at step 3 (each made once)"
    runs = {}
    def get(zero):
        if zero not in runs:
            runs[zero] = tmp_path_factory.mktemp(f'two_zero{zero}') / 'run'
            _two_processes(tiny_data, runs[zero], zero)
        return runs[zero]
    return get


# ZeRO-1's two-process run is made for the tests below anyway; ZeRO-3 (its own conversion, from partitioned weights) and
# ZeRO-0 (nothing partitioned) with --nb-flags slow
@pytest.mark.parametrize('zero', [1, pytest.param(3, marks=pytest.mark.slow), pytest.param(0, marks=pytest.mark.slow)])
def test_a_checkpoint_of_two_processes_resumes_on_one(tiny_data, two_ranks, tmp_path, caplog, zero):
    full = two_ranks(zero)
    resumed = _from_step_3(full, tmp_path / 'resumed')
    with caplog.at_level(logging.INFO, logger='gptkit.checkpoint.checkpointing'):
        r = _one_process(tiny_data, resumed, zero, resume=True)
    assert r.iteration == 6
    _same_losses(resumed, full)
    said = [m for m in caplog.messages if m.startswith('resuming a checkpoint from')]
    assert said == [REPARTITIONED.format(2, 1) if zero else
                    'resuming a checkpoint from 2 data-parallel ranks on 1: its optimizer states are not partitioned and load unchanged']
    _nothing_hidden_left(resumed)
    saved = resumed / 'checkpoints' / 'iter_0000006'
    assert store.verify(saved) is None and store.read_state(saved)['world_size'] == 1
    assert len(list(saved.glob('*optim_states.pt'))) == (1 if zero else 0)


@pytest.mark.parametrize('zero', [3])   # ZeRO-1's conversion is the same path, tested from two processes to one
def test_a_checkpoint_of_one_process_resumes_on_two(tiny_data, tmp_path, zero, request):
    # slow-flagged for the suite's 15 minutes: two processes to one (ZeRO 0 and 3) runs the same conversion code
    if 'slow' not in request.config.getoption('--nb-flags'): pytest.skip('slow: run with --nb-flags slow')
    full = tmp_path / 'full'
    _one_process(tiny_data, full, zero)
    resumed = _from_step_3(full, tmp_path / 'resumed')
    r = _two_processes(tiny_data, resumed, zero, '--resume')
    assert 'resumed from' in r.stdout
    _same_losses(resumed, full)
    _nothing_hidden_left(resumed)
    saved = resumed / 'checkpoints' / 'iter_0000006'
    assert store.verify(saved) is None and store.read_state(saved)['world_size'] == 2
    assert len(list(saved.glob('*optim_states.pt'))) == 2


def test_a_failed_conversion_is_reported_and_leaves_nothing(tiny_data, two_ranks, tmp_path, monkeypatch):
    resumed = _from_step_3(two_ranks(1), tmp_path / 'resumed')
    def full_disk(src, dst):
        Path(dst).mkdir(parents=True); (Path(dst) / 'half.pt').write_bytes(b'x')
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(ckpt, 'to_universal', full_disk)
    with pytest.raises(store.CheckpointError,
                       match=r'could not convert .*iter_0000003 for another number of data-parallel ranks '
                             r'in .*\.universal-iter_0000003: No space left on device'):
        _one_process(tiny_data, resumed, 1, resume=True)
    _nothing_hidden_left(resumed)


def test_model_parallel_checkpoints_on_another_data_parallel_size_are_refused(tiny_data, two_ranks, tmp_path):
    resumed = _from_step_3(two_ranks(1), tmp_path / 'resumed')
    state = resumed / 'checkpoints' / 'iter_0000003' / 'state.json'        # the layout that later versions record
    state.write_text(store.state_text({**json.loads(state.read_text()), 'layout': {'tp': 2, 'pp': 1, 'dp': 2}}))
    with pytest.raises(store.CheckpointError,
                       match=r'iter_0000003 was saved with tp 2 pp 1 .* this run has tp 1 pp 1 .*; convert it with '
                             r'gptkit checkpoint reshard .* or train with --tp 2 --pp 1'):
        _one_process(tiny_data, resumed, 1, resume=True)
    folder = state.parent                                                   # the same split on another DP size
    with pytest.raises(store.CheckpointError,
                       match=r'iter_0000003 was saved with tp=2, pp=1 on 2 data-parallel ranks; only tp=pp=1 '
                             r'checkpoints can resume on another number of data-parallel ranks \(1 here\); '
                             r'gptkit checkpoint reshard'):
        ckpt._load_repartitioned(None, folder, json.loads(state.read_text()), was=2, now=1, rank=0)


def test_resuming_with_another_global_batch_says_so(tiny_data, two_ranks, tmp_path, caplog):
    "Without train.global_batch the batch follows the processes (2 x 2 -> 1 x 2), and the losses are no longer comparable"
    resumed = _from_step_3(two_ranks(1), tmp_path / 'resumed')
    prefix, tok = tiny_data
    cfg = resolve(sets=SETS + ['parallel.zero=1', 'train.global_batch=2', 'train.iters=4'],
                  overrides={'data': {'prefix': prefix, 'tokenizer': tok}}, out=str(resumed))
    with caplog.at_level(logging.INFO, logger='gptkit.checkpoint.checkpointing'):
        assert train(cfg, resume=True).iteration == 4
    assert REPARTITIONED.format(2, 1) in caplog.messages
    assert any('iter_0000003 was trained with a global batch of 4 samples per step and resumes with 2 (1 data-parallel ranks x 2 x 1 '
               'accumulation steps); set train.global_batch=4 to continue the same run' in m for m in caplog.messages), caplog.messages
