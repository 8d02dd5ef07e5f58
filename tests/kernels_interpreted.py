"""gptkit.kernels.fused: every Triton kernel, forward and backward, through Triton's interpreter on CPU tensors against its
torch reference; the chunked cross entropy in its torch form, vocabulary-parallel on 2 gloo processes, in the model,
and the `model.kernels` switch. CUDA-only checks are marked `gpu` (skipped without a GPU).

tests/test_kernels.py runs this file in a fresh process with TRITON_INTERPRET=1 set from the start: in the main test
process other libraries (megatron-core, DeepSpeed) import Triton first, without the interpreter."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

# Without a GPU the interpreter must be on when the kernels are defined (at import) and when they run: set it, import
# (or re-import) gptkit.kernels.fused, put the environment back, and set it again around each test here (fixture below).
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
_saved = os.environ.get('TRITON_INTERPRET')
if DEV == 'cpu': os.environ['TRITON_INTERPRET'] = '1'
try:
    import gptkit.kernels.fused as K
    import gptkit.kernels.qk as Q
    if DEV == 'cpu' and K.triton is not None and not K.interpreted():
        K, Q = importlib.reload(K), importlib.reload(Q)              # Q's kernels too, defined after K's
finally:
    if _saved is None: os.environ.pop('TRITON_INTERPRET', None)
    else: os.environ['TRITON_INTERPRET'] = _saved

from gptkit.config.sections import ModelConfig
from gptkit.errors import ConfigError
from gptkit.model.decoder import GPT

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if DEV == 'cpu': monkeypatch.setenv('TRITON_INTERPRET', '1')
needs_triton = pytest.mark.skipif(K.triton is None, reason='Triton is not installed')
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def compare(fn, ref, inputs, tol):
    "Max differences (relative to the largest value when above 1) of output and input gradients of fn (in the inputs' dtype) and ref (in fp32 on the same values)"
    a = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    b = [t.detach().float().requires_grad_(t.is_floating_point()) if t.is_floating_point() else t for t in inputs]
    ya, yb = fn(*a), ref(*b)
    g = (torch.randn(yb.shape, generator=torch.Generator().manual_seed(3)) if yb.dim() else torch.tensor(1.0)).to(yb.device)
    ya.backward(g.to(ya.dtype)); yb.backward(g)
    errs = [(ya.float() - yb).abs().max().item() / max(1.0, yb.abs().max().item())]   # relative to the largest value
    for p, q in zip(a, b):
        if p.grad is not None:
            scale = max(1.0, q.grad.abs().max().item())
            errs.append((p.grad.float() - q.grad).abs().max().item() / scale)
    assert max(errs) < tol, errs
    return errs


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('approximate', ['none', 'tanh'])
def test_bias_gelu_matches_torch(approximate, dtype):
    torch.manual_seed(0)
    x, b = (torch.randn(3, 5, 72) * 4).to(DEV, dtype), torch.randn(72).to(DEV, dtype)
    x[0, 0, :4] = torch.tensor([-30.0, 30.0, 0.0, -1e-3])            # the tails of tanh and erf, and zero
    compare(lambda x, b: K.bias_gelu(x, b, approximate), lambda x, b: K.bias_gelu_reference(x, b, approximate), [x, b], TOL[dtype])


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('shape', [(2, 9, 40), (37, 64)])
def test_layer_norm_matches_torch(shape, dtype):
    torch.manual_seed(0)
    n = shape[-1]
    x = (torch.randn(shape) * 3 + 2).to(DEV, dtype)
    w, b = torch.randn(n).to(DEV, dtype), torch.randn(n).to(DEV, dtype)
    compare(lambda x, w, b: K.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (n,), w, b), [x, w, b], TOL[dtype] * 2)


def _ce_inputs(tokens=40, hidden=16, rows=96, vocab=90, dtype=torch.float32):
    torch.manual_seed(0)
    x, w = torch.randn(tokens, hidden).to(DEV, dtype), (torch.randn(rows, hidden) * 0.5).to(DEV, dtype)
    t = torch.randint(0, vocab, (tokens,))
    t[[3, 17]] = -100                                                  # ignored tokens
    return x, w, t.to(DEV)


def _ce_reference(x, w, t, vocab):
    "F.cross_entropy on the real columns only (rows past `vocab` are padding)"
    return K.cross_entropy_reference(x, w[:vocab], t)


@pytest.mark.parametrize('chunk', [7, 16, 64])
def test_chunked_cross_entropy_torch_form(chunk):
    x, w, t = _ce_inputs()
    compare(lambda x, w: K.chunked_cross_entropy(x, w, t, real=90, chunk=chunk), lambda x, w: _ce_reference(x, w, t, 90), [x, w], 1e-5)


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_chunked_cross_entropy_triton_kernels(dtype, monkeypatch):
    monkeypatch.setattr(K, 'CE_BLOCK', 32)                            # several vocabulary blocks per row: the online lse
    x, w, t = _ce_inputs(dtype=dtype)
    compare(lambda x, w: K.chunked_cross_entropy(x, w, t, real=90, chunk=16, use_triton=True), lambda x, w: _ce_reference(x, w, t, 90),
            [x, w], TOL[dtype])


def test_chunk_size_follows_the_estimator():
    from gptkit.estimate.sizing import ce_chunk_tokens
    assert ce_chunk_tokens(8192, 50304) == 256 and ce_chunk_tokens(100, 50304) == 100 and ce_chunk_tokens(10**6, 10**7) == 16


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('shape', [(2, 9, 40), (37, 64)])
def test_rms_norm_matches_torch(shape, dtype):
    from gptkit.kernels.reference import rms_norm
    torch.manual_seed(0)
    x, w = (torch.randn(shape) * 3 + 2).to(DEV, dtype), torch.randn(shape[-1]).to(DEV, dtype)
    compare(lambda x, w: K.rms_norm(x, w), lambda x, w: rms_norm(x, w, 1e-5), [x, w], TOL[dtype] * 2)


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_swiglu_matches_torch(dtype):
    from gptkit.kernels.reference import swiglu
    torch.manual_seed(0)
    y = (torch.randn(3, 5, 2 * 72) * 4).to(DEV, dtype)
    y[0, 0, :3] = torch.tensor([-30.0, 30.0, 0.0])                     # sigmoid's tails, and zero
    compare(K.swiglu, swiglu, [y], TOL[dtype])


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('per_row', [False, True], ids=['shared', 'per-row'])
def test_rotary_matches_torch(per_row, dtype):
    from gptkit.kernels.reference import apply_rotary, rotary_tables
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 24).to(DEV, dtype).transpose(1, 2).contiguous().transpose(1, 2)   # strided, as after QKV
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 40]]).to(DEV)
    cos, sin = rotary_tables(24, pos if per_row else pos[0], 500000.0, dtype)
    if per_row: cos, sin = cos[:, None], sin[:, None]
    compare(lambda x: K.apply_rotary(x, cos, sin), lambda x: apply_rotary(x, cos.float(), sin.float()), [x], TOL[dtype])


def _heads(b, h, s, d, dtype, positions, scaling='none', **scale):
    "Queries as the QKV split leaves them ([b, s, h, d] memory seen as [b, h, s, d]), a norm weight, fp32 tables"
    from gptkit.kernels import reference as ops
    x = (torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(0)) * 2 + 0.3).to(DEV, dtype).transpose(1, 2)
    w = (torch.rand(d, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEV, dtype)
    cos, sin = ops.rotary_tables(d, positions.to(DEV), 1000000.0, frequencies=ops.rotary_frequencies(
        d, 1000000.0, scaling, **scale))
    factor = ops.rotary_scale(scaling, scale.get('factor', 1.0))      # YaRN's attention factor, in both tables
    cos, sin = cos * factor, sin * factor
    if positions.dim() > 1: cos, sin = cos[:, None], sin[:, None]
    return x, w, cos, sin


QK_CASES = {                                                          # (batch, heads, seq, head_dim, positions)
    'd128-2heads-t5': (2, 2, 5, 128, torch.arange(5)),                # Qwen3's head size, few heads, odd length
    'd128-per-row': (2, 2, 5, 128, torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])),   # [batch, 1, t, d] tables
    'd64-broadcast': (2, 3, 7, 64, torch.arange(7)[None] + 30),       # one [1, 1, t, d] table for the whole batch
    'd24-t9': (1, 3, 9, 24, torch.arange(9)),                         # half a head (12) masked in its block (16)
}


@needs_triton
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('case', list(QK_CASES))
def test_qk_norm_rotary_matches_torch(case, dtype):
    "The fused kernel against torch autograd through ops.rms_norm then ops.apply_rotary: output, dx and dweight"
    b, h, s, d, pos = QK_CASES[case]
    x, w, cos, sin = _heads(b, h, s, d, dtype, pos)
    assert not x.is_contiguous()
    compare(lambda x, w: Q.qk_norm_rotary(x, w, 1e-6, cos.to(dtype), sin.to(dtype)),
            lambda x, w: Q.qk_norm_rotary_reference(x, w, 1e-6, cos, sin), [x, w], TOL[dtype])


def _qk(eps, cos, sin):
    "The fused kernel and its reference at `eps` with these tables"
    return (lambda x, w: Q.qk_norm_rotary(x, w, eps, cos, sin),
            lambda x, w: Q.qk_norm_rotary_reference(x, w, eps, cos, sin))


@needs_triton
def test_qk_norm_rotary_strides_and_dtypes():
    "A last dimension with stride 2 (copied first), a contiguous input, an fp32 weight on bf16 heads, eps that matters"
    x, w, cos, sin = _heads(2, 2, 3, 32, torch.float32, torch.arange(3))
    wide = torch.randn(2, 2, 3, 64).to(DEV)
    for xs in (wide[..., ::2], x.contiguous()):
        compare(*_qk(1e-6, cos, sin), [xs, w], TOL[torch.float32])
    compare(*_qk(1e-5, cos, sin), [x * 1e-3, w], TOL[torch.float32])   # mean square 1e-6: eps 1e-5 changes r 3x
    y = Q.qk_norm_rotary(x.to(torch.bfloat16), w, 1e-6, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and (y.float() - Q.qk_norm_rotary_reference(x, w, 1e-6, cos, sin)).abs().max() < 5e-2


@needs_triton
def test_rotary_tables_that_do_not_fit_are_refused():
    "Both rotary kernels refuse, in one sentence, tables they would read past (not NaN or another row's angles)"
    x, w, cos, sin = _heads(2, 2, 5, 16, torch.float32, torch.arange(5))
    bad = {'short': (cos[:4], sin[:4]), 'narrow': (cos[:, :8], sin[:, :8]),
           'batch 3 of 2': (cos.expand(3, 1, 5, 16),) * 2, 'no head axis': (cos[None].expand(2, 5, 16),) * 2,
           'cos and sin differ': (cos, sin[:, :8])}
    for name, (c, s) in bad.items():
        for fn in (lambda: Q.qk_norm_rotary(x, w, 1e-6, c, s), lambda: K.apply_rotary(x, c, s)):
            with pytest.raises(K.GptkitError, match=r'do not fit queries or keys of shape \(2, 2, 5, 16\): they must'):
                fn()
    odd = torch.randn(1, 1, 5, 15)
    with pytest.raises(K.GptkitError, match='d even'): Q.qk_norm_rotary(odd, w[:15], 1e-6, cos[:, :15], sin[:, :15])
    one = (cos[None, None], sin[None, None])                          # [1, 1, t, d] over a batch of 2: read as shared
    from gptkit.kernels.reference import apply_rotary
    assert torch.allclose(K.apply_rotary(x, *one), apply_rotary(x, *one), atol=1e-6)


@needs_triton
@pytest.mark.parametrize('scaling', ['linear', 'llama3', 'yarn'])
def test_scaled_rotary_tables_through_both_kernels(scaling):
    "Scaled rotary lives in the tables: both rotary kernels match torch with them, past the original context"
    from gptkit.kernels.reference import apply_rotary, rotary_frequencies
    scale = dict(factor=4.0)
    if scaling == 'llama3': scale = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64)
    if scaling == 'yarn': scale = dict(factor=4.0, original_context=64, beta_fast=32.0, beta_slow=1.0)
    ratio = rotary_frequencies(32, 1000000.0, scaling, **scale) / rotary_frequencies(32, 1000000.0)
    assert (ratio < 0.99).any() and (scaling == 'linear' or ((ratio > 0.13) & (ratio < 0.99)).any())   # scaled, blended
    x, w, cos, sin = _heads(2, 2, 7, 32, torch.float32, torch.arange(7) + 60, scaling, **scale)
    length = (cos ** 2 + sin ** 2).sqrt()                                  # YaRN's tables: 0.1 ln 4 + 1 = 1.1386 long
    assert torch.allclose(length, torch.full_like(length, 1.1386 if scaling == 'yarn' else 1.0), atol=1e-4)
    compare(lambda x: K.apply_rotary(x, cos, sin), lambda x: apply_rotary(x, cos, sin), [x], TOL[torch.float32])
    compare(*_qk(1e-6, cos, sin), [x, w], TOL[torch.float32])


CFG = dict(layers=2, hidden=32, heads=2, seq_len=8, vocab=100, dropout=0.0)


LLAMA_CFG = dict(heads=4, kv_heads=2, position='rotary', norm='rmsnorm', bias=False, tie_embeddings=False)


def _run(kernels, activation='gelu', ids=None):
    torch.manual_seed(1)
    extra = LLAMA_CFG if activation == 'swiglu' else {}
    m = GPT(ModelConfig(**{**CFG, **extra}, activation=activation, kernels=kernels)).to(DEV)
    loss = m(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return m, loss, {n: p.grad for n, p in m.named_parameters()}


@needs_triton
@pytest.mark.parametrize('activation', ['gelu', 'gelu_tanh', 'swiglu'])      # swiglu: the Llama family's kernels
def test_model_with_triton_kernels_matches_torch(activation):
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEV)
    mt, lt, gt = _run('triton', activation, ids)
    mr, lr, gr = _run('torch', activation, ids)
    assert abs(lt.item() - lr.item()) < 1e-5
    assert sorted(gt) == sorted(gr)                                    # no new parameters: checkpoints are the same
    assert max((gt[n] - gr[n]).abs().max().item() for n in gr) < 1e-5
    with torch.no_grad(): assert torch.allclose(mt(ids[:, :-1]), mr(ids[:, :-1]), atol=1e-5)   # generation keeps the logits path


QWEN3_CFG = dict(LLAMA_CFG, activation='swiglu', head_size=12, qk_norm=True, norm_eps=1e-6, rope_scaling='yarn',
                 rope_factor=4.0, rope_original_context=4)


def _run_qwen3(kernels, ids):
    torch.manual_seed(1)
    m = GPT(ModelConfig(**{**CFG, **QWEN3_CFG}, kernels=kernels)).to(DEV)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(('q_norm.weight', 'k_norm.weight')): p.uniform_(0.5, 1.5)   # not the ones they start as
    loss = m(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return m, loss, {n: p.grad for n, p in m.named_parameters()}


@needs_triton
def test_qwen3_attention_runs_the_fused_qk_norm_kernel(monkeypatch):
    "QK norm, a head size apart from hidden / heads and YaRN under model.kernels='triton': the fused kernel, as torch"
    calls, fused = [], Q.qk_norm_rotary
    monkeypatch.setattr(Q, 'qk_norm_rotary', lambda *a: calls.append(tuple(a[0].shape)) or fused(*a))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEV)
    mt, lt, gt = _run_qwen3('triton', ids)
    assert calls == [(2, 4, 7, 12), (2, 2, 7, 12)] * 2                # q then k, in each of the 2 layers
    mr, lr, gr = _run_qwen3('torch', ids)
    assert len(calls) == 4 and abs(lt.item() - lr.item()) < 1e-5
    assert gr['blocks.0.attn.q_norm.weight'].abs().max() > 1e-3 and sorted(gt) == sorted(gr)
    assert max((gt[n] - gr[n]).abs().max().item() for n in gr) < 1e-5
    with torch.no_grad(): assert torch.allclose(mt(ids[:, :-1]), mr(ids[:, :-1]), atol=1e-5)


def test_switch():
    x = torch.zeros(1)
    assert not K.use_triton('auto', x) and not K.use_triton('torch', x)
    if K.interpreted(): assert K.use_triton('triton', x)
    elif K.triton is not None:
        with pytest.raises(K.GptkitError, match='only under TRITON_INTERPRET=1'): K.use_triton('triton', x)
    with pytest.raises(ConfigError, match="kernels must be one of auto, triton, torch, not 'cuda'"): ModelConfig(kernels='cuda')


def test_auto_on_cpu_imports_no_triton():
    code = ('import sys, torch; from gptkit.config.sections import ModelConfig; from gptkit.model.decoder import GPT\n'
            "m = GPT(ModelConfig(layers=1, hidden=16, heads=2, seq_len=8, vocab=50)); ids = torch.randint(0, 50, (1, 9))\n"
            'm(ids[:, :-1], ids[:, 1:]).backward()\n'
            "print([k for k in ('triton', 'gptkit.kernels.fused') if k in sys.modules])")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, 'TRITON_INTERPRET': '0'})
    assert r.returncode == 0 and r.stdout.strip() == '[]', r.stderr


def test_kernels_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"                # `import triton` now raises ImportError
            'import torch, gptkit.kernels.fused as K\n'
            'torch.manual_seed(0)\n'
            'x, w, t = torch.randn(10, 8), torch.randn(20, 8), torch.randint(0, 20, (10,))\n'
            'err = abs(K.chunked_cross_entropy(x, w, t, chunk=4) - K.cross_entropy_reference(x, w, t)).item()\n'
            'print(K.triton, K.use_triton("auto", x), err < 1e-5)\n'
            'try: K.use_triton("triton", x)\nexcept Exception as e: print(type(e).__name__, e)')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == 'None False True' and second.startswith('GptkitError') and 'needs Triton installed' in second


def test_estimator_logits_term_follows_the_switch():
    from gptkit.estimate.sizing import logits_bytes
    m = ModelConfig(layers=24, hidden=1024, heads=16, seq_len=1024)
    chunked = ModelConfig(layers=24, hidden=1024, heads=16, seq_len=1024, kernels='triton')
    assert logits_bytes(m, 8) == logits_bytes(ModelConfig(layers=24, hidden=1024, heads=16, seq_len=1024, kernels='torch'), 8)
    assert logits_bytes(chunked, 8) < logits_bytes(m, 8) / 5
    assert logits_bytes(chunked, 8, peak=False) < logits_bytes(m, 8, peak=False) / 10


def _tp_worker(rank, world, sp, init_file):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        from gptkit.parallel.groups import Layout, ParallelState, apply_tp, shard_weights
        cfg = dict(layers=1, hidden=32, heads=2, seq_len=8, vocab=200, dropout=0.0)    # padded to 256: 128 rows a rank, 72 real on rank 1
        ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
        ps = ParallelState.build(Layout.for_world(world, tp=world))
        for kernels in (['triton', 'torch'] if K.interpreted() else ['torch']):
            torch.manual_seed(0)
            ref = GPT(ModelConfig(**cfg, kernels='torch'))
            want = ref(ids[:, :-1], ids[:, 1:]); want.backward()
            torch.manual_seed(0)
            model = apply_tp(GPT(ModelConfig(**cfg, kernels=kernels)), ps, sequence_parallel=sp)
            if kernels == 'torch':                                     # the torch chunked form, through the same hook
                h = model.hidden_states(ids[:, :-1])
                got = model.head.chunked_loss(h, model.output_weight(), ids[:, 1:], use_triton=False)
            else: got = model(ids[:, :-1], ids[:, 1:])
            got.backward()
            assert abs(got.item() - want.item()) < 1e-5, (kernels, got.item(), want.item())
            grads = shard_weights({n: p.grad for n, p in ref.named_parameters()}, ModelConfig(**cfg), ps.layout, ps.tp_rank, 0)
            err = max((p.grad - grads[n]).abs().max().item() for n, p in model.named_parameters())
            assert err < 1e-5, (kernels, err)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize('sp', [False, True], ids=['tp2', 'tp2-sp'])
def test_vocab_parallel_chunked_cross_entropy(sp, tmp_path):
    from test_parallel_model import spawn
    spawn(_tp_worker, 2, sp, str(tmp_path / 'init'))


def test_benchmark_says_plainly_without_a_gpu():
    if torch.cuda.is_available(): pytest.skip('a GPU is here: the benchmark would run')
    r = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'kernels.py')], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and 'no CUDA GPU' in r.stdout, r.stdout + r.stderr


@gpu
@needs_triton
def test_kernels_on_cuda_at_training_shapes():
    "Compiled kernels (run this file in a process without TRITON_INTERPRET for this one) in bf16 against fp32 torch"
    if K.interpreted(): pytest.skip('the kernels here run in the interpreter; run the file alone on a GPU machine')
    torch.manual_seed(0)
    x, b = torch.randn(4, 512, 3072, device='cuda', dtype=torch.bfloat16), torch.randn(3072, device='cuda', dtype=torch.bfloat16)
    compare(K.bias_gelu, K.bias_gelu_reference, [x, b], 5e-2)
    x, w = torch.randn(4, 512, 768, device='cuda', dtype=torch.bfloat16), torch.randn(768, device='cuda', dtype=torch.bfloat16)
    compare(K.layer_norm, lambda x, w, b: F.layer_norm(x, (768,), w, b), [x, w, w * 0.1], 5e-2)
    x, W = torch.randn(2048, 768, device='cuda', dtype=torch.bfloat16), torch.randn(50304, 768, device='cuda', dtype=torch.bfloat16) * 0.02
    t = torch.randint(0, 50257, (2048,), device='cuda')
    compare(lambda x, W: K.chunked_cross_entropy(x, W, t, real=50257, use_triton=True), lambda x, W: _ce_reference(x, W, t, 50257), [x, W], 5e-2)
    x, w, cos, sin = _heads(4, 16, 2048, 128, torch.bfloat16, torch.arange(2048))   # Qwen3-0.6B's queries
    compare(lambda x, w: Q.qk_norm_rotary(x, w, 1e-6, cos.to(torch.bfloat16), sin.to(torch.bfloat16)),
            lambda x, w: Q.qk_norm_rotary_reference(x, w, 1e-6, cos, sin), [x, w], 5e-2)
