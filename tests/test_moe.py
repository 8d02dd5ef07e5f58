"""Mixture of experts: the layer and whole models against transformers' Mixtral, Qwen3-MoE and OLMoE, the losses'
gradients against a plain sum, the capacity's drops against a plain count, the presets' sizes, training, generation."""
import dataclasses
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from gptkit.config.sections import LLAMA, MOE_PRESETS, PRESETS, ModelConfig
from gptkit.errors import ConfigError
from gptkit.model.decoder import GPT, KVCache, num_params
from gptkit.model.moe import MoE, moe_layers, moe_stats, set_moe_grad_scale
from gptkit.config.params import param_table, stage_extras, stage_layers

SMALL = dict(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=96, tie_embeddings=False, **LLAMA)


def _families(cfg: ModelConfig):
    "transformers' config of each MoE family for gptkit's `cfg`, with the gptkit choices that family implies"
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv, max_position_embeddings=cfg.seq_len,
                  rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, rms_norm_eps=cfg.norm_eps,
                  num_experts_per_tok=cfg.moe_top_k)
    return {
        'mixtral': (T.MixtralForCausalLM, T.MixtralConfig(intermediate_size=cfg.expert_ffn,
                                                          num_local_experts=cfg.moe_experts, **common), {}),
        'qwen3_moe': (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            intermediate_size=cfg.ffn, moe_intermediate_size=cfg.expert_ffn, num_experts=cfg.moe_experts,
            head_dim=cfg.head_dim, norm_topk_prob=True, **common), dict(qk_norm=True)),
        'olmoe': (T.OlmoeForCausalLM, T.OlmoeConfig(intermediate_size=cfg.expert_ffn, num_experts=cfg.moe_experts,
                                                     norm_topk_prob=False, **common),
                  dict(qk_norm=True, qk_norm_all=True, moe_renormalize=False))}


def _moe_weights(ours: MoE, theirs) -> None:
    "Copy a transformers sparse MoE block's weights into gptkit's layer (the same layout: [gate; up] stacked)"
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.experts.fc1.weight.copy_(theirs.experts.gate_up_proj)
        ours.experts.fc2.weight.copy_(theirs.experts.down_proj)


def _gptkit_of(model, cfg: ModelConfig) -> GPT:
    "gptkit's GPT with the weights of transformers' `model` (fp32)"
    sd, ours = model.state_dict(), GPT(cfg).eval()
    with torch.no_grad():
        ours.wte.weight[:cfg.vocab].copy_(sd['model.embed_tokens.weight'])
        ours.head.weight[:cfg.vocab].copy_(sd['lm_head.weight'])
        ours.ln_f.weight.copy_(sd['model.norm.weight'])
        for i, block in ours.blocks.items():
            p = f'model.layers.{i}.'
            block.ln1.weight.copy_(sd[p + 'input_layernorm.weight'])
            block.ln2.weight.copy_(sd[p + 'post_attention_layernorm.weight'])
            block.attn.qkv.weight.copy_(torch.cat([sd[p + f'self_attn.{x}_proj.weight'] for x in 'qkv']))
            block.attn.proj.weight.copy_(sd[p + 'self_attn.o_proj.weight'])
            if block.attn.q_norm is not None:
                block.attn.q_norm.weight.copy_(sd[p + 'self_attn.q_norm.weight'])
                block.attn.k_norm.weight.copy_(sd[p + 'self_attn.k_norm.weight'])
            _moe_weights(block.mlp, model.model.layers[int(i)].mlp)
    return ours


@pytest.mark.parametrize('family', ['mixtral', 'qwen3_moe', 'olmoe'])
def test_layer_and_model_equal_transformers(family):
    base = ModelConfig(**SMALL, moe_experts=4, moe_top_k=2, moe_ffn_hidden=24)
    cls, hf_cfg, choices = _families(base)[family]
    cfg = dataclasses.replace(base, **choices)
    torch.manual_seed(0)
    theirs = cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if 'experts' in name or 'norm' in name:    # transformers leaves stacked experts empty, norms at one
                p.normal_(1.0 if 'norm' in name else 0.0, 0.2)
    ours = _gptkit_of(theirs, cfg)
    block = theirs.model.layers[0].mlp
    h = torch.randn(2, 7, cfg.hidden)
    torch.testing.assert_close(ours.blocks['0'].mlp(h), block(h), rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, cfg.vocab, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('name', [n for n in MOE_PRESETS if n != 'moe-tiny'])
def test_presets_have_the_published_sizes(name):
    cfg = PRESETS[name].model
    cls, hf_cfg, choices = _families(cfg)[{'mixtral-8x7b': 'mixtral', 'qwen3-30b-a3b': 'qwen3_moe',
                                           'olmoe-1b-7b': 'olmoe'}[name]]
    assert all(getattr(cfg, k) == v for k, v in choices.items())
    with torch.device('meta'):
        ours, theirs = GPT(cfg), cls(hf_cfg)
    assert num_params(ours) == sum(p.numel() for p in theirs.parameters())


def _plain_loss(model: GPT, cfg: ModelConfig, run):
    "`run()`'s loss from `model` (built without MoE losses) plus each MoE layer's coef x aux + zcoef x z, plainly"
    logits = []
    hooks = [m.router.register_forward_hook(lambda mod, args, out: logits.append(out[0])) for m in moe_layers(model)]
    loss = run()
    for h in hooks:
        h.remove()
    for lg in logits:
        probs = lg.float().softmax(-1)
        chosen = probs.topk(cfg.moe_top_k, -1).indices
        share = torch.bincount(chosen.reshape(-1), minlength=cfg.moe_experts) / chosen.numel()
        aux = cfg.moe_experts * (share * probs.mean(0)).sum()
        loss = loss + cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * lg.logsumexp(-1).square().mean()
    return loss


def _same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize('recompute', ['none', 'full'])
def test_loss_gradients_equal_the_plain_sum(recompute):
    cfg = ModelConfig(**SMALL, moe_experts=4, moe_top_k=2, moe_ffn_hidden=24, moe_shared_ffn=16,
                      moe_aux_loss_coef=0.3, moe_z_loss_coef=0.05)
    torch.manual_seed(0)
    model = GPT(cfg, recompute).train()
    plain = GPT(dataclasses.replace(cfg, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0), recompute).train()
    plain.load_state_dict(model.state_dict())
    xs, ys = zip(*[(ids[:, :-1], ids[:, 1:]) for ids in torch.randint(0, cfg.vocab, (2, 2, 13))])
    for n in (1, 2):        # one micro-batch; two, each loss / 2 as DeepSpeed accumulates: the MoE losses follow
        model.zero_grad()
        plain.zero_grad()
        for x, y in zip(xs[:n], ys[:n]):
            (model(x, y) / n).backward()
            (_plain_loss(plain, cfg, lambda: plain(x, y)) / n).backward()
        _same_grads(model, plain)
    plain.zero_grad()
    for x, y in zip(xs, ys):         # the control: cross entropy alone gives the router other gradients
        (plain(x, y) / 2).backward()
    router = 'blocks.0.mlp.router.weight'
    assert (model.get_parameter(router).grad - plain.get_parameter(router).grad).abs().max() > 1e-3
    g = torch.randn(2, 12, cfg.hidden)   # a pipeline stage before the last: no loss here, the loop sets the scale
    set_moe_grad_scale(model, 0.5)
    model.zero_grad()
    plain.zero_grad()
    (model.hidden_states(xs[0]) * g).sum().mul(0.5).backward()
    _plain_loss(plain, cfg, lambda: (plain.hidden_states(xs[0]) * g).sum()).mul(0.5).backward()
    _same_grads(model, plain)


@pytest.mark.parametrize('choices', [{}, dict(activation='gelu', bias=True, moe_shared_ffn=8)])
def test_capacity_drops_what_a_plain_count_drops(choices):
    cfg = ModelConfig(**SMALL | choices, moe_experts=4, moe_top_k=2, moe_ffn_hidden=24, moe_capacity_factor=0.75)
    torch.manual_seed(1)
    layer = MoE(cfg, GPT(cfg).blocks['0'].mlp.shared)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 10, cfg.hidden)
    out = layer(x)
    flat, fc1, fc2 = x.reshape(-1, cfg.hidden), layer.experts.fc1, layer.experts.fc2
    probs = F.linear(flat, layer.router.weight).softmax(-1)
    w, chosen = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    cap, seen, dropped = math.ceil(0.75 * 2 * 30 / 4), [0] * 4, 0
    want = torch.zeros_like(flat) if layer.shared is None else layer.shared(flat)
    for t in range(30):                                         # tokens in position order, each of its k choices
        for j in range(2):
            e = int(chosen[t, j])
            seen[e] += 1
            if seen[e] > cap:
                dropped += 1
                continue
            hid = F.linear(flat[t], fc1.weight[e], None if fc1.bias is None else fc1.bias[e])
            act = F.silu(hid.chunk(2)[0]) * hid.chunk(2)[1] if cfg.gated else F.gelu(hid)
            want[t] += w[t, j] * F.linear(act, fc2.weight[e], None if fc2.bias is None else fc2.bias[e])
    assert dropped > 0
    assert moe_stats(layer)['moe_dropped'] == pytest.approx(dropped / 60, abs=1e-7)
    torch.testing.assert_close(out.reshape(-1, cfg.hidden), want, rtol=1e-5, atol=1e-5)
    assert layer.stats['load'].tolist() == seen
    assert moe_stats(layer)['moe_load_max'] == pytest.approx(max(seen) * 4 / 60)
    assert moe_stats(GPT(ModelConfig(**SMALL))) == {}


def test_generation_with_the_cache_equals_the_full_pass():
    cfg = dataclasses.replace(PRESETS['moe-tiny'].model, vocab=96, layers=2, seq_len=32, moe_every=2)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    assert [type(b.mlp).__name__ for b in model.blocks.values()] == ['MLP', 'MoE']
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, 2, 12)
        steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_bad_choices_are_refused_naming_the_key():
    assert GPT(PRESETS['moe-tiny'].model, tp=2).wte.num_embeddings == 50432    # MoE layers run whole under TP
    with pytest.raises(ConfigError, match=r'parallel.tp 2: tensor parallelism does not split QK norms across all '
                                          r'heads \(qk_norm_all\)'):
        GPT(ModelConfig(**SMALL, qk_norm=True, qk_norm_all=True), tp=2)
    with pytest.raises(ConfigError, match='qk_norm_all chooses how qk_norm normalizes: it needs qk_norm true'):
        ModelConfig(**SMALL, qk_norm_all=True)
    with pytest.raises(ConfigError, match='qk_norm_all must be true or false'):
        ModelConfig(**SMALL, qk_norm=True, qk_norm_all='yes')


def test_a_tiny_moe_trains_through_gptkit_train(tiny_data, tmp_path):
    from conftest import TINY_SETS

    from gptkit.config.run import resolve
    from gptkit.train.loop import train
    prefix, tok = tiny_data
    sets = TINY_SETS + ['model.moe_experts=4', 'model.moe_top_k=2', 'model.moe_ffn_hidden=48', 'train.iters=8']
    cfg = resolve(sets=sets, overrides={'data': {'prefix': prefix, 'tokenizer': tok}}, out=str(tmp_path / 'run'))
    result = train(cfg)
    model = result.engine.module
    assert [type(b.mlp).__name__ for b in model.blocks.values()] == ['MoE', 'MoE']
    assert result.losses[-1] < result.losses[0] - 0.15, result.losses     # measured: 6.24 -> 5.98
    stats = moe_stats(model)
    assert set(stats) == {'moe_aux_loss', 'moe_z_loss', 'moe_dropped', 'moe_load_max'} and stats['moe_dropped'] == 0
    # DeepSpeed divided each micro-batch's loss by the 2 accumulation steps: the MoE losses' gradient was halved too
    assert [float(m.grad_scale) for m in moe_layers(model)] == [0.5, 0.5]
    # each report logs the MoE losses and every expert's load (metrics.jsonl, TensorBoard)
    rows = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    train_rows = [r for r in rows if r['kind'] == 'train']
    assert train_rows and all(r['moe_aux_loss'] > 0 and r['moe_dropped'] == 0 for r in train_rows)
    assert all(len(r['moe_load']) == 4 and abs(sum(r['moe_load']) - 4) < 1e-4 for r in train_rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / 'run' / 'tensorboard'))
    events.Reload()
    tags = events.Tags()['scalars']
    assert {'train/moe_aux_loss', 'train/moe_load_max', 'moe_load/expert_3'} <= set(tags), tags


def test_stages_balanced_by_parameters_weigh_moe_and_dense_layers_apart():
    cfg = ModelConfig(**SMALL | dict(layers=6), moe_experts=8, moe_ffn_hidden=64, moe_every=3)
    per_layer = [sum(p.numel for p in param_table(cfg) if p.layer == i) for i in range(cfg.layers)]
    assert per_layer[2] > 3 * per_layer[0]
    for pp in (2, 3):
        extra = [sum(p.numel for p in ps) for ps in stage_extras(cfg, pp)]
        def largest(stages):
            return max(extra[s] + sum(per_layer[lo:hi]) for s, (lo, hi) in enumerate(stages))
        cuts = itertools.combinations(range(1, cfg.layers), pp - 1)
        best = min(largest(list(zip((0, *c), (*c, cfg.layers)))) for c in cuts)
        assert largest(stage_layers(cfg, pp, 'parameters')) == best


def test_losses_equal_megatron_cores():
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    from gptkit.model.moe import load_balancing_loss, z_loss
    torch.manual_seed(0)
    logits = torch.randn(20, 6, dtype=torch.float64, requires_grad=True)
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=6)
    ours = 0.01 * load_balancing_loss(probs, counts, 2) + 0.1 * z_loss(logits)
    theirs = switch_load_balancing_loss_func(probs, counts, 20, 2, 6, 0.01) + z_loss_func(logits, 0.1)
    torch.testing.assert_close(ours.double(), theirs)
    ours_grad, = torch.autograd.grad(ours, logits, retain_graph=True)
    theirs_grad, = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(ours_grad, theirs_grad)


def test_resuming_with_another_expert_count_names_the_key():
    from gptkit.train.plan import model_changes
    tiny = PRESETS['moe-tiny'].model
    assert model_changes(tiny, dataclasses.replace(tiny, moe_experts=4)) == ['moe_experts']
    assert model_changes(tiny, dataclasses.replace(tiny, moe_top_k=1, moe_every=2)) == ['moe_top_k', 'moe_every']
