"""The CPU output layer + loss whose gradients are made in forward (gptkit.kernels.fused.fused_cross_entropy, chapter 09),
against torch's own F.linear + F.cross_entropy, and GPT's training step with it against the plain path."""
import pytest
import torch
import torch.nn.functional as F

from gptkit.config.sections import ModelConfig
from gptkit.model.decoder import GPT, FusedCrossEntropy, fused_cross_entropy


def reference(x, W, t):
    return F.cross_entropy(F.linear(x, W).float(), t.reshape(-1), ignore_index=-100)


def grads(fn, x, W, scales=(3.0,)):
    "loss of the first micro-batch, dx, dW: each scale one backward accumulating into .grad, as gradient accumulation"
    x, W = x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    losses = [fn(x, W) for _ in scales]
    for loss, s in zip(losses, scales):
        (loss * s).backward()
    return losses[0].float(), x.grad.float(), W.grad.float()


def inputs(tokens=61, hidden=24, vocab=1000, dtype=torch.float32):
    torch.manual_seed(0)
    x, W = torch.randn(tokens, hidden), torch.randn(vocab, hidden) * 0.3
    t = torch.randint(0, vocab, (tokens,))
    t[[3, 17, tokens - 1]] = -100                      # ignored targets, one of them in the uneven last chunk
    return x.to(dtype), W.to(dtype), t


@pytest.mark.parametrize('chunk,scales', [(16, (3.0,)), (7, (0.5, 0.5)), (None, (0.25,)), (61, (1.0,))])
def test_fp32_loss_dx_dw_equal_torch(chunk, scales):
    x, W, t = inputs()
    got = grads(lambda x, W: fused_cross_entropy(x, W, t, chunk=chunk), x, W, scales)
    want = grads(lambda x, W: reference(x, W, t), x, W, scales)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert got[1][[3, 17, 60]].abs().max() == 0         # an ignored target's token gets no gradient


def test_shapes_of_a_batch_and_everything_ignored():
    x, W, t = inputs(tokens=48)
    got = grads(lambda x, W: fused_cross_entropy(x.view(2, 24, -1), W, t.view(2, 24), chunk=20), x, W)
    want = grads(lambda x, W: reference(x, W, t), x, W)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    none = torch.full_like(t, -100)     # a micro-batch with nothing to learn (fine-tuning): loss 0 and no gradient,
    assert reference(x, W, none).isnan()                  # where F.cross_entropy's mean is 0 / 0
    loss, dx, dW = grads(lambda x, W: fused_cross_entropy(x, W, none), x, W)
    assert loss.item() == 0 and not dx.any() and not dW.any()


def test_bf16_as_close_to_fp32_as_the_plain_bf16_path():
    x, W, t = inputs(tokens=300, hidden=64, dtype=torch.bfloat16)
    exact = grads(lambda x, W: reference(x, W, t), x.float(), W.float())
    plain = grads(lambda x, W: reference(x, W, t), x, W)
    fused = grads(lambda x, W: fused_cross_entropy(x, W, t, chunk=64), x, W)
    rel = lambda a: [((u - v).abs().max() / v.abs().max()).item() for u, v in zip(a, exact)]
    # measured: loss 1.2e-5, dx 5.7e-3, dW 4.8e-3 (the plain bf16 path: 1.2e-5, 5.5e-3, 4.8e-3)
    assert all(r < 1e-2 for r in rel(fused)), rel(fused)
    assert all(f <= 1.5 * p + 1e-6 for f, p in zip(rel(fused), rel(plain))), (rel(fused), rel(plain))


class IgnoresG(FusedCrossEntropy):
    "The control: a backward that hands back the forward's gradients as if the loss had not been scaled"
    @staticmethod
    def backward(ctx, g):
        dx, dw, n = ctx.saved_tensors
        return dx / n, (dw / n).to(ctx.dtype), None, None, None


def test_control_whose_backward_ignores_g_fails():
    x, W, t = inputs()
    want = grads(lambda x, W: reference(x, W, t), x, W, (3.0,))
    got = grads(lambda x, W: IgnoresG.apply(x, W, t, 16, -100), x, W, (3.0,))
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)        # the loss is right
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert (got[2] * 3 - want[2]).abs().max() < 1e-6                         # off by exactly the scale


def models(**extra):
    cfg = ModelConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab=300, dropout=0.0, **extra)
    out = {}
    for k in ('auto', 'torch'):
        torch.manual_seed(1)
        out[k] = GPT(ModelConfig(**{**cfg.to_dict(), 'kernels': k}))
    return out


@pytest.mark.parametrize('extra', [{}, {'norm': 'rmsnorm', 'position': 'rotary', 'tie_embeddings': False},
                                   {'moe_experts': 4, 'moe_top_k': 2, 'activation': 'swiglu', 'norm': 'rmsnorm',
                                    'position': 'rotary', 'tie_embeddings': False}])
def test_gpt_step_gradients_equal_the_plain_path(extra):
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (3, 17))
    targets = ids[:, 1:].clone()
    targets[0, 5] = -100                                                    # a padded position
    res = {}
    for k, m in models(**extra).items():
        assert m._fused_cpu_loss(m.hidden_states(ids[:, :-1])) == (k == 'auto')
        losses = [m(ids[:, :-1], targets), m(ids[:2, :-1], targets[:2])]
        for loss in losses:
            (loss * 0.5).backward()                                         # two accumulated micro-batches
        res[k] = (losses[0].item(), {n: p.grad for n, p in m.named_parameters()})
    assert abs(res['auto'][0] - res['torch'][0]) < 1e-5
    for n, g in res['torch'][1].items():
        torch.testing.assert_close(res['auto'][1][n], g, rtol=1e-5, atol=1e-5, msg=n)


def test_eval_and_no_grad_keep_the_plain_path():
    m = models()['auto']
    ids = torch.randint(0, 300, (2, 9))
    h = m.hidden_states(ids)
    assert m._fused_cpu_loss(h)
    with torch.no_grad():
        assert not m._fused_cpu_loss(m.hidden_states(ids))
        test = m(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(test, m(ids[:, :-1], ids[:, 1:]).detach(), rtol=1e-6, atol=1e-6)
    assert not m._fused_cpu_loss(h.detach())


def test_deepspeed_flops_profiler_counts_the_forward_product_in_the_head_only():
    "DeepSpeed's profiler counts a forward pass: the fused loss's gradient products must not be in it (gptkit profile)"
    from deepspeed.profiling.flops_profiler import FlopsProfiler
    cfg = ModelConfig(layers=1, hidden=32, heads=2, seq_len=16, vocab=300, dropout=0.0, tie_embeddings=False)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    counted = {}
    for kernels in ('auto', 'torch'):
        torch.manual_seed(0)
        model = GPT(ModelConfig(**{**cfg.__dict__, 'kernels': kernels})).train()
        prof = FlopsProfiler(model)
        prof.start_profile()
        model(x, y)
        prof.stop_profile()
        counted[kernels] = (prof.get_total_flops(), model.head.__flops__)
        prof.end_profile()
    assert counted['auto'] == counted['torch']
    assert counted['auto'][1] == 2 * 2 * 16 * 32 * 300      # the output layer's product, counted in its module
