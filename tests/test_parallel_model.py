"""The GPT under TP, TP + SP, PP, TP x PP and DP x TP on real gloo process groups: losses and gradients equal the single-process model's."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptkit.config.sections import LLAMA, ModelConfig
from gptkit.estimate.sizing import count_params
from gptkit.model.decoder import GPT
from gptkit.parallel.groups import (Layout, ParallelState, apply_tp, merge_weights, one_f_one_b, pipeline_stage, shard_weights,
                             stage_input_shape, sync_tied_grads)

CFG = ModelConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=200, dropout=0.0)
# the Llama family: rotary, RMSNorm, SwiGLU, 2 KV heads for 4 query heads (split at tp 2, replicated at tp 4), untied
LLAMA_CFG = ModelConfig(layers=4, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=200, tie_embeddings=False, **LLAMA)
CFGS = {'gpt': CFG, 'llama': LLAMA_CFG}
DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')


def spawn(fn, world, *args):
    env = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
    try: mp.spawn(fn, args=(world, *args), nprocs=world, join=True)
    finally: os.environ.update(env)


def grads_then_sgd(model, ref, cfg, ps, errs):
    "This rank's gradients against its shard of the one-process model's (into errs['grad']); the same SGD step on both"
    grads = shard_weights({n: p.grad for n, p in ref.named_parameters()}, cfg, ps.layout, ps.tp_rank, ps.pp_rank)
    mine = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(grads) == sorted(mine), (sorted(grads), sorted(mine))
    errs['grad'] = max(errs['grad'], max((mine[n] - grads[n]).abs().max().item() for n in grads))
    with torch.no_grad():
        for m in (model, ref):
            for p in m.parameters():
                p -= 0.5 * p.grad
                p.grad = None


def _train_worker(rank, world, tp, pp, sp, micro, family, init_file, out):
    torch.set_num_threads(1)
    CFG = CFGS[family]
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        ps = ParallelState.build(Layout.for_world(world, tp=tp, pp=pp))
        dp = ps.layout.dp
        torch.manual_seed(0)
        plain = GPT(CFG)
        ref = copy.deepcopy(plain)                                  # the single-process model, on the whole batch
        model = pipeline_stage(apply_tp(plain, ps, sequence_parallel=sp), ps)
        held = sum(p.numel() for p in model.parameters())          # the estimator's count for this rank
        assert held == count_params(CFG, tp, pp).stages[ps.pp_rank].per_rank, held
        data = torch.randint(0, CFG.vocab, (3, 8, CFG.seq_len + 1), generator=torch.Generator().manual_seed(1))
        errs = {'loss': 0.0, 'grad': 0.0}
        for batch in data:
            mine = batch.chunk(dp)[ps.dp_rank].chunk(micro)         # this replica's share, as micro-batches
            losses = one_f_one_b(model, lambda loss, last: (loss / micro if last else loss).backward(),
                                 [(x[:, :-1], x[:, 1:]) for x in mine], parallel=ps,
                                 shape=stage_input_shape(CFG, len(mine[0]), tp, sp), dtype=torch.float32, device='cpu')
            sync_tied_grads(model, ps)
            for p in model.parameters():                            # what DeepSpeed does over the data-parallel group
                dist.all_reduce(p.grad, group=ps.dp_group); p.grad /= dp
            want = ref(batch[:, :-1], batch[:, 1:])
            want.backward()
            if ps.is_last_stage:
                got = torch.stack(losses).mean().reshape(1)
                dist.all_reduce(got, group=ps.dp_group)
                errs['loss'] = max(errs['loss'], abs(got.item() / dp - want.item()))
            grads_then_sgd(model, ref, CFG, ps, errs)
        # the trained shards, merged, are the trained single-process model
        shards = [None] * world
        dist.all_gather_object(shards,
                               ((ps.tp_rank, ps.pp_rank), {n: t.detach() for n, t in model.state_dict().items()}))
        merged = merge_weights(dict(shards), CFG, tp)
        errs['weights'] = max((merged[n] - t).abs().max().item() for n, t in ref.state_dict().items())
        torch.save(errs, f'{out}/{rank}.pt')
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize('world,tp,pp,sp,micro,family', [
    (2, 2, 1, False, 2, 'gpt'),      # TP 2
    (2, 2, 1, True, 2, 'gpt'),       # TP 2 + sequence parallel
    (2, 1, 2, False, 4, 'gpt'),      # PP 2, 4 micro-batches in 1F1B
    pytest.param(4, 2, 2, False, 2, 'gpt', marks=pytest.mark.slow),      # TP 2 x PP 2 (llama's below runs every time)
    pytest.param(4, 2, 1, True, 1, 'gpt', marks=pytest.mark.slow),       # DP 2 x TP 2 (+ SP)
    pytest.param(4, 1, 4, False, 4, 'gpt', marks=pytest.mark.slow),      # PP 4: middle stages
    (2, 2, 1, True, 2, 'llama'),     # TP 2 + SP: one KV head per rank, RMSNorm over a slice of the sequence
    pytest.param(4, 4, 1, False, 1, 'llama',
                 marks=pytest.mark.slow),    # TP 4: 2 KV heads, each replicated on 2 ranks (their gradients summed)
    (4, 2, 2, False, 2, 'llama'),    # TP 2 x PP 2: rotary on the second stage, the untied output layer on the last
])
def test_parallel_gpt_equals_the_single_process_model(tmp_path, world, tp, pp, sp, micro, family):
    spawn(_train_worker, world, tp, pp, sp, micro, family, str(tmp_path / 'init'), str(tmp_path))
    for rank in range(world):
        errs = torch.load(tmp_path / f'{rank}.pt')
        assert errs['loss'] < 1e-5 and errs['grad'] < 1e-5 and errs['weights'] < 1e-5, (rank, errs)


def _dropout_worker(rank, world, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        ps = ParallelState.build(Layout.for_world(world, tp=world))
        cfg = ModelConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=200, dropout=0.2)
        ids = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(3))
        res = {}
        for sp in (False, True):
            for recompute in ('none', 'selective', 'full'):
                torch.manual_seed(0)
                model = apply_tp(GPT(cfg, recompute=recompute), ps, sequence_parallel=sp, seed=7)
                loss = model(ids[:, :-1], ids[:, 1:])
                loss.backward()
                res[sp, recompute] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        errs = {}
        for sp in (False, True):     # recomputation replays the dropout masks it drew (tracker states included)
            for recompute in ('selective', 'full'):
                (l0, g0), (l1, g1) = res[sp, 'none'], res[sp, recompute]
                errs[f'{sp}-{recompute}'] = max([abs(l0 - l1).item()] + [(g0[n] - g1[n]).abs().max().item() for n in g0])
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses,
                        res[False, 'none'][0])          # replicated activations got the same masks on every TP rank
        errs['tp-ranks-agree'] = max(abs(l - losses[0]).item() for l in losses)
        errs['dropout-active'] = -abs(res[False, 'none'][0] - res[True, 'none'][0]).item()   # SP draws its own masks: a different loss
        torch.save(errs, f'{out}/{rank}.pt')
    finally:
        dist.destroy_process_group()


def test_dropout_is_shared_where_replicated_and_replayed_by_recomputation(tmp_path):
    spawn(_dropout_worker, 2, str(tmp_path / 'init'), str(tmp_path))
    for rank in range(2):
        errs = torch.load(tmp_path / f'{rank}.pt')
        assert errs.pop('dropout-active') < -1e-4, errs
        assert max(errs.values()) < 1e-6, (rank, errs)
