"""Tensor-parallel layers on real gloo process groups against the unsharded torch.nn.functional result."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from gptkit.parallel.groups import Layout, ParallelState
from gptkit.parallel.tensor import ColumnParallelLinear, RowParallelLinear, gather_from_tp


def _worker(rank, world, tp, init_file, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        ps = ParallelState.build(Layout.for_world(world, tp=tp))
        assert ps.layout.coords(rank) == (ps.tp_rank, ps.dp_rank, ps.pp_rank)
        torch.manual_seed(0)                                     # every rank builds the same full layers ...
        fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        torch.manual_seed(1 + ps.dp_rank)                        # ... and each DP replica its own data
        x = torch.randn(4, 5, 8)
        xr = x.clone().requires_grad_(True)                      # the plain MLP
        ref = fc2(F.gelu(fc1(xr)))
        (ref * torch.arange(8.0)).sum().backward()
        col, row = ColumnParallelLinear(fc1, ps.tp_group), RowParallelLinear(fc2, ps.tp_group)
        xs = x.clone().requires_grad_(True)
        y = row(F.gelu(col(xs)))
        (y * torch.arange(8.0)).sum().backward()
        r, p = ps.tp_rank, tp
        errs = {'out': (y - ref).abs().max().item(), 'dx': (xs.grad - xr.grad).abs().max().item(),
                'fc1.w': (col.weight.grad - fc1.weight.grad.chunk(p, 0)[r]).abs().max().item(),
                'fc1.b': (col.bias.grad - fc1.bias.grad.chunk(p, 0)[r]).abs().max().item(),
                'fc2.w': (row.weight.grad - fc2.weight.grad.chunk(p, 1)[r]).abs().max().item(),
                'fc2.b': (row.bias.grad - fc2.bias.grad).abs().max().item()}
        gathered = ColumnParallelLinear(fc1, ps.tp_group, gather=True)(x)
        errs['gather'] = (gathered - fc1(x)).abs().max().item()
        torch.save(errs, f'{out}/{rank}.pt')
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize('world,tp', [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow), (4, 2)])
def test_column_then_row_parallel_mlp_equals_the_plain_one(tmp_path, world, tp):
    env = {k: os.environ.pop(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ}
    try: mp.spawn(_worker, args=(world, tp, str(tmp_path / 'init'), str(tmp_path)), nprocs=world, join=True)
    finally: os.environ.update(env)
    for rank in range(world):
        errs = torch.load(tmp_path / f'{rank}.pt')
        assert max(errs.values()) < 1e-5, (rank, errs)     # fp32 sums in another order


def test_layout_errors():
    with pytest.raises(Exception, match='tp 3 x pp 1 = 3 must divide the 4 processes'): Layout.for_world(4, tp=3)
    with pytest.raises(Exception, match='does not match the 1 processes'): ParallelState.build(Layout(tp=2))


def _vocab_worker(rank, world, init_file, out):
    from gptkit.parallel.tensor import (VocabParallelEmbedding, gather_from_sequence, reduce_scatter_to_sequence,
                                        scatter_to_sequence, vocab_parallel_cross_entropy)
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        ps = ParallelState.build(Layout.for_world(world, tp=world))
        g = ps.tp_group
        torch.manual_seed(0)
        emb, ids = nn.Embedding(16, 6), torch.randint(0, 16, (3, 8))
        errs = {'embedding': (VocabParallelEmbedding(emb, g)(ids) - emb(ids)).abs().max().item()}
        z = torch.randn(3, 8, 16)
        target = torch.randint(0, 16, (3, 8))
        full = z.clone().requires_grad_(True)
        F.cross_entropy(full.view(-1, 16), target.view(-1)).backward()
        mine = z.chunk(world, -1)[ps.tp_rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(mine, target, g)
        loss.mean().backward()
        errs['ce'] = (loss - F.cross_entropy(z.view(-1, 16), target.view(-1), reduction='none').view(3, 8)).abs().max().item()
        errs['ce.grad'] = (mine.grad - full.grad.chunk(world, -1)[ps.tp_rank]).abs().max().item()
        # sequence parallel: LayerNorm on my part of the sequence, gather, then my rows of a column-parallel layer
        # -> the same output and the same gradient for my part of the sequence as the plain LayerNorm + linear
        h, w = torch.randn(2, 8, 6), torch.randn(8, 6)
        ln = nn.LayerNorm(6)
        whole = h.clone().requires_grad_(True)
        (F.linear(ln(whole), w) * torch.arange(8.0)).sum().backward()
        part = scatter_to_sequence(h.clone().requires_grad_(True), g)
        part.retain_grad()
        y = gather_from_sequence(ln(part), g)
        mine = F.linear(y, w.chunk(world, 0)[ps.tp_rank])
        (mine * torch.arange(8.0).chunk(world)[ps.tp_rank]).sum().backward()
        errs['sp.forward'] = (y - ln(h)).abs().max().item()
        errs['sp.grad'] = (part.grad - whole.grad.chunk(world, 1)[ps.tp_rank]).abs().max().item()
        summed = reduce_scatter_to_sequence(h * (ps.tp_rank + 1), g)
        errs['reduce_scatter'] = (summed - (h * sum(range(1, world + 1))).chunk(world, 1)[ps.tp_rank]).abs().max().item()
        torch.save(errs, f'{out}/{rank}.pt')
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize('world', [2, pytest.param(4, marks=pytest.mark.slow)])
def test_vocabulary_and_sequence_parallel_equal_the_plain_ops(tmp_path, world):
    env = {k: os.environ.pop(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ}
    try: mp.spawn(_vocab_worker, args=(world, str(tmp_path / 'init'), str(tmp_path)), nprocs=world, join=True)
    finally: os.environ.update(env)
    for rank in range(world):
        errs = torch.load(tmp_path / f'{rank}.pt')
        assert max(errs.values()) < 1e-5, (rank, errs)
