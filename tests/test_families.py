"""Qwen2.5, Qwen3 and Mistral checkpoints, as transformers itself builds and saves them: imported with their logits,
decoded through the KV cache with transformers' greedy tokens, exported back to the same family with the same logits"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gptkit.checkpoint import checkpointing as ck

from gptkit.interop import hf as interop
from gptkit.config.sections import ModelConfig
from gptkit.model.decoder import GPT, KVCache, reference_attention, window_mask
from gptkit.tokenizer.bpe import EOD, load_tokenizer

SIZES = dict(hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.2)
# each family's own choice: a QKV-only bias (and tied embeddings), per-head QK norm with 16-wide heads over a hidden
# size of 32 (not 32 / 4), a sliding window shorter than the test's sequences; and Qwen's YaRN long-context rotary
FAMILIES = {'qwen2': ('Qwen2Config', dict(tie_word_embeddings=True)),
            'qwen3': ('Qwen3Config', dict(head_dim=16, tie_word_embeddings=False)),
            'mistral': ('MistralConfig', dict(sliding_window=6, tie_word_embeddings=False)),
            'qwen2-yarn': ('Qwen2Config', dict(rope_parameters={'rope_type': 'yarn', 'rope_theta': 1e6, 'factor': 4.0,
                                                                'original_max_position_embeddings': 16}))}


def make_family(name: str, tok_dir: str, folder: Path):
    "A random model of family `name` with non-trivial norms and biases, saved by transformers with its tokenizer"
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    tok = load_tokenizer(tok_dir)
    config_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(vocab_size=tok.vocab_size, bos_token_id=tok.eod, eos_token_id=tok.eod,
                                              **SIZES, **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():            # unit norms and zero biases would hide a wrong mapping of them
        for n, p in model.named_parameters():
            if 'norm' in n or n.endswith('bias'):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / 'tokenizer.json'), bos_token=EOD, eos_token=EOD,
                            unk_token=EOD).save_pretrained(folder)
    return model


@pytest.fixture(scope='module', params=list(FAMILIES))
def family(request, tiny_data, tmp_path_factory):
    "(family name, transformers' model, its folder, the gptkit run imported from it)"
    d = tmp_path_factory.mktemp(request.param)
    hf = make_family(request.param, tiny_data[1], d / 'hf')
    return request.param, hf, d / 'hf', interop.import_hf(d / 'hf', d / 'run')


IDS = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))


def test_import_gives_transformers_logits(family):
    name, hf, _, run = family
    got = ck.load_model(run)
    m = got.config.model
    chosen = {'qwen2': m.attn_bias and not m.bias, 'qwen3': m.qk_norm and m.head_dim == 16,
              'mistral': m.sliding_window == 6, 'qwen2-yarn': m.rope_scaling == 'yarn'}
    assert chosen[name], m
    with torch.no_grad():
        want = hf(IDS).logits
        assert (got.model(IDS) - want).abs().max().item() <= 1e-4
        control = dataclasses.replace(m, qkv_bias=None, qk_norm=False, sliding_window=None, rope_scaling='none')
        plain = GPT(control).eval()                      # the control: without the family's choice, they differ
        plain.load_state_dict({k: v for k, v in got.model.state_dict().items() if k in plain.state_dict()},
                              strict=False)
        assert (plain(IDS) - want).abs().max().item() > 1e-3


def test_cached_greedy_decoding_gives_transformers_tokens(family):
    "The KV cache (with Mistral's window over more tokens than it holds) decodes transformers' greedy tokens"
    _, hf, _, run = family
    model = ck.load_model(run).model
    prompt = IDS[:1, :5]
    want = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    cache, x, got = KVCache.for_model(model, 1, 17), prompt, []
    with torch.no_grad():
        for _ in range(12):
            nxt = model(x, cache=cache, logits_to_keep=1)[:, -1:].argmax(-1)
            got.append(nxt.item())
            x = nxt
    assert got == want


def test_export_is_the_same_family_with_the_same_logits(family, tmp_path):
    from transformers import AutoModelForCausalLM
    name, hf, hf_dir, run = family
    out = interop.export_hf(run, tmp_path / 'export')
    assert json.loads((out / 'config.json').read_text())['model_type'] == hf.config.model_type
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert (back(IDS).logits - hf(IDS).logits).abs().max().item() <= 1e-4


def test_the_window_mask_is_the_plain_formula():
    q, k, v = torch.randn(3, 1, 2, 9, 4, dtype=torch.float64)
    mask = window_mask(9, 3)
    assert mask.sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3]
    scores = (q @ k.transpose(-1, -2) / 2).masked_fill(~mask, float('-inf'))
    assert torch.allclose(reference_attention(q, k, v, window=3), scores.softmax(-1) @ v)


@pytest.mark.parametrize('field,value,said', [
    ('head_size', 0, 'head_size must be a positive whole number'),
    ('sliding_window', -4, 'sliding_window must be a positive whole number'),
    ('qk_norm', 'yes', "qk_norm must be true or false, not 'yes'"),
    ('qkv_bias', 1, 'qkv_bias must be true or false, not 1'),
    ('rope_beta_fast', 0.5, 'rope_beta_fast 0.5 must be more than rope_beta_slow 1.0'),
    ('rope_attention_factor', float('nan'), 'rope_attention_factor must be a positive number, not nan'),
])
def test_a_bad_family_choice_is_refused_naming_it(field, value, said):
    from gptkit.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        ModelConfig(hidden=32, heads=4, position='rotary', rope_scaling='yarn', **{field: value})
    assert said in str(e.value) and '\n' not in str(e.value)


def _family_config(kind: str, **changes) -> dict:
    import transformers
    made = {'qwen2': transformers.Qwen2Config, 'qwen3': transformers.Qwen3Config, 'mistral': transformers.MistralConfig}
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return {**made[kind](**sizes).to_dict(), **changes}


YARN = {'rope_type': 'yarn', 'rope_theta': 1e6, 'factor': 2.0, 'original_max_position_embeddings': 16}


# each found by trying: a hostile or broken family config.json, refused in one sentence naming the key
@pytest.mark.parametrize('kind,changes,said', [
    ('qwen3', dict(head_dim=10**12), 'head_size must be at most 100,000'),
    ('qwen3', dict(head_dim='x'), "head_size must be a positive whole number, not 'x'"),
    ('mistral', dict(sliding_window=-1), 'sliding_window must be a positive whole number, not -1'),
    ('mistral', dict(sliding_window=4.5), 'sliding_window must be a positive whole number, not 4.5'),
    ('qwen2', dict(use_sliding_window='yes', sliding_window=8), "use_sliding_window must be true or false, not 'yes'"),
    ('qwen2', dict(use_sliding_window=True, sliding_window=8, layer_types=5), 'layer_types must be a list of names'),
    ('qwen2', dict(use_sliding_window=True, sliding_window=8, layer_types=None, max_window_layers='x'),
     "max_window_layers must be a whole number, not 'x'"),
    ('qwen2', dict(use_sliding_window=True, sliding_window=8, layer_types=['full_attention', 'sliding_attention']),
     'layer_types mixes sliding and full attention layers'),
    ('qwen3', dict(attention_bias='no'), "attention_bias must be true or false, not 'no'"),
    ('qwen3', dict(attention_bias=True), 'attention_bias = True is not supported for qwen3'),
    ('qwen2', dict(rope_parameters={**YARN, 'factor': 0}), 'rope_factor must be a positive number, not 0'),
    ('qwen2', dict(rope_parameters={**YARN, 'beta_fast': 'x'}), "rope_beta_fast must be a positive number, not 'x'"),
    ('qwen2', dict(rope_parameters={**YARN, 'attention_factor': float('nan')}),
     'rope_attention_factor must be a positive number, not nan'),
    ('qwen2', dict(rope_parameters={**YARN, 'mscale': 0.7}), 'mscale = 0.7 in rope_parameters is not supported'),
    ('qwen2', dict(rope_parameters={'rope_type': ['yarn'], 'rope_theta': 1e6}), "rope_type ['yarn']"),
    ('qwen2', dict(rope_parameters={'rope_type': 'default', 'rope_theta': 1e6, 'partial_rotary_factor': 0.5}),
     'partial_rotary_factor = 0.5 in rope_parameters is not supported'),
    ('qwen2', dict(num_key_value_heads=0), 'kv_heads must be a positive whole number, not 0'),
    ('qwen2', dict(model_type='qwen2_moe'), "model_type 'qwen2_moe' is not supported"),
])
def test_a_hostile_family_config_is_refused_naming_the_key(kind, changes, said):
    from gptkit.interop.hf_config import config_from_hf
    from gptkit.store.folders import CheckpointError
    with pytest.raises(CheckpointError) as e:
        config_from_hf(_family_config(kind, **changes))
    assert said in str(e.value) and str(e.value).startswith('config.json') and '\n' not in str(e.value)


def test_yarn_without_its_original_context_takes_max_position_embeddings_as_transformers_does():
    from gptkit.interop.hf_config import config_from_hf
    m = config_from_hf(_family_config('qwen2', max_position_embeddings=64,
                                      rope_parameters={'rope_type': 'yarn', 'rope_theta': 1e6, 'factor': 2.0}))
    assert (m.rope_scaling, m.rope_original_context) == ('yarn', 64)
