"""Expert parallelism with pipeline parallelism through gptkit's training loop (EP 2 x PP 2 on four gloo processes):
the one-process run's losses, norms and weights; checkpoints that hold every expert of every stage, resume bit for bit,
load on one process with the EP x PP model's logits (generate and eval read them), and resume on another
expert-parallel degree (EP 1 x PP 2; EP 2 x PP 1 after `gptkit checkpoint reshard`)."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import run_here

from gptkit.checkpoint import checkpointing as ckpt

from gptkit.store import folders as store
from gptkit.train.engine import free_port
from gptkit.config.run import resolve

# a two-layer MoE shrunk from moe-tiny (four experts, top 2): one MoE layer per stage; 4 sequences of 16 tokens a step
SETS = ['model.layers=2', 'model.hidden=32', 'model.heads=4', 'model.kv_heads=2', 'model.seq_len=16',
        'model.moe_experts=4', 'model.moe_ffn_hidden=24', 'model.moe_z_loss_coef=0.001', 'train.micro_batch=1',
        'train.global_batch=4', 'train.iters=4', 'train.precision=fp32', 'train.save_interval=2',
        'train.eval_iters=0', 'train.log_interval=1', 'optim.lr=1e-2', 'optim.warmup=1', 'optim.grad_clip=0.05']
DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
IDS = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))


def _cfg(root, name, prefix, tok, ep, pp):
    return resolve('moe-tiny', sets=SETS + [f'parallel.ep={ep}', f'parallel.pp={pp}'],
                   overrides={'data': {'prefix': prefix, 'tokenizer': tok}}, out=f'{root}/{name}')


def _from_step_2(root, src, name):
    "A run folder `name` holding only the checkpoint of step 2 of run `src` (rank 0 copies it)"
    shutil.copytree(Path(root) / src / 'checkpoints' / 'iter_0000002',
                    Path(root) / name / 'checkpoints' / 'iter_0000002')


def _pipeline_logits(engine, cfg, rank):
    "The logits of IDS through the EP x PP model as trained: its 1F1B pipeline, every data-parallel rank fed IDS"
    import torch.distributed as dist

    from gptkit.parallel.groups import ParallelState, one_f_one_b, stage_input_shape
    ps = ParallelState.build(cfg.for_world(dist.get_world_size()).layout)
    engine.module.eval()
    with torch.no_grad():
        outs = one_f_one_b(engine.module, None, [(IDS, None)], parallel=ps,
                           shape=stage_input_shape(cfg.model, len(IDS)), dtype=torch.float32, device='cpu', train=False)
    if ps.is_last_stage and ps.dp_rank == 0:
        return outs[0][..., :cfg.model.vocab].clone()
    return None


def _worker(rank, world, root, prefix, tok, port):
    """One group of four processes for every run: EP 2 x PP 2 for 4 steps; resumed at step 2 on EP 2 x PP 2, on
    EP 1 x PP 2, and (resharded to one stage by rank 0) on EP 2 x PP 1"""
    import torch.distributed as dist

    from gptkit.interop.hf import reshard
    from gptkit.train.loop import train
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    found = {}
    r = train(_cfg(root, 'full', prefix, tok, 2, 2))
    found['logits'] = _pipeline_logits(r.engine, _cfg(root, 'full', prefix, tok, 2, 2), rank)
    if rank == 0:
        for name in ('same', 'ep1'):
            _from_step_2(root, 'full', name)
        reshard(f'{root}/full/checkpoints/iter_0000002', f'{root}/pp1', pp=1)
    dist.barrier()
    train(_cfg(root, 'same', prefix, tok, 2, 2), resume=True)
    train(_cfg(root, 'ep1', prefix, tok, 1, 2), resume=True)
    train(_cfg(root, 'pp1', prefix, tok, 2, 1), resume=True)
    if found['logits'] is not None:
        torch.save(found['logits'], f'{root}/logits.pt')
    dist.barrier()                                      # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope='module')
def runs(tiny_data, tmp_path_factory):
    "The run folders of the four-process group (full, same, ep1, pp1) and the EP x PP model's logits"
    root = tmp_path_factory.mktemp('ep_pp')
    env = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
    try:
        mp.spawn(_worker, args=(4, str(root), *tiny_data, free_port()), nprocs=4, join=True)
    finally:
        os.environ.update(env)
    return root


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
    return {r['iteration']: r for r in rows if r['kind'] == 'train'}


def _expert_rows(folder: Path) -> dict[str, int]:
    "Expert weight name -> its rows, in each stage's model file"
    out = {}
    for f in sorted(folder.glob('mp_rank_*_model_states.pt')):
        module = torch.load(f, weights_only=True)['module']
        out.update({f'{f.name[:10]}:{n}': t.shape[0] for n, t in module.items() if '.experts.' in n})
    return out


def test_every_stage_saves_every_expert_and_resumes_bit_for_bit(runs):
    for it in ('iter_0000002', 'iter_0000004'):
        rows = _expert_rows(runs / 'full' / 'checkpoints' / it)
        assert sorted(rows) == ['mp_rank_00:blocks.0.mlp.experts.fc1.weight', 'mp_rank_00:blocks.0.mlp.experts.fc2.weight',
                                'mp_rank_01:blocks.1.mlp.experts.fc1.weight', 'mp_rank_01:blocks.1.mlp.experts.fc2.weight']
        assert set(rows.values()) == {4}, rows
    full, same = _rows(runs / 'full'), _rows(runs / 'same')
    assert sorted(full) == [1, 2, 3, 4] and sorted(same) == [3, 4]
    assert [same[i]['loss'] for i in (3, 4)] == [full[i]['loss'] for i in (3, 4)]           # bit for bit
    assert [same[i]['grad_norm'] for i in (3, 4)] == [full[i]['grad_norm'] for i in (3, 4)]
    a, b = ckpt.load_weights(runs / 'full'), ckpt.load_weights(runs / 'same')
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert store.read_state(runs / 'same' / 'checkpoints' / 'iter_0000004')['ep'] == 2


def test_the_checkpoint_loads_on_one_process_with_the_pipeline_logits(runs):
    loaded = ckpt.load_model(runs / 'full')
    assert loaded.state['ep'] == 2 and loaded.state['layout']['pp'] == 2
    fc1 = [n for n, p in loaded.model.named_parameters() if n.endswith('experts.fc1.weight')]
    assert len(fc1) == 2 and all(loaded.model.get_parameter(n).shape[0] == 4 for n in fc1)
    with torch.no_grad():
        logits = loaded.model(IDS)[..., :loaded.config.model.vocab]
    want = torch.load(runs / 'logits.pt')
    assert logits.shape == want.shape and (logits - want).abs().max().item() < 1e-5


def test_it_resumes_on_another_expert_parallel_degree(runs):
    "EP 1 x PP 2 and EP 2 x PP 1 (resharded): step 3's loss and norm, before Adam steps, are the run's; Adam restarts"
    full = _rows(runs / 'full')
    for name in ('ep1', 'pp1'):
        got = _rows(runs / name)
        assert sorted(got) == [3, 4], name
        assert got[3]['loss'] == pytest.approx(full[3]['loss'], rel=1e-5, abs=0), name
        assert got[3]['grad_norm'] == pytest.approx(full[3]['grad_norm'], rel=1e-5, abs=0), name
    assert store.read_state(runs / 'ep1' / 'checkpoints' / 'iter_0000004')['ep'] == 1
    assert store.read_state(runs / 'pp1' / 'checkpoints' / 'iter_0000004')['layout']['pp'] == 1


def test_inspect_reports_the_degree_and_every_expert(runs):
    info = ckpt.inspect(runs / 'full')
    assert info['layout']['ep'] == 2 and info['layout']['pp'] == 2
    assert info['experts'] == {'ep': 2, 'experts': 4, 'per_rank': 2, 'top_k': 2, 'moe_layers': 2,
                               'expert_parameters': 2 * 4 * (48 * 32 + 32 * 24), 'whole': True}
    r = run_here('checkpoint', 'inspect', str(runs / 'full'))
    text = ' '.join(r.stdout.split())
    assert r.returncode == 0 and 'ep 2' in text and '4 in each of 2 MoE layers, top 2' in text, r.stdout + r.stderr
    assert '2 per rank at ep 2, all saved' in text, text


def test_generation_and_evaluation_read_the_ep_pipeline_checkpoint_as_its_one_process_reshard(runs, tmp_path):
    "gptkit generate and eval on the EP 2 x PP 2 run give what they give on its `checkpoint reshard` to one process"
    assert run_here('checkpoint', 'reshard', str(runs / 'full'), str(tmp_path / 'one')).returncode == 0
    (tmp_path / 'text.txt').write_text('In the beginning God created the heaven and the earth. ' * 4)
    said = {}
    for name, path in (('pp', runs / 'full'), ('one', tmp_path / 'one')):
        g = run_here('generate', '--checkpoint', str(path), '--prompt', 'And God said', '--greedy',
                     '--max-new-tokens', '8')
        e = run_here('eval', '--checkpoint', str(path), '--text', str(tmp_path / 'text.txt'), '--json')
        assert g.returncode == 0 and e.returncode == 0, g.stderr[-2000:] + e.stderr[-2000:]
        said[name] = g.stdout, json.loads(e.stdout)['perplexity']['loss']
    assert said['pp'][0] == said['one'][0] and 'And God said' in said['pp'][0]
    assert said['pp'][1] == pytest.approx(said['one'][1], rel=1e-6)


def test_ep_pp_trains_like_one_process(runs, tiny_data, tmp_path):
    "The same run on one process (every expert, no stages, 4 accumulation steps): losses, norms, trained weights (1e-5)"
    from gptkit.train.loop import train
    cfg = resolve('moe-tiny', sets=SETS, overrides={'data': {'prefix': tiny_data[0], 'tokenizer': tiny_data[1]}},
                  out=str(tmp_path / 'one'))
    env = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
    try:
        train(cfg)
    finally:
        os.environ.update(env)
    one, full = _rows(tmp_path / 'one'), _rows(runs / 'full')
    assert sorted(one) == sorted(full) == [1, 2, 3, 4]
    for i in one:
        assert full[i]['loss'] == pytest.approx(one[i]['loss'], rel=1e-5, abs=0), i
        assert full[i]['grad_norm'] == pytest.approx(one[i]['grad_norm'], rel=1e-5, abs=0), i
    a, b = ckpt.load_weights(runs / 'full'), ckpt.load_weights(tmp_path / 'one')
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize('ep, said', [(0, 'ep must be the whole number of ranks the experts were split over, not 0'),
                                      ('2', "ep must be the whole number of ranks the experts were split over, not '2'"),
                                      (3, 'ep 3 does not divide the 4 experts of each MoE layer')])
def test_a_damaged_ep_in_state_json_is_refused_in_one_sentence(runs, tmp_path, ep, said):
    folder = tmp_path / 'run' / 'checkpoints' / 'iter_0000004'
    shutil.copytree(runs / 'full' / 'checkpoints' / 'iter_0000004', folder)
    state = json.loads((folder / 'state.json').read_text())
    (folder / 'state.json').write_text(store.state_text({**state, 'ep': ep}))
    with pytest.raises(store.CheckpointError, match=f"state.json: {said}"):
        ckpt.inspect(folder)
    r = run_here('checkpoint', 'inspect', str(folder))
    assert r.returncode == 1 and said in ' '.join(r.stderr.split()) and 'Traceback' not in r.stderr, r.stderr
