"""The MoE layer's inference and idle-expert shortcuts (issue 32, item 7) against transformers' own Mixtral block:
decode-sized batches without gradients (no losses or statistics), training with experts that get no tokens, and the
CPU decoding head's contiguous logits."""
import dataclasses

import pytest
import torch
import transformers as T

from gptkit.config.sections import LLAMA, ModelConfig
from gptkit.inference.decode import decode_layout
from gptkit.model.decoder import GPT
from gptkit.model.moe import MoE

CFG = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=96, tie_embeddings=False,
                  moe_experts=8, moe_top_k=2, moe_ffn_hidden=24, **LLAMA)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _pair(seed: int = 0):
    "gptkit's MoE layer and transformers' MixtralSparseMoeBlock holding the same random weights"
    torch.manual_seed(seed)
    ours = MoE(dataclasses.replace(CFG, moe_aux_loss_coef=0.0))
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    theirs = T.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(T.MixtralConfig(
        hidden_size=CFG.hidden, intermediate_size=CFG.expert_ffn, num_local_experts=CFG.moe_experts,
        num_experts_per_tok=CFG.moe_top_k))
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.fc1.weight)      # [E, 2f, h]: [gate; up] as gptkit's
        theirs.experts.down_proj.copy_(ours.experts.fc2.weight)
    return ours, theirs


@pytest.mark.parametrize('tokens', [1, 3, 8])
def test_decode_sized_batches_equal_transformers_and_keep_the_training_stats(tokens):
    ours, theirs = _pair()
    ours(torch.randn(1, 20, CFG.hidden))                                # a training forward sets the statistics
    stats = dict(ours.stats)
    ours.eval()
    x = torch.randn(1, tokens, CFG.hidden)
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ours.stats == stats          # inference computes no losses or statistics: the training step's stay


def test_idle_experts_get_zero_gradients_and_the_rest_transformers_gradients():
    ours, theirs = _pair(1)
    with torch.no_grad():               # every token to experts 2 and 5: the other six get no rows
        ours.router.weight.zero_()
        ours.router.weight[2, 0] = ours.router.weight[5, 0] = 1.0
        theirs.gate.weight.copy_(ours.router.weight)
    x = torch.randn(2, 6, CFG.hidden)
    x[..., 0] = x[..., 0].abs() + 1.0
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    assert ours.stats['load'].tolist() == [0, 0, 12, 0, 0, 12, 0, 0]
    pairs = [(ours.experts.fc1.weight, theirs.experts.gate_up_proj), (ours.experts.fc2.weight, theirs.experts.down_proj),
             (ours.router.weight, theirs.gate.weight)]
    for a, b in pairs:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    idle = [0, 1, 3, 4, 6, 7]
    assert ours.experts.fc1.weight.grad[idle].abs().max() == 0 and ours.experts.fc1.weight.grad[[2, 5]].abs().min() > 0


def test_no_rows_at_all_give_an_empty_output_still_in_the_graph():
    ours, _ = _pair()         # an expert-parallel rank that received no rows must still take part in the backward
    x = torch.zeros(0, CFG.hidden, requires_grad=True)
    empty = ours.experts.fc1(x, [0] * CFG.moe_experts)
    assert empty.shape == (0, 2 * CFG.expert_ffn)
    empty.sum().backward()
    assert x.grad.shape == (0, CFG.hidden) and ours.experts.fc1.weight.grad.abs().max() == 0


def test_the_cpu_decoding_head_gives_contiguous_logits_equal_to_the_models():
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    head = decode_layout(model).head
    for rows in (1, 3):
        h = torch.randn(rows, CFG.hidden)
        with torch.no_grad():
            y = head(h)
        assert y.is_contiguous()
        torch.testing.assert_close(y, model.logits(h), rtol=1e-5, atol=1e-5)
