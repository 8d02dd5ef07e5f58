"""Fused kernels: each gptkit Triton kernel (forward + backward) against its eager torch reference and torch.compile of
that reference, same process, same inputs, on a CUDA GPU.

Kernels: bias + GELU (exact and tanh) at the MLP's shape, LayerNorm at the model width, Qwen3's per-head QK-norm fused
with rotary (gptkit.kernels.qk: queries as the QKV split leaves them, 16 heads of 128) against ops.rms_norm then
ops.apply_rotary, and the chunked cross entropy (output layer + loss, vocabulary 50,304) against F.linear + fp32
F.cross_entropy, whose peak memory is printed too; and a mixture-of-experts MLP (gptkit.kernels.moe: permute, the
gate/up and down projections as grouped GEMMs, SwiGLU, unpermute; --experts experts of width --expert-ffn, top
--top-k) against the same steps on the torch references, whose grouped GEMM is a Python loop over experts.
Rounds alternate between the contenders so that machine noise hits all of them alike; the median time wins.
Without a GPU it says so and exits 0 (the kernels are checked on CPU by tests/test_kernels.py, in Triton's interpreter).
Run: .venv/bin/python benchmarks/kernels.py [--tokens 8192] [--hidden 768] [--vocab 50304] [--heads 16] [--head-dim 128]
     [--experts 8] [--top-k 2] [--expert-ffn 1024] [--dtype bf16] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, warmup: int = 2, steps: int = 5) -> float:
    "Median-friendly seconds per call of fn() (forward and backward), after warmup"
    for _ in range(warmup): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def fwd_bwd(op, *inputs):
    "A closure running op(*inputs) forward and backward, gradients dropped each time"
    def run():
        for t in inputs:
            if t.requires_grad: t.grad = None
        out = op(*inputs)
        out.backward(torch.ones_like(out) if out.dim() else None)
    return run


def moe_mlp(x, idx, weights, w_up, w_down, fns):
    "A SwiGLU expert MLP on the sorted layout: fns = (permute, unpermute, grouped_gemm), the kernels or references"
    permute, unpermute, gemm = fns
    xs, order, counts = permute(x, idx, w_up.shape[0])
    gate, up = gemm(xs, w_up, counts).chunk(2, dim=-1)
    return unpermute(gemm(F.silu(gate) * up, w_down, counts), order, weights, x.shape[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--tokens', type=int, default=8192, help='batch x sequence')
    ap.add_argument('--hidden', type=int, default=768)
    ap.add_argument('--vocab', type=int, default=50304)
    ap.add_argument('--heads', type=int, default=16, help='query heads of the QK-norm + rotary case (Qwen3-0.6B: 16)')
    ap.add_argument('--head-dim', type=int, default=128, help='head size of the QK-norm + rotary case (Qwen3: 128)')
    ap.add_argument('--experts', type=int, default=8, help='experts of the MoE case')
    ap.add_argument('--top-k', type=int, default=2, help='experts per token of the MoE case')
    ap.add_argument('--expert-ffn', type=int, default=1024, help='width of each expert of the MoE case')
    ap.add_argument('--dtype', default='bf16', choices=['bf16', 'fp16', 'fp32'])
    ap.add_argument('--rounds', type=int, default=7)
    a = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    if not torch.cuda.is_available():
        print('benchmarks/kernels.py times the Triton kernels on a GPU; there is no CUDA GPU here, so nothing was timed.')
        return
    from gptkit.kernels import fused as K, moe as M, qk as Q
    from gptkit.kernels.reference import rotary_tables
    if K.triton is None:
        print('benchmarks/kernels.py needs Triton: pip install -c constraints.txt triton')
        return
    dt = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}[a.dtype]
    dev, n, h, v = 'cuda', a.tokens, a.hidden, a.vocab
    g = lambda *shape, scale=1.0: (torch.randn(*shape, device=dev) * scale).to(dt).requires_grad_()
    torch.manual_seed(0)
    x4, b4 = g(n, 4 * h), g(4 * h)
    xh, w, b = g(n, h), g(h), g(h)
    xc, W = g(n, h), g(v, h, scale=0.02)
    t = torch.randint(0, v, (n,), device=dev)
    seq = min(n, 2048)
    xq, wq = g(n // seq, seq, a.heads, a.head_dim), g(a.head_dim)         # [b, s, heads, d]: as the QKV output holds it
    cos, sin = (c.to(dt) for c in rotary_tables(a.head_dim, torch.arange(seq, device=dev), 1000000.0))
    ce_ref = lambda x, W: K.cross_entropy_reference(x, W, t)
    xm, w_up, w_down = g(n, h), g(a.experts, h, 2 * a.expert_ffn, scale=0.02), g(a.experts, a.expert_ffn, h, scale=0.02)
    idx = torch.randn(n, a.experts, device=dev).topk(a.top_k, dim=-1).indices           # a random router's top-k
    gates = torch.softmax(torch.randn(n, a.top_k, device=dev), -1).to(dt)
    moe_fns = (M.permute, M.unpermute, M.grouped_gemm)
    moe_refs = (M.permute_reference, M.unpermute_reference, M.grouped_gemm_reference)
    cases = {
        'bias+gelu': (lambda x, b: K.bias_gelu(x, b), K.bias_gelu_reference, (x4, b4)),
        'bias+gelu tanh': (lambda x, b: K.bias_gelu(x, b, 'tanh'), lambda x, b: K.bias_gelu_reference(x, b, 'tanh'), (x4, b4)),
        'layernorm': (K.layer_norm, lambda x, w, b: F.layer_norm(x, (h,), w, b), (xh, w, b)),
        'qk-norm+rotary': (lambda x, w: Q.qk_norm_rotary(x.transpose(1, 2), w, 1e-6, cos, sin),
                           lambda x, w: Q.qk_norm_rotary_reference(x.transpose(1, 2), w, 1e-6, cos, sin), (xq, wq)),
        'chunked CE': (lambda x, W: K.chunked_cross_entropy(x, W, t, use_triton=True), ce_ref, (xc, W)),
        f'moe {a.experts}x top{a.top_k}': (lambda x, u, d: moe_mlp(x, idx, gates, u, d, moe_fns),
                                          lambda x, u, d: moe_mlp(x, idx, gates, u, d, moe_refs), (xm, w_up, w_down)),
    }
    print(f'{torch.cuda.get_device_name()}, {a.dtype}, {n} tokens, hidden {h}, vocabulary {v:,}; forward + backward, median of {a.rounds} rounds')
    print(f"{'kernel':<16}{'triton ms':>11}{'eager ms':>10}{'compile ms':>12}{'eager/triton':>14}{'compile/triton':>16}")
    for name, (fused, ref, inputs) in cases.items():
        runs = {'triton': fwd_bwd(fused, *inputs), 'eager': fwd_bwd(ref, *inputs), 'compile': fwd_bwd(torch.compile(ref), *inputs)}
        times = {k: [] for k in runs}
        for _ in range(a.rounds):
            for k, fn in runs.items(): times[k].append(timed(fn))
        ms = {k: statistics.median(s) * 1e3 for k, s in times.items()}
        print(f"{name:<16}{ms['triton']:>11.3f}{ms['eager']:>10.3f}{ms['compile']:>12.3f}"
              f"{ms['eager'] / ms['triton']:>13.2f}x{ms['compile'] / ms['triton']:>15.2f}x")
    peaks = {}
    for k, fn in (('triton', fwd_bwd(cases['chunked CE'][0], xc, W)), ('eager', fwd_bwd(ce_ref, xc, W))):
        fn(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        fn(); torch.cuda.synchronize(); peaks[k] = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"chunked CE peak memory above its inputs: {peaks['triton']:,.0f} MiB, eager {peaks['eager']:,.0f} MiB "
          f"({peaks['eager'] / max(peaks['triton'], 1e-9):.1f}x)")


if __name__ == '__main__':
    main()
