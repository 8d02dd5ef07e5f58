"""The GPT model against the estimator's parameter count, its references, its padded vocabulary and its KV cache."""
import copy
import math
import os

import pytest
import torch

from gptkit.config.sections import PRESETS, ModelConfig
from gptkit.errors import ConfigError
from gptkit.estimate.sizing import count_params
from gptkit.model.decoder import GPT, KVCache, core_attention, num_params, reference_attention


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


CACHE_CFG = ModelConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=100, dropout=0.0)


@pytest.mark.parametrize('chunks', [(8, 1, 1, 1, 1), (12,), (4, 5, 3), (1,) * 12])
def test_cached_steps_equal_the_full_forward(chunks):
    "A prompt in one piece or several, then single tokens: the logits of the whole sequence at once"
    torch.manual_seed(0)
    model = GPT(CACHE_CFG).eval()
    ids = torch.randint(0, 100, (3, 12))
    cache, got, at = KVCache.for_model(model, 3, 12), [], 0
    with torch.no_grad():
        for n in chunks:
            got.append(model(ids[:, at:at + n], cache=cache)); at += n
        torch.testing.assert_close(torch.cat(got, 1), model(ids), rtol=1e-5, atol=1e-5)
    assert cache.len == 12 and not cache.padded


def test_left_padded_rows_equal_each_row_alone():
    "Prompts of 7, 2, 5 and 1 tokens left-padded in one batch, 4 more tokens each, row 1 dropped after 2"
    torch.manual_seed(0)
    model = GPT(CACHE_CFG).eval()
    prompts = [torch.randint(0, 100, (n,)) for n in (7, 2, 5, 1)]
    more = torch.randint(0, 100, (4, 4))
    ids = torch.stack([torch.cat([torch.full((7 - len(p),), 99), p]) for p in prompts])   # 99: padding
    valid = torch.stack([torch.arange(7) >= 7 - len(p) for p in prompts])
    cache, rows = KVCache.for_model(model, 4, 11), [0, 1, 2, 3]
    got = {r: [] for r in rows}
    with torch.no_grad():
        out = model(ids, cache=cache, valid=valid, logits_to_keep=1)
        for step in range(4):
            for b, r in enumerate(rows): got[r].append(out[b, -1])
            if step == 2:
                rows = [0, 2, 3]; cache.select(torch.tensor(rows))
            out = model(more[rows, step:step + 1], cache=cache)
        for b, r in enumerate(rows): got[r].append(out[b, -1])
        for r, p in enumerate(prompts):
            alone = model(torch.cat([p, more[r]])[None])[0, len(p) - 1:]
            torch.testing.assert_close(torch.stack(got[r]), alone[:len(got[r])], rtol=1e-5, atol=1e-5)
    assert len(got[1]) == 3 and len(got[0]) == 5


def test_cache_refusals():
    model = GPT(CACHE_CFG).eval()
    ids = torch.randint(0, 100, (1, 17))
    with torch.no_grad():
        cache = KVCache.for_model(model, 1, 20)
        with pytest.raises(ValueError, match='17 tokens do not fit the model context of 16'): model(ids, cache=cache)
        assert cache.len == 0
        model(ids[:, :10], cache=cache)
        with pytest.raises(ValueError, match='17 tokens do not fit the model context of 16'):
            model(ids[:, :7], cache=cache)
        with pytest.raises(ValueError, match='5 positions do not fit the cache of 4'):
            model(ids[:, :5], cache=KVCache.for_model(model, 1, 4))
        with pytest.raises(ValueError, match='needs a KVCache'):
            model(ids[:, :4], valid=torch.ones(1, 4, dtype=torch.bool))


def _tp_cache_worker(rank, world, init_file):
    import torch.distributed as dist

    from gptkit.config.layout import Layout
    from gptkit.parallel.groups import ParallelState, apply_tp
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        ps = ParallelState.build(Layout.for_world(world, tp=world))
        torch.manual_seed(0)
        ref = GPT(CACHE_CFG).eval()
        model = apply_tp(copy.deepcopy(ref), ps).eval()
        ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
        valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
        cache = KVCache.for_model(model, 2, 10)
        assert cache.k[0].shape == (2, CACHE_CFG.heads // world, 10, CACHE_CFG.head_dim)   # this rank's heads
        with torch.no_grad():
            got = [model.hidden_states(ids[:, :6], cache, valid=valid)]
            got += [model.hidden_states(ids[:, i:i + 1], cache) for i in range(6, 10)]
            got = torch.cat(got, 1)
            torch.testing.assert_close(got[0], ref.hidden_states(ids[:1])[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1, 2:], ref.hidden_states(ids[1:, 2:])[0], rtol=1e-5, atol=1e-5)
            sp = apply_tp(copy.deepcopy(ref), ps, sequence_parallel=True).eval()
            with pytest.raises(ConfigError, match='parallel.sequence_parallel splits each sequence'):
                sp(ids, cache=KVCache.for_model(sp, 2, 10))
    finally:
        dist.destroy_process_group()


def test_cache_under_tensor_parallelism(tmp_path):
    "Each TP rank caches its heads and decodes the single-process hidden states; sequence parallelism is refused"
    import torch.multiprocessing as mp
    dist_env = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    env = {k: os.environ.pop(k) for k in dist_env if k in os.environ}
    try: mp.spawn(_tp_cache_worker, args=(2, str(tmp_path / 'init')), nprocs=2, join=True)
    finally: os.environ.update(env)
