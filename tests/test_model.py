"""The GPT model against the estimator's parameter count, its references, and its padded vocabulary."""
import math

import pytest
import torch

from gptkit.config import PRESETS, ModelConfig
from gptkit.estimate import count_params
from gptkit.model import GPT, core_attention, num_params, reference_attention


@pytest.mark.parametrize('name', list(PRESETS))
def test_estimator_counts_the_real_model(name):
    cfg = PRESETS[name].model
    with torch.device('meta'): model = GPT(cfg)
    assert num_params(model) == count_params(cfg).total
    assert model.wte.weight.shape[0] == count_params(cfg).vocab_padded


@pytest.mark.parametrize('shape', [(1, 1, 1, 4), (2, 3, 17, 8), (1, 2, 64, 32)])
def test_attention_matches_the_formula(shape):
    q, k, v = torch.randn(3, *shape, dtype=torch.float64)
    torch.testing.assert_close(core_attention(q, k, v), reference_attention(q, k, v), rtol=1e-10, atol=1e-10)


def test_padded_rows_are_never_predicted():
    cfg = ModelConfig(layers=1, hidden=32, heads=2, seq_len=16, vocab=300, dropout=0.0)
    model = GPT(cfg)
    assert model.wte.weight.shape[0] == 384
    ids = torch.randint(0, 300, (2, 17))
    logits = model(ids[:, :-1])
    assert logits.shape[-1] == 300
    model(ids[:, :-1], ids[:, 1:]).backward()
    assert model.wte.weight.grad[300:].abs().max() == 0     # padding rows get nothing, so can never drift into use


def test_causal_the_future_does_not_leak():
    model = GPT(ModelConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab=100, dropout=0.0)).eval()
    a = torch.randint(0, 100, (1, 16)); b = a.clone(); b[0, 10:] = (b[0, 10:] + 1) % 100
    torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])


@pytest.mark.parametrize('mode', ['selective', 'full'])
def test_recompute_gives_identical_gradients(mode):
    cfg = ModelConfig(layers=2, hidden=32, heads=2, seq_len=16, vocab=100, dropout=0.2)
    ids = torch.randint(0, 100, (2, 17))
    grads = []
    for m in ('none', mode):
        torch.manual_seed(0); model = GPT(cfg, recompute=m)
        torch.manual_seed(1); model(ids[:, :-1], ids[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_initial_loss_is_uniform_guess():
    torch.manual_seed(0)
    model = GPT(ModelConfig(layers=2, hidden=64, heads=4, seq_len=32, vocab=2000, dropout=0.0))
    ids = torch.randint(0, 2000, (4, 33))
    assert abs(model(ids[:, :-1], ids[:, 1:]).item() - math.log(2000)) < 0.05


def test_too_long_input_is_refused():
    model = GPT(ModelConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab=50, dropout=0.0))
    with pytest.raises(ValueError, match='9 tokens do not fit the model context of 8'):
        model(torch.zeros(1, 9, dtype=torch.long))
