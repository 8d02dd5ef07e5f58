"""Training on DeepSpeed: exact resume, data parallelism against one process, and every kind of bad input."""
import dataclasses
import errno
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_SETS, run_here

from gptkit.store import folders as store
from gptkit.data.plan import data_plan
from gptkit.errors import ConfigError, DataError
from gptkit.config.run import resolve
from gptkit.train.loop import TrainingError, train


def config(tiny_data, out, *sets, tokenizer=None):
    prefix, tok = tiny_data
    return resolve(sets=TINY_SETS + list(sets), overrides={'data': {'prefix': prefix, 'tokenizer': tokenizer or tok}},
                   out=str(out))


def weights(result):
    return {k: v.clone() for k, v in result.engine.module.state_dict().items()}


@pytest.mark.parametrize('zero,dropout', [(0, 0.0), (2, 0.1)])
def test_resume_equals_an_uninterrupted_run_bit_for_bit(tiny_data, tmp_path, zero, dropout):
    sets = [f'parallel.zero={zero}', f'model.dropout={dropout}']
    full = train(config(tiny_data, tmp_path / 'full', *sets))
    half = config(tiny_data, tmp_path / 'half', *sets)
    first = train(half, stop_after=3)
    assert first.iteration == 3 and first.checkpoint.name == 'iter_0000003'
    second = train(half, resume=True)
    assert first.losses + second.losses == full.losses
    a, b = weights(full), weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert second.valid_loss == full.valid_loss and second.test_loss == full.test_loss


def test_resume_with_a_new_learning_rate_follows_it(tiny_data, tmp_path):
    "Fine-tuning a checkpoint (an import, or a run continued) at another lr: the schedule follows the new optim settings"
    from gptkit.train.optim import Schedule
    from gptkit.train.callbacks import Callback
    first = train(config(tiny_data, tmp_path, 'train.iters=3'))
    lrs = []
    class Lr(Callback):
        def on_step(self, m): lrs.append((m.iteration, m.lr))
    cfg = config(tiny_data, tmp_path, 'train.iters=6', 'optim.lr=5e-4', 'optim.warmup=0')
    train(cfg, callbacks=[Lr()], resume=True)
    assert first.iteration == 3 and [i for i, _ in lrs] == [4, 5, 6]
    schedule = Schedule(cfg.optim, 6)                   # as a run at 5e-4 from the start
    assert [lr for _, lr in lrs] == pytest.approx([schedule(i) for i, _ in lrs], rel=1e-6)
    assert max(lr for _, lr in lrs) <= 5e-4


def test_run_folder_holds_config_metrics_tensorboard_and_checkpoint(tiny_data, tmp_path):
    r = train(config(tiny_data, tmp_path / 'run', 'train.save_interval=2', 'train.keep=2'))
    run = tmp_path / 'run'
    assert resolve(file=run / 'config.json').model.vocab == 512           # the tokenizer's vocabulary, recorded
    assert json.loads((run / 'ds_config.json').read_text())['gradient_accumulation_steps'] == 2
    rows = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
    steps = [r for r in rows if r['kind'] == 'train']
    assert [s['iteration'] for s in steps] == list(range(1, 7))
    assert {'loss', 'lr', 'grad_norm', 'tokens_per_s', 'tflops', 'memory_gib'} <= set(steps[0]) and steps[0]['grad_norm'] > 0
    assert [r['iteration'] for r in rows if r['kind'] == 'valid'] == [3, 6] and any(r['kind'] == 'test' for r in rows)
    assert [p.name for _, p in store.checkpoints(run / 'checkpoints')] == ['iter_0000004', 'iter_0000006']   # keep=2
    assert (run / 'checkpoints' / 'latest').read_text() == 'iter_0000006'
    saved = r.checkpoint
    assert store.verify(saved) is None and (saved / 'tokenizer' / 'tokenizer.json').is_file()
    assert resolve(file=saved / 'config.json').model.hidden == 32
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ev = EventAccumulator(str(run / 'tensorboard')); ev.Reload()
    assert [e.step for e in ev.Scalars('train/loss')] == list(range(1, 7))
    logged = [e.value for e in ev.Scalars('train/loss')]                    # TensorBoard keeps float32
    assert all(abs(v - s['loss']) < 1e-6 * abs(s['loss']) for v, s in zip(logged, steps, strict=True))
    assert 'valid/loss' in ev.Tags()['scalars']


def test_loss_falls(tiny_data, tmp_path):
    r = train(config(tiny_data, tmp_path / 'run', 'train.iters=30', 'train.eval_interval=100'))
    assert r.losses[-1] < r.losses[0] - 0.5, r.losses


def test_missing_data_prefix_names_it(tiny_data, tmp_path):
    cfg = dataclasses.replace(config(tiny_data, tmp_path / 'run'),
                              data=dataclasses.replace(config(tiny_data, tmp_path).data, prefix=str(tmp_path / 'nope')))
    with pytest.raises(DataError, match=r'nope\.(bin|idx): no such file; data.prefix'):
        train(cfg)
    with pytest.raises(ConfigError, match='data.prefix is not set'):
        train(resolve(sets=TINY_SETS, out=str(tmp_path / 'x')))
    assert not (tmp_path / 'run').exists()


def test_ids_beyond_the_tokenizer_are_refused(tiny_data, tmp_path):
    from gptkit.tokenizer.bpe import save_tokenizer, train_bpe
    save_tokenizer(train_bpe(['a few words of text to learn from'] * 50, 300), tmp_path / 'small_tok')
    with pytest.raises(DataError, match="token id .* is outside the tokenizer's .* entries; the data was prepared with a different tokenizer"):
        train(config(tiny_data, tmp_path / 'run', tokenizer=str(tmp_path / 'small_tok')))


def test_existing_checkpoints_are_not_overwritten_without_resume(tiny_data, tmp_path):
    train(config(tiny_data, tmp_path / 'run', 'train.iters=2'))
    with pytest.raises(ConfigError, match='already holds checkpoints .*resume them with --resume'):
        train(config(tiny_data, tmp_path / 'run', 'train.iters=2'))


def test_mismatched_model_names_the_settings_before_writing(tiny_data, tmp_path):
    train(config(tiny_data, tmp_path / 'run', 'train.iters=2'))
    saved = (tmp_path / 'run' / 'config.json').read_bytes()
    with pytest.raises(store.CheckpointError, match=r'iter_0000002 holds another model than this run describes '
                                                    r'\(model.hidden 64 here, 32 there\)'):
        train(config(tiny_data, tmp_path / 'run', 'train.iters=4', 'model.hidden=64'), resume=True)
    assert (tmp_path / 'run' / 'config.json').read_bytes() == saved


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tiny_data, tmp_path, caplog):
    cfg = config(tiny_data, tmp_path / 'run', 'train.save_interval=2', 'train.iters=4')
    train(cfg)
    newest = tmp_path / 'run' / 'checkpoints' / 'iter_0000004'
    f = newest / 'mp_rank_00_model_states.pt'
    f.write_bytes(f.read_bytes()[:-100])                                   # truncated after the fact
    (tmp_path / 'run' / 'checkpoints' / '.tmp-iter_0000006').mkdir()          # a save that never finished
    with caplog.at_level(logging.WARNING):
        r = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iters=5)), resume=True)
    assert 'skipping checkpoint iter_0000004' in caplog.text and 'bytes' in caplog.text
    assert len(r.losses) == 3 and r.iteration == 5                          # resumed from step 2


def test_full_disk_keeps_the_previous_checkpoint(tiny_data, tmp_path, monkeypatch):
    cfg = config(tiny_data, tmp_path / 'run', 'train.iters=2')
    train(cfg)
    real_save = torch.save
    def full_disk(obj, f, *a, **k):
        if 'rng_rank' in str(f): raise OSError(errno.ENOSPC, 'No space left on device')
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, 'save', full_disk)
    with pytest.raises(store.CheckpointError,
                       match=r'iter_0000003: the disk is full \(at least [\d.]+ KiB needed, [\d.,]+ \w+ free\); the '
                             r'previous checkpoint .*iter_0000002 is intact'):
        train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iters=3)), resume=True)
    root = tmp_path / 'run' / 'checkpoints'
    assert [p.name for _, p in store.checkpoints(root)] == ['iter_0000002']
    assert store.verify(root / 'iter_0000002') is None
    assert not list(root.glob('.tmp-*')) and (root / 'latest').read_text() == 'iter_0000002'


def test_nan_losses_are_skipped_then_stop_the_run(tiny_data, tmp_path, monkeypatch, caplog):
    from gptkit.model.decoder import GPT
    real = GPT.loss
    calls = {'n': 0}
    def sometimes_nan(self, logits, targets):
        calls['n'] += 1
        loss = real(self, logits, targets)
        return loss * float('nan') if calls['n'] in (3, 4) else loss    # both micro-batches of step 2
    monkeypatch.setattr(GPT, 'loss', sometimes_nan)      # the plain path's loss: model.kernels=torch below
    with caplog.at_level(logging.WARNING):
        r = train(config(tiny_data, tmp_path / 'a', 'train.iters=4', 'train.eval_iters=0', 'model.kernels=torch'))
    assert 'step 2: 2 of 2 micro-batches had a NaN or infinite loss' in caplog.text
    assert math.isnan(r.losses[1]) and all(math.isfinite(l) for i, l in enumerate(r.losses) if i != 1)
    assert all(torch.isfinite(p).all() for p in r.engine.module.parameters())
    monkeypatch.setattr(GPT, 'loss', lambda self, logits, targets: real(self, logits, targets) * float('inf'))
    with pytest.raises(TrainingError, match='NaN or infinite in 3 steps in a row .*stopped without saving'):
        train(config(tiny_data, tmp_path / 'b', 'train.iters=10', 'train.max_bad_steps=3', 'model.kernels=torch'))
    assert not store.checkpoints(tmp_path / 'b' / 'checkpoints')


def test_a_model_too_big_for_this_machine_is_refused(tiny_data, tmp_path):
    cfg = resolve('175b', sets=['train.precision=fp32'],
                  overrides={'data': {'prefix': tiny_data[0], 'tokenizer': tiny_data[1]}}, out=str(tmp_path / 'r'))
    with pytest.raises(TrainingError, match=r'preset 175b needs about [\d,.]+ GiB per process by gptkit.s estimate .* but this machine has [\d,.]+ GiB; .*--force'):
        train(cfg)


DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')   # set by the in-process runs above


def _env():
    return {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, 'PYTHONUNBUFFERED': '1'}


def _cli(*args, **kw):
    env = _env()
    return subprocess.run([sys.executable, '-m', 'gptkit_cli.main', *args], capture_output=True, text=True, env=env,
                          timeout=300, **kw)


def _sets(*extra):
    return [a for s in TINY_SETS + list(extra) for a in ('--set', s)]


def _two_nodes(common: list[str], out: Path, nproc: int = 1) -> list[subprocess.CompletedProcess]:
    "`gptkit train` as two nodes on 127.0.0.1 (node ranks 0 and 1, started at once), each with `nproc` processes"
    from gptkit.train.engine import free_port
    node = [*common, '--out', str(out), '--nnodes', '2', '--master-addr', '127.0.0.1', '--master-port',
            str(free_port()), '--nproc', str(nproc)]
    procs = [subprocess.Popen([sys.executable, '-m', 'gptkit_cli.main', *node, '--node-rank', str(r)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), p.stdout.read(), '') for p in procs]


@pytest.fixture(scope='module')
def one_process_zero2(tiny_data, tmp_path_factory):
    "The reference run of the data-parallel tests: one process, ZeRO-2, 6 steps (made once)"
    prefix, tok = tiny_data
    out = tmp_path_factory.mktemp('one_zero2') / 'one'
    one = run_here('train', '--data', prefix, '--tokenizer', tok, *_sets('parallel.zero=2', 'train.eval_iters=0'),
                '--out', str(out))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    return out


@pytest.mark.parametrize('launcher', [pytest.param('torchrun, 2 nodes x 1', marks=pytest.mark.slow), 'deepspeed'])
def test_two_data_parallel_processes_match_one(tiny_data, one_process_zero2, tmp_path, launcher):
    "Two processes (one node's two, or two nodes' one each, through torchrun's --nnodes) train as one does"
    prefix, tok = tiny_data
    common = ['train', '--data', prefix, '--tokenizer', tok, *_sets('parallel.zero=2', 'train.eval_iters=0')]
    shutil.copytree(one_process_zero2, tmp_path / 'one')
    if launcher == 'deepspeed': runs = [_cli(*common, '--out', str(tmp_path / 'two'), '--nproc', '2', '--launcher',
                                             launcher)]
    else: runs = _two_nodes(common, tmp_path / 'two')
    for two in runs: assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    losses = [[json.loads(l)['loss'] for l in (tmp_path / d / 'metrics.jsonl').read_text().splitlines() if '"train"' in l] for d in ('one', 'two')]
    assert len(losses[0]) == 6 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert json.loads((tmp_path / 'two' / 'ds_config.json').read_text())['gradient_accumulation_steps'] == 1
    ck = [torch.load(tmp_path / d / 'checkpoints' / 'iter_0000006' / 'mp_rank_00_model_states.pt',
                     weights_only=False)['module'] for d in ('one', 'two')]
    for k in ck[0]: torch.testing.assert_close(ck[1][k], ck[0][k], rtol=1e-4,
                                               atol=2e-5)   # Adam amplifies rounding near zero


@pytest.mark.slow
def test_tokens_without_a_global_batch_train_the_same_tokens_on_one_and_two_processes(tiny_data, tmp_path):
    "--tokens, train.global_batch=null: two data-parallel processes take steps of twice the tokens, half as many"
    prefix, tok = tiny_data
    sets = [s for s in TINY_SETS if not s.startswith('train.iters=')]     # the run's length comes from --tokens
    sets += ['train.global_batch=null', 'train.eval_iters=0', 'train.log_interval=100']
    common = ['train', '--data', prefix, '--tokenizer', tok, '--tokens', '512',
              *[a for s in sets for a in ('--set', s)]]
    runs = {n: run_here if n == 1 else _cli(*common, '--out', str(tmp_path / f'dp{n}'), '--nproc',
                                            str(n)) for n in (1, 2)}
    for n, r in runs.items(): assert r.returncode == 0, f'dp{n}: ' + r.stdout[-3000:] + r.stderr[-3000:]
    rows = {n: (tmp_path / f'dp{n}' / 'metrics.jsonl').read_text().splitlines() for n in (1, 2)}
    last = {n: [json.loads(l) for l in rows[n] if '"train"' in l][-1] for n in (1, 2)}
    assert (last[1]['iteration'], last[1]['tokens']) == (8, 512)          # steps of 2 sequences of 32 tokens
    assert (last[2]['iteration'], last[2]['tokens']) == (4, 512)          # steps of 2 x 2 sequences
    assert '4 steps, 512 tokens' in runs[2].stdout and '8 steps, 512 tokens' in runs[1].stdout
    ds = json.loads((tmp_path / 'dp2' / 'ds_config.json').read_text())
    assert (ds['train_batch_size'], ds['gradient_accumulation_steps']) == (4, 1)
    assert json.loads((tmp_path / 'dp2' / 'config.json').read_text())['parallel']['dp'] == 2   # the real layout


def test_sigterm_saves_a_checkpoint_that_resumes(tiny_data, tmp_path):
    prefix, tok = tiny_data
    args = ['train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'run'), *_sets('train.iters=100000', 'train.eval_iters=0')]
    p = subprocess.Popen([sys.executable, '-m', 'gptkit_cli.main', *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    metrics = tmp_path / 'run' / 'metrics.jsonl'
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"train"') >= 3): time.sleep(0.2)
    p.send_signal(signal.SIGTERM)                  # a scheduler preempting the job
    output, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert 'interrupted by SIGTERM' in ' '.join(output.split()) and '--resume' in output
    (it, folder), = store.checkpoints(tmp_path / 'run' / 'checkpoints')
    assert 3 <= it < 100000 and store.verify(folder) is None
    r = _cli(*args[:-2], *_sets(f'train.iters={it + 2}', 'train.eval_iters=0')[2:], '--resume')
    assert r.returncode == 0 and f'resumed from' in r.stdout and f'{it + 2} steps' in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize('sets', [
    ['parallel.zero=1', 'train.precision=bf16'],
    ['parallel.zero=3', 'train.recompute=full'],
    ['parallel.zero=2', 'train.precision=bf16', 'train.recompute=selective'],
])
def test_zero_stages_precisions_and_recompute_train(tiny_data, tmp_path, sets):
    r = train(config(tiny_data, tmp_path / 'run', 'train.iters=4', 'train.eval_iters=0', *sets))
    assert r.iteration == 4 and all(math.isfinite(l) for l in r.losses) and r.losses[-1] < r.losses[0]
    assert store.verify(r.checkpoint) is None
    rows = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines() if '"train"' in l]
    assert rows[-1]['grad_norm'] > 0


def test_fp16_trains_with_a_loss_scale_or_is_refused_clearly(tiny_data, tmp_path):
    from deepspeed.accelerator import get_accelerator
    cfg = config(tiny_data, tmp_path / 'run', 'train.iters=3', 'train.eval_iters=0', 'train.precision=fp16')
    if torch.float16 not in get_accelerator().supported_dtypes():     # DeepSpeed's CPU accelerator on most CPUs
        with pytest.raises(ConfigError, match='train.precision fp16 is not supported by DeepSpeed on this cpu device; use fp32 or bf16'):
            train(cfg)
        return
    train(cfg)
    rows = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines() if '"train"' in l]
    assert rows[-1]['loss_scale'] >= 1


@pytest.mark.parametrize('zero', [0, 1])
def test_fp16_scales_its_loss_dynamically_where_deepspeed_takes_fp16(tiny_data, tmp_path, monkeypatch, zero):
    "A CPU with AVX-512-FP16/AMX (forced here on any CPU): the loss is scaled dynamically and every report has the scale"
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == 'cpu':
        monkeypatch.setattr(type(acc), 'is_fp16_supported', lambda self: True)
    cfg = config(tiny_data, tmp_path / 'run', 'train.iters=3', 'train.eval_iters=0', 'train.precision=fp16',
                 f'parallel.zero={zero}')
    r = train(cfg)
    assert all(math.isfinite(l) for l in r.losses)
    rows = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines() if '"train"' in l]
    scales = [row['loss_scale'] for row in rows]
    assert len(scales) == 3
    assert all(s is not None and s >= 1 and math.log2(s).is_integer() and s <= 2**16 for s in scales), scales


def test_every_optimizer_step_reaches_on_train_step(tiny_data, tmp_path):
    "The per-step hook (gptkit profile's profiler.step()) runs once per step, before that step's report"
    from gptkit.train.callbacks import Callback
    seen = []
    class Steps(Callback):
        def on_train_step(self, iteration): seen.append(('step', iteration))
        def on_step(self, m): seen.append(('report', m.iteration))
    train(config(tiny_data, tmp_path, 'train.iters=3', 'train.eval_iters=0',
                 'train.log_interval=2'), callbacks=[Steps()])
    assert seen == [('step', 1), ('step', 2), ('report', 2), ('step', 3), ('report', 3)]


def blend_config(tiny_data, out, data, *sets):
    return resolve(sets=TINY_SETS + list(sets), overrides={'data': {'tokenizer': tiny_data[1], **data}}, out=str(out))


@pytest.fixture
def two_datasets(tiny_data, tmp_path):
    "(a, b): the tiny KJV dataset and a second one made of every third of its documents, reversed"
    import numpy as np

    from gptkit.data.indexed import IndexedDataset, IndexedWriter
    data = IndexedDataset(tiny_data[0])
    with IndexedWriter(tmp_path / 'b', data.dtype) as w:
        for i in range(0, len(data), 3): w.add_document(np.asarray(data.get(i))[::-1])
    return tiny_data[0], str(tmp_path / 'b')


def test_a_blend_trains_in_megatrons_order_and_resuming_on_another_blend_is_refused(tiny_data, two_datasets, tmp_path):
    from gptkit.data.samples import BlendedSamples, split_samples
    from gptkit.train.loop import _split
    a, b = two_datasets
    cfg = blend_config(tiny_data, tmp_path / 'run', {'prefix': f'0.3 {a} 0.7 {b}', 'split': '90,8,2'}, 'train.iters=3')
    train_set = _split(cfg, 'train', 0)
    theirs = split_samples([a, b], [0.3, 0.7], 'train', num_samples=12, seq_len=32, seed=cfg.train.seed, split='90,8,2',
                           cache=False)
    assert isinstance(train_set, BlendedSamples) and len(train_set) == 4 + 9
    assert all((train_set[i] == theirs[i]).all() for i in range(len(theirs)))
    plan = data_plan(cfg)
    assert [(p.weight, p.samples, p.built) for p in plan['train']] == [(0.3, 4, 5), (0.7, 9, 10)]
    first = train(cfg, stop_after=2)
    assert first.iteration == 2 and json.loads((tmp_path / 'run' / 'config.json').read_text())['data']['prefix'] == cfg.data.prefix
    other = blend_config(tiny_data, tmp_path / 'run', {'prefix': f'0.5 {a} 0.5 {b}', 'split': '90,8,2'},
                         'train.iters=3')
    with pytest.raises(DataError,
                       match=r"was trained on prefix '0\.3 .*, not prefix '0\.5 .*resuming on another blend"):
        train(other, resume=True)
    same = blend_config(tiny_data, tmp_path / 'run', {'prefix': f'3 {a} 7 {b}', 'split': '90,8,2'},
                        'train.iters=3')   # the same weights, normalized
    assert train(same, resume=True).iteration == 3


def test_per_split_blends_train_and_evaluate(tiny_data, two_datasets, tmp_path):
    a, b = two_datasets
    cfg = blend_config(tiny_data, tmp_path / 'run', {'train_prefix': f'1 {a} 1 {b}', 'valid_prefix': b},
                       'train.iters=3')
    r = train(cfg)
    assert r.iteration == 3 and r.valid_loss is not None and r.test_loss is None
    bad = blend_config(tiny_data, tmp_path / 'bad', {'train_prefix': f'1 {a} 1 {tmp_path / "nope"}'})
    with pytest.raises(DataError, match=r'nope\.(bin|idx): no such file; data.train_prefix must name'):
        train(bad)


def test_the_blend_check_on_resume(tmp_path):
    "Resuming compares blends by prefixes and normalized weights; a checkpoint that names no data (an import) takes any"
    from gptkit.config.sections import DataConfig
    from gptkit.train.plan import check_same_data
    from gptkit.config.run import RunConfig, save_config
    def saved(**data):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir(); save_config(RunConfig(data=DataConfig(tokenizer='t', **data)), folder / 'config.json')
        return folder
    new = RunConfig(data=DataConfig(prefix='1 a 3 b', tokenizer='t'))
    check_same_data(new, saved())                                      # an imported model: no data recorded
    check_same_data(new, saved(prefix='0.25 a 0.75 b'))
    with pytest.raises(DataError,
                       match=r"was trained on prefix 'a'; split '949,50,1', not prefix '1 a 3 b'; split '949,50,1'"):
        check_same_data(new, saved(prefix='a'))
    with pytest.raises(DataError, match="was trained on prefix '1 a 3 b'; split '90,10,0', not"):
        check_same_data(new, saved(prefix='1 a 3 b', split='90,10,0'))
    with pytest.raises(DataError, match="train_prefix '1 a 3 b'"):
        check_same_data(new, saved(train_prefix='1 a 3 b'))


def test_a_dataset_with_an_empty_split_in_a_blend_draws_nothing_from_that_split(tiny_data, two_datasets, tmp_path):
    a, b = two_datasets                                         # b: 397 documents, none in the test share of 949,50,1
    cfg = blend_config(tiny_data, tmp_path / 'run', {'prefix': f'1 {a} 1 {b}'})
    assert [p.prefix for p in data_plan(cfg)['test']] == [a]   # issue 51: refused before (tests/test_data_newcomer.py)


def test_megatron_unweighted_prefix_list_and_a_missing_dataset_get_their_own_sentences(tiny_data, two_datasets, tmp_path):
    a, b = two_datasets
    cfg = blend_config(tiny_data, tmp_path / 'run', {'prefix': f'{a} {b}'})   # Megatron's --data-path A B
    with pytest.raises(DataError, match=rf"data.prefix '{a} {b}' is not a dataset; a blend gives a weight before each "
                                        rf"prefix, as in '1 {a} 1 {b}'"):
        data_plan(cfg)
    cfg = blend_config(tiny_data, tmp_path / 'run', {'prefix': f'1 {a} 1 {tmp_path}/missing'})
    with pytest.raises(DataError, match=r'missing.idx: no such file') as e:
        data_plan(cfg)
    assert 'data.split' not in str(e.value)                    # no advice about splits for a file that is not there


def test_two_nodes_of_two_processes_match_one(tiny_data, tmp_path, request):
    "Flagged slow (4 processes on 2 cores): pytest --nb-flags slow"
    if 'slow' not in request.config.getoption('--nb-flags').split(): pytest.skip('slow: run with --nb-flags slow')
    prefix, tok = tiny_data
    common = ['train', '--data', prefix, '--tokenizer', tok,
              *_sets('parallel.zero=1', 'train.eval_iters=0', 'train.global_batch=8', 'train.micro_batch=2')]
    one = _cli(*common, '--out', str(tmp_path / 'one'))
    assert one.returncode == 0, one.stderr[-3000:]
    for node in _two_nodes(common, tmp_path / 'four', nproc=2): assert node.returncode == 0, node.stdout[-3000:]
    losses = [[json.loads(l)['loss'] for l in (tmp_path / d / 'metrics.jsonl').read_text().splitlines() if '"train"' in l]
              for d in ('one', 'four')]
    assert len(losses[0]) == 6 and losses[1] == pytest.approx(losses[0], rel=1e-5)
