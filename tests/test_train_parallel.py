"""`gptkit train --tp/--pp` through a launcher: the same losses as one process, checkpoints that resume, and tools that read any layout.

The runs fine-tune (train.task sft) on the built-in conversations: loss-masked targets and packed conversations kept
apart by the document mask, through every layout (the plain pre-training path runs in test_parallel_model,
test_resume_dp and the expert-parallel tests). Each layout is trained when a test first needs it; TP 2 x PP 2 in every
run, DP 2 x PP 2, DP 2 x TP 2 with SP and the 4-process resumes with --nb-flags slow."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import TINY_SETS, run_here

DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')


def _cli(*args):
    env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, 'PYTHONUNBUFFERED': '1'}
    return subprocess.run([sys.executable, '-m', 'gptkit_cli.main', *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _sets(*extra):
    return [a for s in TINY_SETS + ['train.save_interval=3', 'train.task=sft'] + list(extra) for a in ('--set', s)]


@pytest.fixture(scope='module')
def sft_data(tiny_data, tmp_path_factory):
    "(prefix, tokenizer): builtin:conversations with the tiny tokenizer, its loss mask beside it"
    from gptkit.data.chat import prepare_chat
    from gptkit.data.prepare import PrepareConfig
    tok = tiny_data[1]
    res = prepare_chat(PrepareConfig(inputs=('builtin:conversations',),
                                     output_prefix=str(tmp_path_factory.mktemp('sft') / 'chat'), tokenizer=tok))
    return str(res.prefix), tok


def _losses(run):
    rows = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
    return [r['loss'] for r in rows if r['kind'] == 'train'], [r['loss'] for r in rows if r['kind'] in ('valid', 'test')]


LAYOUTS = {'one': [], 'tp2pp2': ['--tp', '2', '--pp', '2'],       # TP 2 alone: tests/test_parallel_model.py
           'dp2pp2': ['--pp', '2', '--nproc', '4', '--set', 'parallel.zero=1', '--set', 'train.recompute=full'],
           'dp2tp2sp': ['--tp', '2', '--nproc', '4', '--set', 'parallel.sequence_parallel=true', '--set', 'parallel.zero=1']}


class Runs:
    "One run per layout, all with the same global batch of 4 sequences, each trained when a test first asks for it"
    def __init__(self, root, prefix, tok):
        self.root, self.prefix, self.tok = root, prefix, tok

    def __truediv__(self, name: str):
        if not (self.root / name / 'metrics.jsonl').exists():
            run = _cli if LAYOUTS[name] else run_here              # one process needs no launcher
            r = run('train', '--data', self.prefix, '--tokenizer', self.tok, '--out', str(self.root / name), *_sets(),
                    *LAYOUTS[name])
            assert r.returncode == 0, name + r.stdout[-3000:] + r.stderr[-3000:]
            assert 'task sft' in r.stdout, r.stdout[-3000:]
        return self.root / name


@pytest.fixture(scope='module')
def runs(sft_data, tmp_path_factory):
    return Runs(tmp_path_factory.mktemp('layouts'), *sft_data)


@pytest.mark.parametrize('name', ['tp2pp2', pytest.param('dp2pp2', marks=pytest.mark.slow),     # 4 processes each
                                  pytest.param('dp2tp2sp', marks=pytest.mark.slow)])
def test_every_layout_trains_like_one_process(runs, name):
    (want, want_eval), (got, got_eval) = _losses(runs / 'one'), _losses(runs / name)
    assert len(want) == 6 and got == pytest.approx(want, rel=1e-5) and got_eval == pytest.approx(want_eval, rel=1e-5)
    ds = json.loads((runs / name / 'ds_config.json').read_text())
    assert ds['train_batch_size'] == 4


@pytest.mark.slow                   # a resume of 4 processes; resumes on 2: test_resume_dp, test_train
def test_a_parallel_run_resumes_where_it_stopped(runs, sft_data, tmp_path):
    prefix, tok = sft_data
    shutil.copytree(runs / 'tp2pp2', tmp_path / 'again',
                    ignore=shutil.ignore_patterns('iter_0000006', 'metrics.jsonl', 'tensorboard'))
    (tmp_path / 'again' / 'checkpoints' / 'latest').write_text('iter_0000003')
    r = _cli('train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'again'), *_sets(), '--tp', '2',
             '--pp', '2', '--resume')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _losses(tmp_path / 'again')[0] == pytest.approx(_losses(runs / 'tp2pp2')[0][3:], rel=1e-6)


def _logits_worker(rank, world, folder, ids_file, out):
    import torch
    import torch.distributed as dist
    from gptkit.checkpoint.checkpointing import read_config
    from gptkit.store.folders import read_state
    from gptkit.model.decoder import GPT
    from gptkit.parallel.groups import Layout, ParallelState, apply_tp, one_f_one_b, pipeline_stage, stage_input_shape
    from gptkit.parallel.tensor import _gather
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{out}/init', rank=rank, world_size=world)
    try:
        from pathlib import Path
        folder = Path(folder)
        cfg, layout = read_config(folder), read_state(folder)['layout']
        ps = ParallelState.build(Layout.for_world(world, tp=layout['tp'], pp=layout['pp']))
        model = pipeline_stage(apply_tp(GPT(cfg.model), ps), ps, layout.get('balance', 'layers'))
        mp = ps.tp_rank + ps.layout.tp * ps.pp_rank
        model.load_state_dict(torch.load(folder / f'mp_rank_{mp:02d}_model_states.pt', weights_only=False)['module'])
        model.eval()
        ids = torch.load(ids_file)
        with torch.no_grad():
            outs = one_f_one_b(model, None, [(ids, None)], parallel=ps,
                               shape=stage_input_shape(cfg.model, len(ids), ps.layout.tp), dtype=torch.float32,
                               device='cpu', train=False)
        if ps.is_last_stage:
            logits = _gather(outs[0], ps.tp_group)[..., :cfg.model.vocab]
            if ps.tp_rank == 0: torch.save(logits, f'{out}/logits.pt')
    finally:
        dist.destroy_process_group()


def _parallel_logits(folder, world, ids, tmp):
    import torch
    from test_parallel_model import spawn
    tmp.mkdir()
    torch.save(ids, tmp / 'ids.pt')
    spawn(_logits_worker, world, str(folder), str(tmp / 'ids.pt'), str(tmp))
    return torch.load(tmp / 'logits.pt')


def test_reshard_round_trip_gives_identical_logits(runs, tmp_path):
    "TP 2 x PP 2 (as trained) -> TP 1 x PP 1 -> TP 2 x PP 1: the same logits from each layout, computed in that layout"
    import torch
    from gptkit.checkpoint.checkpointing import load_model, load_weights
    from gptkit.store.folders import find
    trained = find(runs / 'tp2pp2')
    r = run_here('checkpoint', 'reshard', str(trained), str(tmp_path / 'one'))
    assert r.returncode == 0 and 'resharded' in r.stdout, r.stdout + r.stderr
    r = run_here('checkpoint', 'reshard', str(tmp_path / 'one'), str(tmp_path / 'tp2'), '--tp', '2')
    assert r.returncode == 0, r.stdout + r.stderr
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    a = _parallel_logits(trained, 4, ids, tmp_path / 'a')
    b = load_model(tmp_path / 'one').model(ids).detach()
    c = _parallel_logits(find(tmp_path / 'tp2'), 2, ids, tmp_path / 'c')
    assert a.shape == b.shape == c.shape == (2, 32, 512)
    assert (a - b).abs().max() < 1e-5 and (c - b).abs().max() < 1e-5
    w = load_weights(trained)
    assert all(torch.equal(w[k], v) for k, v in load_weights(tmp_path / 'tp2').items())


def test_tools_read_any_layout(runs, tmp_path):
    "generate, inspect and export take the TP 2 x PP 2 checkpoint as it is"
    r = run_here('checkpoint', 'inspect', str(runs / 'tp2pp2'), '--json')
    assert r.returncode == 0 and json.loads(r.stdout)['layout']['tp'] == 2 and json.loads(r.stdout)['layout']['pp'] == 2
    args = ['generate', '--prompt', 'And God said', '--greedy', '--max-new-tokens', '8']
    a = run_here(*args, '--checkpoint', str(runs / 'tp2pp2'))
    assert run_here('checkpoint', 'reshard', str(runs / 'tp2pp2'), str(tmp_path / 'one')).returncode == 0
    b = run_here(*args, '--checkpoint', str(tmp_path / 'one'))
    assert a.returncode == 0 and b.returncode == 0 and a.stdout == b.stdout and 'And God said' in a.stdout, a.stderr[-2000:]
    e = run_here('checkpoint', 'export', str(runs / 'tp2pp2'), str(tmp_path / 'hf'), '--to', 'hf')
    assert e.returncode == 0 and (tmp_path / 'hf' / 'model.safetensors').is_file(), e.stderr[-2000:]


def test_a_checkpoint_of_another_layout_is_refused_with_the_way_out(runs, sft_data, tmp_path):
    prefix, tok = sft_data
    shutil.copytree(runs / 'tp2pp2', tmp_path / 'run', ignore=shutil.ignore_patterns('metrics.jsonl', 'tensorboard'))
    # a resume takes the run's own config.json, layout included; asking for another layout is refused
    r = _cli('train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'run'), *_sets('train.iters=8'),
             '--resume', '--tp', '1', '--pp', '1')
    assert r.returncode == 1
    assert 'was saved with tp 2 pp 2' in r.stderr and 'gptkit checkpoint reshard' in r.stderr, r.stderr[-2000:]


@pytest.mark.slow                   # reshards themselves: test_reshard_round_trip_gives_identical_logits
def test_training_continues_in_another_layout_after_reshard(runs, sft_data, tmp_path):
    "TP 2 x PP 2 -> reshard -> TP 2 x PP 1: the run goes on from step 6 with the weights it had (the optimizer restarts)"
    prefix, tok = sft_data
    assert run_here('checkpoint', 'reshard', str(runs / 'tp2pp2'), str(tmp_path / 'tp2'), '--tp', '2').returncode == 0
    r = _cli('train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'tp2'),
             *_sets('train.iters=8', 'train.eval_iters=0'), '--tp', '2', '--resume')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / 'tp2' / 'metrics.jsonl').read_text().splitlines() if '"train"' in l]
    assert [row['iteration'] for row in rows] == [7, 8]
    last = _losses(runs / 'tp2pp2')[0][-1]
    fresh = math.log(512)                                 # a model of random weights guesses uniformly over 512 tokens
    assert abs(rows[0]['loss'] - last) < 0.5 * (fresh - last), (rows[0]['loss'], last)   # where the run was, not fresh
