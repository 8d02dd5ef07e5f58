"""Expert parallelism: parallel.ep checked against the model and the processes before any starts, refused where
training does not run it, the all-to-all MoE layer equal to the one-process layer on gloo processes, and its
checkpoints: every expert in the model file, a bitwise resume, a load on one process."""
import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from typer.testing import CliRunner

from gptkit.checkpoint import checkpointing as ckpt
from gptkit.config.sections import ModelConfig, ParallelConfig, TrainConfig
from gptkit.train.engine import build_engine, free_port, init_distributed
from gptkit.errors import ConfigError
from gptkit.parallel.expert import AllToAll, ExpertParallelMoE, whole_experts
from gptkit.interop.hf import reshard
from gptkit.model.decoder import GPT
from gptkit.model.moe import MoE
from gptkit.parallel.groups import DeepSpeedMPU, ParallelState, parallelize
from gptkit.config.run import ep_engine_problems, from_dict, resolve
from gptkit.train.loop import _step
from gptkit_cli.main import app

MOE = {'layers': 2, 'hidden': 32, 'heads': 4, 'seq_len': 16, 'vocab': 64, 'moe_experts': 4, 'moe_top_k': 2}


@pytest.mark.parametrize('model, ep, said', [
    ({**MOE, 'moe_experts': 0}, 2, 'parallel.ep 2 splits the experts of mixture-of-experts layers, and this model is '
                                   'dense'),
    ({**MOE, 'moe_experts': 6}, 4, 'parallel.ep 4 must divide the 6 experts of each MoE layer'),
])
def test_ep_is_checked_against_the_model(model, ep, said):
    with pytest.raises(ConfigError, match=said):
        from_dict({'model': model, 'parallel': {'ep': ep}})


def test_ep_must_divide_the_data_parallel_size_the_processes_give():
    run = from_dict({'model': MOE, 'parallel': {'ep': 2}})        # planned alone: its processes decide dp
    with pytest.raises(ConfigError, match='parallel.ep 2 must divide the data-parallel size 3'):
        run.for_world(3)
    pp = from_dict({'model': MOE, 'parallel': {'ep': 2, 'pp': 2}})
    with pytest.raises(ConfigError, match='parallel.ep 2 must divide the data-parallel size 1'):
        pp.for_world(2)                                           # pp 2 on two processes leaves dp 1


def test_ep_trains_alone_and_with_pipeline_stages():
    "EP trains, with PP too (each stage's checkpoint holds every expert: tests/test_ep_pipeline.py); a dense model not"
    assert resolve('moe-tiny', sets=['parallel.ep=2', 'train.precision=fp32']).for_world(2).parallel.dp == 2
    run = resolve('moe-tiny', sets=['parallel.ep=2', 'parallel.pp=2', 'train.precision=fp32'])
    assert run.for_world(4).parallel.dp == 2
    fp32 = ['--set', 'train.precision=fp32']
    r = CliRunner().invoke(app, ['train', '--preset', 'moe-tiny', '--dry-run', '--nproc', '2',
                                 '--set', 'parallel.ep=2', *fp32])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ['train', '--preset', 'moe-tiny', '--dry-run', '--nproc', '4',
                                 '--set', 'parallel.ep=2', '--set', 'parallel.pp=2', *fp32])
    assert r.exit_code == 0 and 'does not train' not in r.output, r.output
    r = CliRunner().invoke(app, ['train', '--preset', 'tiny', '--dry-run', '--nproc', '2', '--set', 'parallel.ep=2'])
    assert r.exit_code == 2 and 'this model is dense' in ' '.join(r.output.split()), r.output


class _NoReturn(AllToAll):
    "The control: rows go out, but no gradient comes back to the rank that sent them"
    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(sum(ctx.send), *grad.shape[1:]), None, None, None


class _NoReturnMoE(ExpertParallelMoE):
    exchange = _NoReturn


LAYERS = [   # SwiGLU dropless, renormalised top 2, aux and z losses, a shared expert; GELU with biases, top 1, capacity
    dict(activation='swiglu', bias=False, moe_top_k=2, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01),
    dict(activation='gelu', bias=True, moe_top_k=1, moe_renormalize=False, moe_capacity_factor=1.0),
    dict(activation='gelu', bias=True, moe_top_k=2, lopsided=True),   # every token to rank 0's experts: empty parts
]


def _layer_errors(kind, layer, group, rank, world):
    "{what: max |EP - one process|} for rank `rank` of `world`, each rank's tokens its own micro-batch"
    layer = dict(layer)
    lopsided = layer.pop('lopsided', False)
    cfg = ModelConfig(layers=2, hidden=8, heads=2, seq_len=16, vocab=32, dropout=0.0, moe_experts=4,
                      moe_ffn_hidden=12, **layer)
    torch.manual_seed(0)
    plain = MoE(cfg, shared=nn.Linear(8, 8) if cfg.moe_top_k == 2 else None)
    for p in plain.parameters():
        nn.init.normal_(p, std=0.3)
    xs, ws = torch.randn(world, 3, 7, 8), torch.randn(world, 3, 7, 8)
    if lopsided:                                             # logits (5, 5, -5, -5) for every token
        xs[..., 0] = 1.0
        with torch.no_grad():
            plain.router.weight.zero_()
            plain.router.weight[:, 0] = torch.tensor([5.0, 5.0, -5.0, -5.0])
    refs = []
    for s in range(world):                                   # the one-process layer on each rank's micro-batch
        m, x = copy.deepcopy(plain), xs[s].clone().requires_grad_(True)
        out = m(x)
        (out * ws[s]).sum().backward()
        refs.append((out.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}))
    ep = kind(copy.deepcopy(plain), group)
    x = xs[rank].clone().requires_grad_(True)
    out = ep(x)
    (out * ws[rank]).sum().backward()
    out_ref, dx_ref, grads = refs[rank]
    errs = {'out': (out - out_ref).abs().max().item(), 'dx': (x.grad - dx_ref).abs().max().item()}
    mine = slice(rank * 4 // world, (rank + 1) * 4 // world)
    for n, p in ep.named_parameters():
        if n.startswith('experts.'):      # an expert's gradient: every rank's tokens
            want = sum(r[2][n] for r in refs)[mine]
        else:                             # router and shared expert: this rank's tokens (DP averages them later)
            want = grads[n]
        errs[n] = (p.grad - want).abs().max().item()
    return errs


def _layer_worker(rank, world, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        found = {}
        for i, layer in enumerate(LAYERS):
            found[i] = _layer_errors(ExpertParallelMoE, layer, dist.group.WORLD, rank, world)
            found[f'control {i}'] = _layer_errors(_NoReturnMoE, layer, dist.group.WORLD, rank, world)
        torch.save(found, f'{out}/{rank}.pt')
        dist.barrier()                                            # no rank leaves while its peer still talks to it
    finally:
        dist.destroy_process_group()


def _spawn(worker, world, tmp_path, *args):
    env = {k: os.environ.pop(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
           if k in os.environ}
    try:
        mp.spawn(worker, args=(world, str(tmp_path / 'init'), str(tmp_path), *args), nprocs=world, join=True)
    finally:
        os.environ.update(env)
    return [torch.load(f) for f in sorted(tmp_path.glob('[0-9]*.pt'))]


def test_ep2_layer_equals_the_one_process_layer_and_the_control_fails(tmp_path):
    "Outputs, input, router, shared-expert and expert gradients at 1e-5; without the return path the gradients differ"
    for rank, found in enumerate(_spawn(_layer_worker, 2, tmp_path)):
        for i in range(len(LAYERS)):
            assert max(found[i].values()) < 1e-5, (rank, i, found[i])
            control = found[f'control {i}']
            assert control['out'] < 1e-5, (rank, i, control)          # forward untouched ...
            assert control['dx'] > 1e-2, (rank, i, control)           # ... the gradients are not
            if not LAYERS[i].get('lopsided'):                        # (rank 1's experts get no rows there)
                assert max(v for n, v in control.items() if n.startswith('experts.')) > 1e-2, (rank, i, control)


TRAIN_SETS = ['model.layers=2', 'model.hidden=32', 'model.heads=4', 'model.kv_heads=2', 'model.seq_len=16',
              'model.vocab=64', 'model.moe_experts=4', 'model.moe_ffn_hidden=24', 'model.moe_z_loss_coef=0.001',
              'train.micro_batch=1', 'train.global_batch=4', 'train.iters=3', 'train.precision=fp32',
              'optim.lr=1e-2', 'optim.warmup=1', 'optim.grad_clip=0.05']


def _train_worker(rank, world, init_file, out, port, ep, pp):
    "Three steps of a tiny MoE through gptkit's engine and training step: losses, norms and the whole trained weights"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed()
    try:
        cfg = resolve('moe-tiny', sets=TRAIN_SETS + [f'parallel.ep={ep}', f'parallel.pp={pp}'])
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=world // pp))
        torch.manual_seed(0)
        parallel = ParallelState.build(cfg.layout)
        model = parallelize(GPT(cfg.model), parallel, 'none', cfg.train.seed)
        engine, _ = build_engine(cfg, model, mpu=DeepSpeedMPU(parallel) if pp > 1 else None)
        torch.manual_seed(1)
        data = torch.randint(0, 64, (3, 4, 17))                  # 3 steps of 4 sequences
        losses, norms = [], []
        for batch in data:
            mine = batch.chunk(world // pp)[parallel.dp_rank]     # this replica's micro-batches, accumulated
            loss, _, norm = _step(engine, parallel, [(s[None, :-1], s[None, 1:]) for s in mine], True,
                                  cfg.optim.grad_clip)
            t = torch.tensor(loss)
            dist.all_reduce(t)                                    # the last stages' sums
            losses.append(t.item() / 4)
            norms.append(norm)
        weights = {}
        for name, p in engine.module.named_parameters():
            w = p.detach()
            if getattr(p, 'ep_group', None) is not None:        # gather every rank's experts
                parts = [torch.empty_like(w) for _ in range(dist.get_world_size(p.ep_group))]
                dist.all_gather(parts, w.contiguous(), group=p.ep_group)
                w = torch.cat(parts)
            weights[name] = w.clone()
        stages = [None] * world
        dist.all_gather_object(stages, weights)                   # every stage's part of the model
        if rank == 0:
            whole = {k: v for part in stages for k, v in part.items()}
            torch.save({'losses': losses, 'norms': norms, 'weights': whole}, f'{out}/{world}x{pp}.pt')
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ep2_trains_like_one_process(tmp_path, request):
    """gptkit's training step on EP 2 (2 gloo processes) and, with --nb-flags slow (4 processes, about 40 s each here),
    EP 2 inside DP 4 (expert gradients averaged over their expert data-parallel group) and EP 2 x PP 2: ZeRO 0, fp32,
    every step clipped; the one-process losses, gradient norms and trained weights"""
    slow = 'slow' in request.config.getoption('--nb-flags').split()
    layouts = ((2, 1), (4, 1), (4, 2)) if slow else ((2, 1),)
    for world, pp in ((1, 1), *layouts):
        _spawn(_train_worker, world, tmp_path, free_port(), min(world // pp, 2), pp)
    one = torch.load(tmp_path / '1x1.pt')
    assert min(one['norms']) > 0.05                               # every step clipped
    for world, pp in layouts:
        got = torch.load(tmp_path / f'{world}x{pp}.pt')
        assert got['losses'] == pytest.approx(one['losses'], rel=1e-5, abs=0), (world, pp)
        assert got['norms'] == pytest.approx(one['norms'], rel=1e-5, abs=0), (world, pp)
        assert one['weights'].keys() == got['weights'].keys()
        for name, w in one['weights'].items():
            assert (got['weights'][name] - w).abs().max().item() < 1e-5, (world, pp, name)


def test_ep_with_tensor_parallelism_passes_the_engine_check():
    "EP composes with TP and SP in gptkit's engine (tests/test_ep_tp.py trains EP 2 x TP 2 like one process)"
    par = ParallelConfig(tp=2, dp=2, ep=2, sequence_parallel=True)
    assert ep_engine_problems(par, TrainConfig(precision='fp32')) == []
    run = from_dict({'model': MOE, 'parallel': {'ep': 2, 'tp': 2}, 'train': {'precision': 'fp32'}})
    assert run.for_world(4).parallel.dp == 2


def _ep_engine(ep: int, world: int, seed: int):
    "gptkit's engine for the tiny MoE of TRAIN_SETS on `world` processes with expert parallelism `ep`"
    cfg = resolve('moe-tiny', sets=TRAIN_SETS + [f'parallel.ep={ep}', 'train.iters=4'])
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=world))
    torch.manual_seed(seed)
    parallel = ParallelState.build(cfg.layout)
    model = parallelize(GPT(cfg.model), parallel, 'none', cfg.train.seed)
    shapes = ckpt.model_shapes(GPT(cfg.model))
    engine, ds = build_engine(cfg, model)
    return cfg, parallel, engine, ds, shapes


def _steps(engine, parallel, data, world):
    "The losses of one step per batch of `data`, this rank's share of each"
    out = []
    for batch in data:
        mine = batch.chunk(world)[parallel.dp_rank]
        loss, _, _ = _step(engine, parallel, [(s[None, :-1], s[None, 1:]) for s in mine], True, 0.05)
        out.append(loss)
    return out


def _resume_worker(rank, world, init_file, out, port, ep):
    """Uninterrupted: 4 steps, a checkpoint after the second. Resumed: an engine seeded otherwise loads it and runs the
    last 2. Then its `gptkit checkpoint reshard` (weights only) loads on the same layout. Each rank's losses and
    (gathered) weights of each, and the weights at the checkpoint"""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed()
    try:
        torch.manual_seed(1)
        data = torch.randint(0, 64, (4, 4, 17))
        cfg, parallel, engine, ds, shapes = _ep_engine(ep, world, 0)
        first = _steps(engine, parallel, data[:2], world)
        saved = whole(engine.module)
        engine.module.eval()
        with torch.no_grad():
            logits = engine.module(data[0, :, :-1])              # the EP model's, every rank on the same tokens
        engine.module.train()
        folder = ckpt.save(engine, f'{out}/ckpt', 2, client={'iteration': 2, 'consumed_samples': 8}, cfg=cfg,
                           ds_config=ds, tokenizer_dir=None, rank=rank, layout=parallel.layout, shapes=shapes)
        rest = _steps(engine, parallel, data[2:], world)
        full = whole(engine.module)
        cfg, parallel, engine, ds, shapes = _ep_engine(ep, world, 5)
        state = ckpt.load(engine, folder, rank, layout=parallel.layout, shapes=shapes, parallel=parallel)
        loaded = whole(engine.module)
        again = _steps(engine, parallel, data[2:], world)
        after = whole(engine.module)
        if rank == 0:                                    # `gptkit checkpoint reshard`: its weights only, one process
            reshard(folder, f'{out}/resharded')
        dist.barrier()
        cfg, parallel, engine, ds, shapes = _ep_engine(ep, world, 7)
        ckpt.load(engine, f'{out}/resharded/checkpoints/iter_0000002', rank, layout=parallel.layout, shapes=shapes,
                  parallel=parallel)
        torch.save({'losses': first + rest, 'resumed': first + again, 'saved': saved, 'loaded': loaded,
                    'full': full, 'after': after, 'iteration': state['iteration'],
                    'resharded': whole(engine.module), 'logits': logits}, f'{out}/{rank}.pt')
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_worker(rank, world, init_file, out, port, folder):
    "The EP 2 checkpoint resumed on one process (EP 1): its weights, and the loss of the next step's batch"
    os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed()
    try:
        torch.manual_seed(1)
        data = torch.randint(0, 64, (4, 4, 17))
        cfg, parallel, engine, ds, shapes = _ep_engine(1, 1, 5)
        state = ckpt.load(engine, folder, 0, layout=parallel.layout, shapes=shapes, parallel=parallel)
        loaded = whole(engine.module)
        losses = _steps(engine, parallel, data[2:3], 1)
        torch.save({'loaded': loaded, 'losses': losses, 'iteration': state['iteration']}, f'{out}/0.pt')
    finally:
        dist.destroy_process_group()


def whole(module):
    "Every parameter of `module` as one process holds it (experts gathered over their group)"
    return {k: v.clone() for k, v in {**dict(module.named_parameters()), **whole_experts(module)}.items()}


@pytest.mark.parametrize('world', [2, 4])
def test_an_ep2_checkpoint_holds_every_expert_and_resumes_bit_for_bit(tmp_path, world, request):
    """Saved on EP 2 (2 gloo processes; with --nb-flags slow also EP 2 inside DP 4): the model file holds all 4 experts
    in the one-process layout (load_model reads it as any checkpoint, with the EP model's logits), state.json the
    one-process shapes; resumed on the same layout the losses and weights are bitwise the uninterrupted run's; resumed
    on one process (EP 1) the weights are the saved ones (the optimizer starts fresh) and the next step's loss the
    run's; its `gptkit checkpoint reshard` (weights only) loads on EP 2 with the saved weights"""
    if world == 4 and 'slow' not in request.config.getoption('--nb-flags').split():
        pytest.skip('slow: run with --nb-flags slow')
    found = _spawn(_resume_worker, world, tmp_path, free_port(), 2)
    for got in found:
        assert got['iteration'] == 2
        assert got['resumed'] == got['losses']                           # bit for bit
        assert all(torch.equal(got['loaded'][k], w) for k, w in got['saved'].items())
        assert all(torch.equal(got['after'][k], w) for k, w in got['full'].items())
        assert all(torch.equal(got['resharded'][k], w) for k, w in got['saved'].items())   # weights-only, EP 2
    saved, fc1 = found[0]['saved'], [k for k in found[0]['saved'] if k.endswith('experts.fc1.weight')]
    assert fc1 and all(saved[k].shape[0] == 4 for k in fc1)
    loaded = ckpt.load_model(tmp_path / 'ckpt')
    plain = dict(loaded.model.named_parameters())
    assert plain.keys() == saved.keys()
    assert all(torch.equal(plain[k], w) for k, w in saved.items())
    torch.manual_seed(1)
    with torch.no_grad():                                         # what generation and evaluation run on
        logits = loaded.model(torch.randint(0, 64, (4, 4, 17))[0, :, :-1])
    assert (logits - found[0]['logits']).abs().max().item() < 1e-5
    assert loaded.state['ep'] == 2 and all(loaded.state['shapes'][k][0] == 4 for k in fc1)
    for f in tmp_path.glob('[0-9]*.pt'):
        f.unlink()
    one = _spawn(_one_worker, 1, tmp_path, free_port(), str(loaded.folder))[0]
    assert one['iteration'] == 2 and one['loaded'].keys() == saved.keys()
    assert all(torch.equal(one['loaded'][k], w) for k, w in saved.items())
    assert one['losses'][0] == pytest.approx(sum(f['losses'][2] for f in found), rel=1e-5)
