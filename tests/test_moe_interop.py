"""Mixtral, Qwen3-MoE and OLMoE as transformers itself builds and saves them (per-expert tensors, as on the Hub):
imported with their logits, decoded with transformers' greedy tokens, evaluated with its loss and served; exported back
to the same family, the same files and the same logits; hostile configs refused naming the key."""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ['HF_HUB_OFFLINE'] = '1'          # nothing here may reach the network

from gptkit.checkpoint import checkpointing as ck

from gptkit.interop import hf as interop
from gptkit.inference.generator import Generator
from gptkit.model.decoder import GPT, KVCache
from gptkit.inference.sampling import Sampling
from gptkit.store.folders import CheckpointError
from gptkit.tokenizer.bpe import EOD, load_tokenizer

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.2, num_experts_per_tok=2)
# each family's own choices: Mixtral rescales the top 2 of 4 experts; Qwen3-MoE has per-head QK norms on 16-wide heads,
# experts narrower than its dense MLPs, and MoE on every second of 4 layers; OLMoE normalizes q and k across all heads
# and keeps the top 2 of 8 weights as the softmax gave them; and Mixtral with a window shorter than the sequences
FAMILIES = {'mixtral': ('MixtralConfig', dict(intermediate_size=48, num_local_experts=4)),
            'qwen3_moe': ('Qwen3MoeConfig', dict(intermediate_size=56, moe_intermediate_size=24, num_experts=4,
                                                 head_dim=16, norm_topk_prob=True, decoder_sparse_step=2,
                                                 num_hidden_layers=4)),
            'olmoe': ('OlmoeConfig', dict(intermediate_size=24, num_experts=8, norm_topk_prob=False)),
            'mixtral-window': ('MixtralConfig', dict(intermediate_size=48, num_local_experts=4, sliding_window=6))}


def make_moe(name: str, tok_dir: str, folder: Path):
    "A random MoE model of family `name` (experts, routers and norms all random), saved by transformers"
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    tok = load_tokenizer(tok_dir)
    config_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(vocab_size=tok.vocab_size, bos_token_id=tok.eod, eos_token_id=tok.eod,
                                              pad_token_id=None, **{**SIZES, **extra})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():            # unit norms would hide a wrong mapping; stacked experts start uninitialized
        for n, p in model.named_parameters():
            if 'norm' in n:
                p.add_(0.3 * torch.randn_like(p))
            elif 'experts' in n or n.endswith('gate.weight'):
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / 'tokenizer.json'), bos_token=EOD, eos_token=EOD,
                            unk_token=EOD).save_pretrained(folder)
    return model


@pytest.fixture(scope='module', params=list(FAMILIES))
def family(request, tiny_data, tmp_path_factory):
    "(family name, transformers' model, its folder, the gptkit run imported from it)"
    d = tmp_path_factory.mktemp(request.param)
    hf = make_moe(request.param, tiny_data[1], d / 'hf')
    return request.param, hf, d / 'hf', interop.import_hf(d / 'hf', d / 'run')


IDS = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    "Tiny matrices: one thread each, so that a shared machine's cores are not oversubscribed"
    from conftest import torch_threads
    with torch_threads(1):
        yield


def test_transformers_saves_the_experts_one_by_one_as_the_hub_holds_them(family):
    from safetensors import safe_open
    name, _, hf_dir, _ = family
    with safe_open(hf_dir / 'model.safetensors', 'pt') as f:
        keys = set(f.keys())
    base, first = {'mixtral': ('block_sparse_moe', 'w1'), 'qwen3_moe': ('mlp', 'gate_proj'),
                   'olmoe': ('mlp', 'gate_proj')}[name.removesuffix('-window')]
    layer = 1 if name == 'qwen3_moe' else 0                 # Qwen3-MoE's first layer is dense (sparse step 2)
    assert f'model.layers.{layer}.{base}.experts.3.{first}.weight' in keys
    assert not any('gate_up_proj' in k for k in keys)


def test_import_gives_transformers_logits(family):
    name, hf, _, run = family
    m = ck.load_model(run).config.model
    want = {'mixtral': (4, 2, True, 1, False, None), 'qwen3_moe': (4, 2, True, 2, False, None),
            'olmoe': (8, 2, False, 1, True, None), 'mixtral-window': (4, 2, True, 1, False, 6)}
    assert (m.moe_experts, m.moe_top_k, m.moe_renormalize, m.moe_every, m.qk_norm_all, m.sliding_window) == want[name]
    if name == 'qwen3_moe':
        assert (m.ffn, m.expert_ffn, m.head_dim) == (56, 24, 16)
    model = ck.load_model(run).model
    with torch.no_grad():
        theirs = hf(IDS).logits
        assert (model(IDS) - theirs).abs().max().item() <= 1e-4
        control = (dataclasses.replace(m, sliding_window=None) if m.sliding_window else
                   dataclasses.replace(m, moe_renormalize=not m.moe_renormalize))     # without the family's choice
        other = GPT(control).eval()
        other.load_state_dict(model.state_dict())
        assert (other(IDS) - theirs).abs().max().item() > 1e-3


def test_cached_greedy_decoding_gives_transformers_tokens(family):
    _, hf, _, run = family
    model = ck.load_model(run).model
    prompt = IDS[:1, :5]
    want = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    cache, x, got = KVCache.for_model(model, 1, 15), prompt, []
    with torch.no_grad():
        for _ in range(10):
            nxt = model(x, cache=cache, logits_to_keep=1)[:, -1:].argmax(-1)
            got.append(nxt.item())
            x = nxt
    assert got == want


def test_the_generator_evaluator_and_server_run_the_import(family):
    "gptkit generate's greedy text is transformers'; gptkit's window losses are its loss; the server answers the same"
    import httpx

    import gptkit.eval.perplexity as ev
    from gptkit.inference.batching import Limits
    from gptkit.serve.server import Server
    name, hf, _, run = family
    gen = Generator.from_checkpoint(run, device='cpu')
    prompt = 'In the beginning God created'
    ids = gen.tok.encode(prompt)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert gen.complete([prompt], Sampling(max_new_tokens=8, greedy=True, stop_at_eod=False))[0].tokens == want
    tokens = gen.tok.encode(' '.join(['And God said, Let there be light: and there was light.'] * 3))
    total, scored, _ = ev.token_losses(ck.load_model(run).model, tokens, 16, 8, batch_size=2)
    theirs = 0.0
    with torch.no_grad():
        for w in ev.windows(len(tokens), 16, 8):
            x, y = torch.tensor([tokens[w.start:w.stop]]), torch.tensor(tokens[w.start + 1:w.stop + 1])
            theirs += F.cross_entropy(hf(x).logits[0, :len(y)].double(), y, reduction='none')[w.first:].sum().item()
    assert total == pytest.approx(theirs, rel=1e-5) and scored == len(tokens) - 1
    if name != 'qwen3_moe':
        return                  # the server once, on the family with dense and MoE layers
    with Server(gen, Limits(max_new_tokens=16, max_prompts=4), name=name) as url:
        body = {'prompt': prompt, 'max_tokens': 8, 'temperature': 0}
        answer = httpx.post(url + '/v1/completions', json=body, timeout=60).json()
    assert answer['choices'][0]['text'] == gen.tok.decode(want)


def test_export_is_the_same_family_files_and_logits(family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    name, hf, hf_dir, run = family
    out = interop.export_hf(run, tmp_path / 'export')
    assert json.loads((out / 'config.json').read_text())['model_type'] == hf.config.model_type
    orig, back = load_file(hf_dir / 'model.safetensors'), load_file(out / 'model.safetensors')
    assert set(orig) == set(back)
    for k, v in back.items():
        assert torch.equal(orig[k], v), k
    again, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(again) is type(hf)
    assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
    with torch.no_grad():
        assert (again.eval()(IDS).logits - hf(IDS).logits).abs().max().item() <= 1e-4
    shards = interop.export_hf(run, tmp_path / 'shards', max_shard_size='20KB')     # as the Hub holds big models
    assert len(list(shards.glob('model-*.safetensors'))) > 3 and (shards / 'model.safetensors.index.json').exists()
    sharded = AutoModelForCausalLM.from_pretrained(shards).eval()
    imported = ck.load_model(interop.import_hf(shards, tmp_path / 'run')).model
    with torch.no_grad():
        assert torch.equal(sharded(IDS).logits, again(IDS).logits)
        assert torch.equal(imported(IDS), ck.load_model(run).model(IDS))


def test_a_misshapen_expert_tensor_is_refused_naming_it(family, tmp_path):
    from safetensors.torch import load_file, save_file
    name, _, hf_dir, _ = family
    bad = tmp_path / 'bad'
    bad.mkdir()
    for f in hf_dir.iterdir():
        if f.name != 'model.safetensors':
            (bad / f.name).write_bytes(f.read_bytes())
    sd = load_file(hf_dir / 'model.safetensors')
    key = next(k for k in sorted(sd) if '.experts.1.' in k)
    sd[key] = sd[key][:-1].contiguous()            # one row short: the stacked total would not even reshape
    save_file(sd, bad / 'model.safetensors')
    with pytest.raises(CheckpointError, match=f'{key} has shape'):
        interop.import_hf(bad, tmp_path / 'run')
    assert not (tmp_path / 'run').exists()


def test_what_no_moe_family_computes_is_refused_on_export(family, tmp_path):
    "A shared expert (Qwen2-MoE's is gated) or OLMoE without renormalisation made Mixtral-like: refused by the field"
    from gptkit.errors import ConfigError
    name, _, _, run = family
    m = ck.load_model(run).config.model
    with pytest.raises(ConfigError, match='model.moe_shared_ffn = 16 with the other choices'):
        interop.to_hf({}, dataclasses.replace(m, moe_shared_ffn=16))
    if name == 'olmoe':
        mix = dataclasses.replace(m, qk_norm=False, qk_norm_all=False)     # Mixtral's layout, OLMoE's routing
        with pytest.raises(ConfigError, match='model.moe_renormalize = False'):
            interop.to_hf({}, mix)


def _moe_config(kind: str, **changes) -> dict:
    import transformers
    made = {'mixtral': transformers.MixtralConfig, 'qwen3_moe': transformers.Qwen3MoeConfig,
            'olmoe': transformers.OlmoeConfig}
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=2)
    return {**made[kind](**sizes).to_dict(), **changes}


# each found by trying: a hostile or broken MoE config.json, refused in one sentence naming the key
@pytest.mark.parametrize('kind,changes,said', [
    ('mixtral', dict(num_local_experts=0), 'num_local_experts must be from 1 to 65,536, not 0'),
    ('olmoe', dict(num_experts=10**9), 'num_experts must be from 1 to 65,536, not 1,000,000,000'),
    ('olmoe', dict(num_experts='8'), "num_experts must be a whole number, not '8'"),
    ('olmoe', dict(num_experts=None, num_local_experts=None), 'has no num_experts'),
    ('qwen3_moe', dict(num_local_experts=8, num_experts=16), 'num_local_experts 8 and num_experts 16 disagree'),
    ('mixtral', dict(num_experts_per_tok=9), 'num_experts_per_tok = 9 must be from 1 to the 8 experts'),
    ('qwen3_moe', dict(num_experts_per_tok=0), 'num_experts_per_tok = 0 must be from 1'),
    ('qwen3_moe', dict(num_experts_per_tok=True), 'num_experts_per_tok must be a whole number, not True'),
    ('qwen3_moe', dict(mlp_only_layers=[1]), 'mlp_only_layers [1] with decoder_sparse_step 1 leaves irregular'),
    ('qwen3_moe', dict(mlp_only_layers=[0, 1, 2, 3]), 'leaves no MoE layers'),
    ('qwen3_moe', dict(mlp_only_layers='all'), "mlp_only_layers must be a list of layer numbers, not 'all'"),
    ('qwen3_moe', dict(decoder_sparse_step=0), 'decoder_sparse_step = 0 is not supported'),
    ('qwen3_moe', dict(num_hidden_layers=10**12), 'num_hidden_layers = 1,000,000,000,000 is not supported'),
    ('qwen3_moe', dict(moe_intermediate_size=None), 'moe_intermediate_size must be a whole number'),
    ('qwen3_moe', dict(norm_topk_prob='yes'), "norm_topk_prob must be true or false, not 'yes'"),
    ('qwen3_moe', dict(use_sliding_window=True), 'use_sliding_window = True is not supported for qwen3_moe'),
    ('olmoe', dict(attention_bias=True), 'attention_bias = True is not supported for olmoe'),
    ('olmoe', dict(clip_qkv=8.0), 'clip_qkv = 8.0 is not supported'),
    ('mixtral', dict(router_jitter_noise=0.1), 'router_jitter_noise = 0.1 is not supported'),
    ('mixtral', dict(output_router_logits='no'), "output_router_logits must be true or false, not 'no'"),
    ('mixtral', dict(router_aux_loss_coef=-1), 'moe_aux_loss_coef'),
])
def test_a_hostile_moe_config_is_refused_naming_the_key(kind, changes, said):
    from gptkit.interop.hf_config import config_from_hf
    with pytest.raises(CheckpointError) as e:
        config_from_hf(_moe_config(kind, **changes))
    assert said in str(e.value) and str(e.value).startswith('config.json') and '\n' not in str(e.value)


def test_regular_dense_layers_are_read_as_the_step_they_make():
    "Qwen3-MoE's mlp_only_layers [0, 2] of 4 at step 1 leaves layers 1 and 3 sparse: gptkit's moe_every 2"
    from gptkit.interop.hf_config import config_from_hf, config_to_hf
    m = config_from_hf(_moe_config('qwen3_moe', mlp_only_layers=[0, 2], moe_intermediate_size=32))
    assert (m.moe_every, [m.moe_layer(i) for i in range(4)]) == (2, [False, True, False, True])
    hf = config_to_hf(m, None)
    assert (hf['decoder_sparse_step'], hf['mlp_only_layers'], hf['moe_intermediate_size']) == (2, [], 32)


@pytest.mark.parametrize('preset', ['mixtral-8x7b', 'qwen3-30b-a3b', 'olmoe-1b-7b'])
def test_each_moe_preset_is_written_as_a_config_transformers_builds_at_the_published_size(preset):
    "The exported config.json read back gives the preset; transformers' model of it (on meta) has gptkit's numel"
    import transformers

    from gptkit.config.sections import PRESETS
    from gptkit.interop.hf_config import config_from_hf, config_to_hf
    from gptkit.config.params import param_table
    m = PRESETS[preset].model
    hf = config_to_hf(m, None)
    back = config_from_hf(json.loads(json.dumps(hf)))
    assert dataclasses.replace(back, kv_heads=back.kv) == dataclasses.replace(m, kv_heads=m.kv)
    made = {'mixtral': transformers.MixtralConfig, 'qwen3_moe': transformers.Qwen3MoeConfig,
            'olmoe': transformers.OlmoeConfig}[hf['model_type']]
    with torch.device('meta'):
        model = transformers.AutoModelForCausalLM.from_config(made(**hf))
    padding = (m.padded_vocab() - m.vocab) * m.hidden * (1 if m.tie_embeddings else 2)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel for p in param_table(m)) - padding


def test_the_cli_refuses_to_export_a_shared_expert_in_one_sentence(tiny_data, tmp_path, caplog):
    "A gptkit model with a shared expert has no Hugging Face family: refused naming the field, nothing written"
    from conftest import run_here

    from gptkit.config.sections import LLAMA, ModelConfig
    tok = load_tokenizer(tiny_data[1])
    cfg = ModelConfig(layers=1, hidden=32, heads=4, seq_len=16, vocab=tok.vocab_size, moe_experts=4, moe_top_k=2,
                      moe_shared_ffn=16, **LLAMA)
    torch.manual_seed(0)
    run = interop.write_run(GPT(cfg).state_dict(), cfg, tok, tmp_path / 'run', 'a random shared-expert MoE')
    r = run_here('checkpoint', 'export', run, tmp_path / 'hf', '--to', 'hf')
    assert r.returncode == 2 and 'moe-shared-ffn = 16 with the other choices' in r.stderr, r.stderr
    assert 'Traceback' not in r.stderr + r.stdout and not (tmp_path / 'hf').exists()
    gelu = ModelConfig(layers=1, hidden=32, heads=4, seq_len=16, vocab=96, moe_experts=4)      # GPT-2's blocks
    with pytest.raises(CheckpointError, match='MoE families .* need rotary, rmsnorm and swiglu'):
        interop.to_hf(GPT(gelu).state_dict(), gelu)
    capped = dataclasses.replace(cfg, moe_shared_ffn=0, moe_capacity_factor=1.0)       # exported, with a warning
    run = interop.write_run({k: v for k, v in GPT(capped).state_dict().items()}, capped, tok, tmp_path / 'capped',
                            'a random MoE with a capacity factor')
    interop.export_hf(run, tmp_path / 'capped_hf')
    assert 'transformers routes every token' in caplog.text
