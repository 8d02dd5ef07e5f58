"""gptkit.kernels.moe: the torch references against Megatron-Core's permute / unpermute and transformers' Mixtral
experts, the refusals, and the Triton kernels (forward and backward) against the references in Triton's interpreter.

The Triton tests (named test_triton_*) run in a fresh process with TRITON_INTERPRET=1 set from the start
(test_triton_kernels_in_the_interpreter), since in the main test process other libraries import Triton first,
without the interpreter; on a machine with a GPU they run here, on CUDA tensors."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptkit.kernels import fused as K, moe as M
from gptkit.errors import GptkitError

DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
RUNS_TRITON = K.triton is not None and (DEV == 'cuda' or K.interpreted())
triton_here = pytest.mark.skipif(not RUNS_TRITON, reason='the Triton kernels run in the interpreter process or on a GPU')
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def routed(tokens, k, experts, seed=0):
    "Random top-k expert indices, distinct per token, that never pick the last expert (it gets no token)"
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)]).to(DEV)


def compare(fn, ref, inputs, tol):
    "Max differences, relative above 1, of output and input gradients: fn in the inputs' dtype, ref in fp32"
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().float().requires_grad_() for t in inputs]
    ya, yb = fn(*a), ref(*b)
    g = torch.randn(yb.shape, generator=torch.Generator().manual_seed(3)).to(yb.device)
    ya.backward(g.to(ya.dtype))
    yb.backward(g)
    pairs = [(ya, yb)] + [(p.grad, q.grad) for p, q in zip(a, b)]
    errs = [(p.float() - q).abs().max().item() / max(1.0, q.abs().max().item()) for p, q in pairs]
    assert max(errs) < tol, errs
    return errs


def test_permute_reference_matches_megatron_core():
    "Same sorted rows, token order and counts as Megatron-Core's permute; unpermute as its probs-weighted unpermute"
    from megatron.core.transformer.moe.moe_utils import permute, unpermute
    tokens, k, experts = 11, 3, 7
    idx = routed(tokens, k, experts)
    torch.manual_seed(0)
    x, w = torch.randn(tokens, 16, device=DEV), torch.rand(tokens, k, device=DEV)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=DEV).scatter_(1, idx, True)
    probs = torch.zeros(tokens, experts, device=DEV).scatter_(1, idx, w)
    want, _, token_of_row = permute(x, routing_map)
    xs, order, counts = M.permute_reference(x, idx, experts)
    assert torch.equal(xs, want) and torch.equal(order // k, token_of_row)
    assert counts.tolist() == routing_map.sum(0).tolist() and counts[-1] == 0
    y = torch.randn(tokens * k, 16, device=DEV)                      # expert outputs, in the sorted layout
    back = unpermute(y, token_of_row, x.shape, probs=probs, routing_map=routing_map)
    assert torch.allclose(M.unpermute_reference(y, order, w, tokens), back, atol=1e-6)


def mixtral_experts(hidden=16, ffn=24, experts=4):
    "transformers' own MixtralExperts, random and tiny"
    from transformers import MixtralConfig, logging
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    logging.set_verbosity_error()                                    # the notice about standalone expert modules
    torch.manual_seed(0)
    hf = MixtralExperts(MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts)).to(DEV)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return hf


def expert_mlp(x, idx, weights, gate_up, down, triton):
    "Mixtral's experts on the sorted layout, weights as transformers stores them (gate_up [E, 2 ffn, h], down [E, h, ffn])"
    perm, unperm, gemm = ((M.permute, M.unpermute, M.grouped_gemm) if triton else
                          (M.permute_reference, M.unpermute_reference, M.grouped_gemm_reference))
    xs, order, counts = perm(x, idx, gate_up.shape[0])
    gate, up = gemm(xs, gate_up.transpose(1, 2), counts).chunk(2, dim=-1)
    return unperm(gemm(F.silu(gate) * up, down.transpose(1, 2), counts), order, weights, x.shape[0])


def check_against_mixtral(triton, tol):
    "Output and every gradient (tokens, router weights, both expert matrices) of expert_mlp against MixtralExperts"
    hf = mixtral_experts()
    x, idx = torch.randn(9, 16, device=DEV), routed(9, 2, 4)           # 3 experts used of 4: expert 3 gets nothing
    weights = torch.softmax(torch.randn(9, 2, device=DEV), -1)
    compare(lambda x, w, gu, d: expert_mlp(x, idx, w, gu, d, triton),
            lambda x, w, gu, d: torch.func.functional_call(hf, {'gate_up_proj': gu, 'down_proj': d}, (x, idx, w)),
            [x, weights, hf.gate_up_proj, hf.down_proj], tol)


def test_reference_expert_mlp_matches_transformers_mixtral():
    check_against_mixtral(False, 1e-5)


def test_bad_inputs_are_refused_in_one_sentence():
    x, idx = torch.randn(4, 8), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    for permute in (M.permute, M.permute_reference):                 # checked before any kernel runs
        with pytest.raises(GptkitError, match=r'expert_index holds expert 3, outside 0\.\.2'):
            permute(x, idx, 3)
        with pytest.raises(GptkitError, match=r'expert_index holds expert -1, outside 0\.\.3'):
            permute(x, idx - 1, 4)
        with pytest.raises(GptkitError, match='expert_index as int64, not torch.int32'):
            permute(x, idx.int(), 4)
        with pytest.raises(GptkitError, match=r'not \[4, 8\] and \[3, 2\]'):
            permute(x, idx[:3], 4)
    xs, order, counts = M.permute_reference(x, idx, 4)
    for unpermute in (M.unpermute, M.unpermute_reference):
        with pytest.raises(GptkitError, match=r'for T = 4 tokens, not \[8, 8\], \[8\] and \[4, 3\]'):
            unpermute(xs, order, torch.ones(4, 3), 4)
        with pytest.raises(GptkitError, match='unpermute takes'):
            unpermute(xs, order, torch.ones(2, 4), 4)
    for gemm in (M.grouped_gemm, M.grouped_gemm_reference):
        with pytest.raises(GptkitError, match='add up to the 8 rows of x_sorted, not to 12'):
            gemm(xs, torch.randn(4, 8, 5), counts + 1)
        with pytest.raises(GptkitError, match=r'not to 8 \(smallest -1\)'):
            gemm(xs, torch.randn(4, 8, 5), torch.tensor([3, -1, 4, 2]))
        with pytest.raises(GptkitError, match='in one dtype, not torch.float32 and torch.float64'):
            gemm(xs, torch.randn(4, 8, 5).double(), counts)
        with pytest.raises(GptkitError, match=r'not \[8, 8\], \[3, 8, 5\] and \[4\]'):
            gemm(xs, torch.randn(3, 8, 5), counts)


def test_gemm_tiles_cover_every_row_once():
    "The tile table built on the device: each expert's rows in tiles of bm, the padding programs empty"
    for counts in ([0, 0, 0, 5], [64, 1, 0, 200, 63, 0], [0], [128]):
        counts = torch.tensor(counts)
        rows = int(counts.sum())
        e, start, end = M.gemm_tiles(counts, rows, 64)
        assert e.numel() == -(-rows // 64) + len(counts)
        covered = torch.cat([torch.arange(s, min(s + 64, t)) for s, t in zip(start.tolist(), end.tolist()) if s < t]
                            + [torch.zeros(0, dtype=torch.long)])
        assert covered.tolist() == list(range(rows))                 # every row once, in order
        owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
        assert all((owner[s:min(s + 64, t)] == x).all() for x, s, t in zip(e.tolist(), start.tolist(), end.tolist()))


@triton_here
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('tokens, k, h', [(9, 1, 24), (7, 2, 40), (5, 4, 24), (3, 2, M.MOE_ROW_BLOCK + 8)])
def test_triton_permute_and_unpermute_match_the_references(tokens, k, h, dtype):
    idx = routed(tokens, k, 6)
    order, counts = M.routing(idx, 6)
    assert counts[-1] == 0
    torch.manual_seed(0)
    x, y, w = (torch.randn(tokens, h).to(DEV, dtype), torch.randn(tokens * k, h).to(DEV, dtype),
               torch.rand(tokens, k).to(DEV, dtype))
    errs = compare(lambda x: M.permute(x, idx, 6)[0], lambda x: M.permute_reference(x, idx, 6)[0], [x], TOL[dtype])
    assert errs[0] == 0                                               # a copy: exact
    assert torch.equal(M.permute(x, idx, 6)[1], order)
    compare(lambda y, w: M.unpermute(y, order, w, tokens), lambda y, w: M.unpermute_reference(y, order, w, tokens),
            [y, w], TOL[dtype])


@triton_here
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('counts, inner, outer, transposed', [([0, 70, 0, 5, 0], 40, 72, False),
                                                              ([1, 2, 3], 16, 16, True), ([0, 0, 130], 24, 8, False)])
def test_triton_grouped_gemm_matches_the_loop_over_experts(counts, inner, outer, transposed, dtype):
    "Segments of several tiles, empty experts first, in the middle and last, sizes apart from the tile, w transposed"
    counts = torch.tensor(counts, device=DEV)
    torch.manual_seed(0)
    x = torch.randn(int(counts.sum()), inner)
    w = torch.randn(len(counts), outer, inner).transpose(1, 2) if transposed else torch.randn(len(counts), inner, outer)
    compare(lambda x, w: M.grouped_gemm(x, w, counts), lambda x, w: M.grouped_gemm_reference(x, w, counts),
            [x.to(DEV, dtype), w.to(DEV, dtype)], TOL[dtype])


@triton_here
def test_triton_expert_mlp_matches_transformers_mixtral():
    check_against_mixtral(True, 1e-5)


@triton_here
def test_triton_empty_batch():
    "No tokens at all (a rank whose experts got nothing): empty outputs, zero weight gradients"
    x, idx = torch.zeros(0, 8, device=DEV, requires_grad=True), torch.zeros(0, 2, dtype=torch.long, device=DEV)
    w = torch.randn(3, 8, 5, device=DEV, requires_grad=True)
    xs, order, counts = M.permute(x, idx, 3)
    y = M.unpermute(M.grouped_gemm(xs, w, counts), order, torch.zeros(0, 2, device=DEV), 0)
    assert y.shape == (0, 5) and counts.tolist() == [0, 0, 0]
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and x.grad.shape == (0, 8)


@triton_here
@pytest.mark.parametrize('activation,bias', [('swiglu', False), ('gelu', True)])
def test_triton_moe_layer_matches_its_torch_path(activation, bias):
    "gptkit.model.moe's dropless layer with model.kernels='triton' gives the torch path's output and every gradient"
    import dataclasses

    from gptkit.config.sections import ModelConfig
    from gptkit.model.moe import MoE, moe_kernels
    cfg = ModelConfig(layers=1, hidden=16, heads=2, activation=activation, bias=bias, moe_experts=4, moe_top_k=2,
                      moe_ffn_hidden=8, kernels='triton')
    torch.manual_seed(0)
    fast = MoE(cfg).to(DEV)
    for p in fast.parameters():
        torch.nn.init.normal_(p, std=0.5)
    slow = MoE(dataclasses.replace(cfg, kernels='torch')).to(DEV)
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(2, 5, 16, device=DEV)
    assert moe_kernels(cfg.kernels, x) is M and moe_kernels('torch', x) is None      # the kernels run, against torch
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fast(xa), slow(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.allclose(ya, yb, atol=1e-5), (ya - yb).abs().max()
    assert torch.allclose(xa.grad, xb.grad, atol=1e-5), (xa.grad - xb.grad).abs().max()
    for (name, p), q in zip(fast.named_parameters(), slow.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), (name, (p.grad - q.grad).abs().max())


def test_triton_kernels_in_the_interpreter():
    "Runs the test_triton_* tests above in a fresh process with Triton's interpreter on from the start"
    if RUNS_TRITON or DEV == 'cuda':
        pytest.skip('the Triton tests run in this process')
    if K.triton is None:
        pytest.skip('Triton is not installed')
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'PYTHONUNBUFFERED': '1'}
    here = Path(__file__).resolve()
    r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-rs', '-p', 'no:cacheprovider', str(here), '-k',
                        'test_triton_ and not in_the_interpreter'], env=env, cwd=here.parents[1], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert ' passed' in r.stdout and 'skipped' not in r.stdout, r.stdout[-2000:]
