"""Curriculum learning (Megatron-DeepSpeed's sequence-length warm-up): the first steps train on short sequences, with
the losses of a run whose batches are cut by hand, tokens and learning rate counted as trained, exact resume, a
pipeline that takes the short steps, and bad values refused naming the key."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import TINY_SETS, run_here

from gptkit.config.curriculum import Curriculum
from gptkit.train.optim import Schedule
from gptkit.errors import ConfigError
from gptkit.config.run import resolve
from gptkit.train.loop import train

# context 32, 4 sequences a step: lengths 8, 16, 24 then 32 (steps 4 to 6)
CURRICULUM = ['train.curriculum_start=8', 'train.curriculum_steps=4', 'train.curriculum_step_size=8']
DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')


def config(tiny_data, out, *sets):
    prefix, tok = tiny_data
    return resolve(sets=TINY_SETS + list(sets), overrides={'data': {'prefix': prefix, 'tokenizer': tok}}, out=str(out))


def deepspeed_lengths(c: Curriculum, steps: int) -> list[int]:
    "The lengths DeepSpeed's own scheduler gives steps 1 ... `steps` (the step number Megatron-DeepSpeed gives it)"
    os.environ.setdefault('DS_ACCELERATOR', 'cpu')
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
    ds = CurriculumScheduler({'min_difficulty': c.start, 'max_difficulty': c.end, 'schedule_type': 'fixed_linear',
                              'schedule_config': {'total_curriculum_step': c.steps, 'difficulty_step': c.size}})
    return [ds.get_difficulty(t) for t in range(1, steps + 1)]


def rows(run, kind='train'):
    return [r for r in map(json.loads, (run / 'metrics.jsonl').read_text().splitlines()) if r['kind'] == kind]


def record_lengths(monkeypatch):
    "The sequence length of every training forward pass, in order"
    from gptkit.model.decoder import GPT
    seen, real = [], GPT.forward
    def forward(self, x, *a, **k):
        if self.training:
            seen.append(x.shape[1])
        return real(self, x, *a, **k)
    monkeypatch.setattr(GPT, 'forward', forward)
    return seen


def test_first_steps_are_short_with_the_losses_of_batches_cut_by_hand(tiny_data, tmp_path, monkeypatch):
    import gptkit.train.microbatches as loop
    flat = ['optim.min_lr=3e-3', 'optim.warmup=0', 'train.eval_iters=0']     # one learning rate for both runs
    cfg = config(tiny_data, tmp_path / 'cur', *CURRICULUM, *flat)
    lengths = deepspeed_lengths(Curriculum.of(cfg.train, 32), 6)
    assert lengths[0] < lengths[1] < lengths[2] < lengths[3] == 32
    seen = record_lengths(monkeypatch)
    got = train(cfg)
    assert seen == [n for n in lengths for _ in range(2)]                  # two micro-batches a step
    assert [r['seq_len'] for r in rows(tmp_path / 'cur')] == lengths        # the logs show each step's length
    tokens = [4 * sum(lengths[:i + 1]) for i in range(6)]
    assert [r['tokens'] for r in rows(tmp_path / 'cur')] == tokens and got.tokens == tokens[-1]
    # the same run without a curriculum, its micro-batches cut by hand to the same lengths
    cuts, real = iter(n for n in lengths for _ in range(2)), loop.micro_batch
    monkeypatch.setattr(loop, 'micro_batch', lambda *a: np.ascontiguousarray(real(*a)[:, :next(cuts) + 1]))
    by_hand = train(config(tiny_data, tmp_path / 'hand', *flat))
    assert got.losses == by_hand.losses and len(got.losses) == 6
    a, b = got.engine.module.state_dict(), by_hand.engine.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_mid_warm_up_equals_the_uninterrupted_run_and_the_decay_counts_tokens(tiny_data, tmp_path):
    cfg = config(tiny_data, tmp_path / 'full', *CURRICULUM)
    full = train(cfg)
    half = config(tiny_data, tmp_path / 'half', *CURRICULUM)
    first = train(half, stop_after=2)
    second = train(half, resume=True)
    assert first.iteration == 2 and first.losses + second.losses == full.losses
    a, b = full.engine.module.state_dict(), second.engine.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert second.valid_loss == full.valid_loss and second.tokens == full.tokens
    want = [r['seq_len'] for r in rows(tmp_path / 'full')]
    assert [r['seq_len'] for r in rows(tmp_path / 'half')] == want and want[:2] != [32, 32]
    # the learning rate after warmup follows the tokens trained (Megatron-DeepSpeed's --lr-decay-tokens)
    c, plain = Curriculum.of(cfg.train, 32), Schedule(cfg.optim, 6)
    lrs = [r['lr'] for r in rows(tmp_path / 'full')]
    assert lrs == pytest.approx([plain(c.schedule_step(i, 6, plain.warmup)) for i in range(1, 7)], rel=1e-6)
    assert lrs[2] > plain(3) and lrs[-1] == pytest.approx(plain(6))        # less decay at first, the same floor


def test_a_run_given_in_tokens_trains_them(tiny_data, tmp_path):
    cfg = config(tiny_data, tmp_path, *CURRICULUM, 'train.iters=null', 'train.tokens=600')
    lengths = deepspeed_lengths(Curriculum.of(cfg.train, 32), 50)
    steps = next(n for n in range(1, 50) if 4 * sum(lengths[:n]) >= 600)
    assert cfg.batch.iters == steps > config(tiny_data, tmp_path, 'train.iters=null', 'train.tokens=600').batch.iters


@pytest.mark.parametrize('sets,key,says', [
    (['train.curriculum_start=8', 'train.curriculum_end=64'], 'train.curriculum_end', 'model.seq_len 32'),
    (['train.curriculum_start=64'], 'train.curriculum_start', 'model.seq_len 32'),
    (['train.curriculum_start=12'], 'train.curriculum_start', 'multiple of curriculum_step_size 8'),
    (['train.curriculum_start=16', 'train.curriculum_end=8'], 'train.curriculum_end', 'shorter than curriculum_start'),
    (['train.curriculum_start=16', 'train.curriculum_step_size=16', 'model.seq_len=40'], 'train.curriculum_end',
     'multiple of train.curriculum_step_size 16'),
    (['train.curriculum_start=8', 'train.curriculum_steps=0'], 'train.curriculum_steps', ''),
    (['train.curriculum_start=8', 'parallel.tp=2', 'parallel.sequence_parallel=true', 'train.curriculum_step_size=1',
      'model.seq_len=32'], 'train.curriculum_step_size', 'multiple of parallel.tp 2'),
    (['train.curriculum_start=1', 'train.curriculum_step_size=1', 'model.seq_len=524288'], 'train.curriculum_step_size',
     '524,288 lengths from 1 to 524288; gptkit takes up to 262,144'),
])
def test_bad_values_are_refused_naming_the_key(tiny_data, tmp_path, sets, key, says):
    with pytest.raises(ConfigError) as e:
        config(tiny_data, tmp_path, *sets)
    assert [k for k, _ in e.value.problems] == [key] and says in str(e.value)
    r = run_here('train', '--data', tiny_data[0], '--tokenizer', tiny_data[1], '--out', tmp_path / 'cli',
                 *[a for s in TINY_SETS + sets for a in ('--set', s)])
    assert r.returncode == 2 and key in r.stdout + r.stderr and 'Traceback' not in r.stdout + r.stderr
    assert not (tmp_path / 'cli').exists()                                   # refused before anything started


@pytest.mark.slow
def test_a_pipeline_trains_the_short_steps_like_one_process(tiny_data, tmp_path):
    prefix, tok = tiny_data
    sets = [a for s in TINY_SETS + CURRICULUM for a in ('--set', s)]
    one = run_here('train', '--data', prefix, '--tokenizer', tok, '--out', tmp_path / 'one', *sets)
    env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, 'PYTHONUNBUFFERED': '1'}
    pp = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'train', '--data', prefix, '--tokenizer', tok,
                         '--out', str(tmp_path / 'pp'), *sets, '--pp', '2'], capture_output=True, text=True, env=env,
                        timeout=600)
    assert one.returncode == 0 and pp.returncode == 0, pp.stdout[-3000:] + pp.stderr[-3000:]
    want, got = rows(tmp_path / 'one'), rows(tmp_path / 'pp')
    assert [r['seq_len'] for r in got] == [r['seq_len'] for r in want] and want[0]['seq_len'] < 32
    assert [r['loss'] for r in got] == pytest.approx([r['loss'] for r in want], rel=1e-5)
    assert rows(tmp_path / 'pp', 'valid') and [r['loss'] for r in rows(tmp_path / 'pp', 'valid')] == pytest.approx(
        [r['loss'] for r in rows(tmp_path / 'one', 'valid')], rel=1e-5)


def test_the_dry_run_shows_the_curriculum(tiny_data, tmp_path):
    sets = ['train.curriculum_start=8', 'train.curriculum_steps=4', 'train.iters=6']
    r = run_here('train', '--data', tiny_data[0], '--tokenizer', tiny_data[1], '--out', tmp_path / 'dry', '--dry-run',
                 *[a for s in TINY_SETS + sets for a in ('--set', s)])
    assert r.returncode == 0, r.stdout + r.stderr
    said = ' '.join(r.stdout.split())
    assert 'curriculum: sequence length 8 -> 32 over 4 steps in multiples of 8' in said, r.stdout
    assert 'the lr decays by tokens' in said and not (tmp_path / 'dry').exists()
