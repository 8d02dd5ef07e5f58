"""The Llama family against its peers' own code: Hugging Face LlamaForCausalLM (import and export, GQA, tied and untied)
and megatron-core's GPTModel (SwiGLU, RMSNorm, rotary, GQA) loading the Megatron export."""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ['HF_HUB_OFFLINE'] = '1'          # nothing here may reach the network

from test_checkpoint_tools import mcore, megatron_file  # noqa: F401  (the megatron-core fixture)

from gptkit.checkpoint import checkpointing as ck

from gptkit.interop import hf_config

from gptkit.interop import hf as interop

from gptkit.interop import megatron

from gptkit.store import folders as store
from gptkit.config.sections import LLAMA_PRESETS, ModelConfig
from gptkit.model.decoder import GPT
from gptkit.store.folders import CheckpointError
from gptkit.tokenizer.bpe import EOD, load_tokenizer
from gptkit.store.torch_files import read_torch_file


def make_llama(tok_dir: str, folder: Path, tie: bool, seed: int = 0, rope: dict | None = None):
    "A random LlamaForCausalLM (4 query heads, 2 KV heads, base 500000) with non-trivial norms, saved with its tokenizer"
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = load_tokenizer(tok_dir)
    torch.manual_seed(seed)
    rope = {'rope_parameters': {'rope_theta': 500000.0, **rope}} if rope else {'rope_theta': 500000.0}
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      tie_word_embeddings=tie, initializer_range=0.2, bos_token_id=tok.eod,
                      eos_token_id=tok.eod, **rope)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():            # unit norms would hide a wrong mapping of them
        for name, p in model.named_parameters():
            if 'norm' in name: p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / 'tokenizer.json'), bos_token=EOD, eos_token=EOD,
                            unk_token=EOD).save_pretrained(folder)
    return model


@pytest.fixture(scope='module', params=[False, True], ids=['untied', 'tied'])
def llama(request, tiny_data, tmp_path_factory):
    "(HF Llama, its folder, the gptkit run imported from it)"
    d = tmp_path_factory.mktemp('llama')
    model = make_llama(tiny_data[1], d / 'hf', request.param)
    return model, d / 'hf', interop.import_hf(d / 'hf', d / 'run')


def ids_for(vocab: int, batch: int = 2, seq: int = 40):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def greedy(model, prompt, n: int = 12):
    "gptkit's greedy tokens, one full forward per token"
    x = prompt
    with torch.no_grad():
        for _ in range(n): x = torch.cat([x, model(x)[:, -1:].argmax(-1)], 1)
    return x[0, prompt.shape[1]:].tolist()


def test_llama_import_gives_the_same_logits_and_greedy_tokens(llama):
    hf, _, run = llama
    got = ck.load_model(run)
    m = got.config.model
    assert (m.position, m.norm, m.activation, m.kv, m.bias, m.rope_theta) == ('rotary', 'rmsnorm', 'swiglu', 2, False, 5e5)
    assert m.tie_embeddings == hf.config.tie_word_embeddings and m.ffn == 56
    ids = ids_for(512)
    with torch.no_grad(): diff = (got.model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    other = GPT(dataclasses.replace(m, rope_theta=10000.0)).eval()      # the control: another rotary base differs
    other.load_state_dict(got.model.state_dict())
    with torch.no_grad(): assert (other(ids) - hf(ids).logits).abs().max() > 1e-4
    prompt = ids[:1, :8]
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=hf.config.eos_token_id)[0, 8:].tolist()
    assert greedy(got.model, prompt) == want


def test_llama_export_loads_in_transformers_with_the_same_logits_and_greedy_tokens(llama, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    hf, hf_dir, run = llama
    out = interop.export_hf(run, tmp_path / 'hf')
    orig, back = load_file(hf_dir / 'model.safetensors'), load_file(out / 'model.safetensors')
    assert set(orig) - {'lm_head.weight'} <= set(back) <= set(orig)
    for k, v in back.items(): assert torch.equal(orig[k], v), k
    config = json.loads((out / 'config.json').read_text())
    assert config['model_type'] == 'llama' and config['num_key_value_heads'] == 2
    again, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert isinstance(again, LlamaForCausalLM)
    assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
    ids = ids_for(512)
    model = ck.load_model(run).model
    with torch.no_grad():
        diff = (again.eval()(ids).logits - model(ids)).abs().max().item()
        want = again.generate(ids[:1, :8], max_new_tokens=12, do_sample=False,
                              pad_token_id=again.config.eos_token_id)[0, 8:].tolist()
    assert diff <= 1e-5, diff
    assert greedy(model, ids[:1, :8]) == want


def test_llama_megatron_export_runs_in_megatron_core_with_the_same_logits(llama, tmp_path, mcore, monkeypatch):  # noqa: F811
    "megatron-core's GPTModel (RMSNorm, SwiGLU, rotary, 2 query groups) computes gptkit's logits from the export"
    # its RotaryEmbedding moves its frequencies to torch.cuda.current_device() on first use: this machine's is the CPU
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 'cpu')
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    run = llama[2]
    meg = megatron.export_megatron(run, tmp_path / 'meg')
    raw = read_torch_file(megatron_file(meg))
    a = raw['args']
    assert (a.position_embedding_type, a.normalization, a.swiglu, a.num_query_groups) == ('rope', 'RMSNorm', True, 2)
    cfg = TransformerConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                            num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, normalization='RMSNorm',
                            layernorm_epsilon=a.norm_epsilon, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
                            apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization='RMSNorm'), vocab_size=a.padded_vocab_size,
                     max_sequence_length=a.max_position_embeddings, position_embedding_type='rope',
                     rotary_base=int(a.rotary_base), share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights).eval()
    lm = raw['model']['language_model']
    renames = (('self_attention.query_key_value', 'self_attention.linear_qkv'), ('self_attention.dense', 'self_attention.linear_proj'),
               ('post_attention_layernorm', 'pre_mlp_layernorm'), ('mlp.dense_h_to_4h', 'mlp.linear_fc1'),
               ('mlp.dense_4h_to_h', 'mlp.linear_fc2'))
    sd = {'embedding.word_embeddings.weight': lm['embedding']['word_embeddings']['weight']}
    for k, v in lm['encoder'].items():
        for old, new in renames: k = k.replace(old, new)
        sd[f'decoder.{k}'] = v
    if 'output_layer' in lm: sd['output_layer.weight'] = lm['output_layer']['weight']
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith('_extra_state') for k in missing), (missing, unexpected)
    ids = ids_for(512)
    s = ids.shape[1]
    with torch.no_grad():
        theirs = model(ids, torch.arange(s).expand_as(ids), torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))[..., :a.vocab_size]
        ours = ck.load_model(run).model(ids)
    diff = (theirs - ours).abs().max().item()
    assert diff <= 1e-5, diff
    back = megatron.import_megatron(meg, tmp_path / 'back')         # and back: every tensor and the config
    x, y = ck.load_weights(run), ck.load_weights(back)
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
    assert ck.read_config(store.find(back)).model == ck.read_config(store.find(run)).model


def test_what_no_hugging_face_architecture_computes_is_refused(llama, tmp_path):
    hf, hf_dir, run = llama
    config = json.loads((hf_dir / 'config.json').read_text())
    scaled = {**config, 'rope_parameters': {'rope_type': 'longrope', 'rope_theta': 5e5, 'factor': 32.0}}
    with pytest.raises(CheckpointError, match="rope_type 'longrope' .* is not supported"):
        hf_config.config_from_hf(scaled)
    half = {**config, 'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 5e5, 'factor': 32.0}}
    with pytest.raises(CheckpointError, match="rope_type 'llama3' needs low_freq_factor"):
        hf_config.config_from_hf(half)
    with pytest.raises(CheckpointError, match="hidden_act = 'gelu' is not supported"):
        hf_config.config_from_hf({**config, 'hidden_act': 'gelu'})
    mixed = ModelConfig(layers=1, hidden=32, heads=4, seq_len=16, vocab=512, position='rotary')   # rotary + LayerNorm
    with pytest.raises(CheckpointError, match='mixes the GPT-2 and Llama families'):
        interop.to_hf(GPT(mixed).state_dict(), mixed)


# Llama 3.1+ and linear rescaling, as transformers itself builds them; a short original context puts the blend of the
# llama3 formula inside the 4-dimension head's frequencies (Llama 3's 8,192 would leave them all in one regime)
SCALED = {'llama3': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                     'original_max_position_embeddings': 16},
          'linear': {'rope_type': 'linear', 'factor': 4.0},
          'yarn': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16}}


@pytest.mark.parametrize('kind', list(SCALED))
def test_rescaled_rotary_imports_and_exports_with_transformers_logits(kind, tiny_data, tmp_path):
    "Llama 3's rescaled rotary angles (and linear): imported, the logits transformers gives; exported, loaded back alike"
    from transformers import LlamaForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from gptkit.kernels.reference import model_rotary
    hf = make_llama(tiny_data[1], tmp_path / 'hf', tie=False, rope=SCALED[kind])
    run = interop.import_hf(tmp_path / 'hf', tmp_path / 'run')
    got = ck.load_model(run)
    m = got.config.model
    assert m.rope_scaling == kind and m.rope_factor == SCALED[kind]['factor']
    theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](hf.config, 'cpu')
    mine, my_scale = model_rotary(m)
    assert torch.allclose(mine, theirs, rtol=1e-6, atol=0), (mine, theirs)
    assert my_scale == pytest.approx(their_scale, rel=1e-9)
    ids = ids_for(512)
    with torch.no_grad():
        want = hf(ids).logits
        assert (got.model(ids) - want).abs().max().item() <= 1e-4
        plain = GPT(dataclasses.replace(m, rope_scaling='none')).eval()       # the control: unscaled angles differ
        plain.load_state_dict(got.model.state_dict())
        assert (plain(ids) - want).abs().max().item() > 1e-3
    out = interop.export_hf(run, tmp_path / 'export')
    back = LlamaForCausalLM.from_pretrained(out).eval()
    assert back.config.rope_parameters['rope_type'] == kind
    with torch.no_grad():
        assert (back(ids).logits - want).abs().max().item() <= 1e-4
    if kind == 'yarn':             # megatron-core computes YaRN (tests/test_checkpoint_tools.py): exported and read back
        back = megatron.import_megatron(megatron.export_megatron(run, tmp_path / 'meg'), tmp_path / 'meg_back')
        assert ck.read_config(store.find(back)).model == m
        return
    with pytest.raises(CheckpointError, match=f"model.rope_scaling '{kind}' has no Megatron export yet"):
        megatron.export_megatron(run, tmp_path / 'meg')


@pytest.mark.parametrize('rope,said', [
    ({'rope_type': 'llama3', 'factor': 'x', 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
      'original_max_position_embeddings': 8192}, "rope_factor must be a positive number, not 'x'"),
    ({'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 4.0, 'high_freq_factor': 1.0,
      'original_max_position_embeddings': 8192}, 'rope_high_freq_factor 1.0 must be more than rope_low_freq_factor 4.0'),
    ({'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
      'original_max_position_embeddings': 1e30}, 'rope_original_context must be a positive whole number, not 1e+30'),
    ({'rope_type': 'linear', 'factor': float('inf')}, 'rope_factor must be a positive number, not inf'),
    ({'rope_type': 'dynamic', 'factor': 2.0}, "rope_type 'dynamic' (rescaled rotary angles) is not supported"),
])
def test_a_hostile_rope_config_is_refused_in_one_sentence(rope, said):
    config = hf_config.config_to_hf(ModelConfig(layers=1, hidden=32, heads=4, seq_len=16, vocab=64, position='rotary',
                                                norm='rmsnorm', activation='swiglu', bias=False), 0)
    with pytest.raises(CheckpointError, match='^config.json') as e:
        hf_config.config_from_hf({**config, 'rope_parameters': {'rope_theta': 5e5, **rope}})
    assert said in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('name', LLAMA_PRESETS)
def test_llama_presets_count_what_transformers_builds_for_them(name):
    "Each Llama-family preset's parameter count is the numel of transformers' model in its exported configuration"
    from transformers import AutoConfig, AutoModelForCausalLM
    from gptkit.config.sections import PRESETS
    from gptkit.estimate.sizing import count_params
    m = PRESETS[name].model
    exported = hf_config.config_to_hf(m, 0)
    with torch.device('meta'):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**exported))
    assert count_params(m).total == sum(p.numel() for p in hf.parameters())
    back = hf_config.config_from_hf(hf.config.to_dict())      # an MLP width that is the default comes back as None
    assert back.ffn == m.ffn and dataclasses.replace(back, ffn_hidden=m.ffn_hidden) == m
