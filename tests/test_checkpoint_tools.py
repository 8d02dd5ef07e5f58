"""Checkpoint tools: inspect, Hugging Face GPT-2 and Megatron-LM export/import, checked against transformers and megatron-core."""
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from typer.testing import CliRunner

os.environ['HF_HUB_OFFLINE'] = '1'          # nothing here may reach the network

from gptkit.checkpoint import checkpointing as ck

from gptkit.interop import hf as interop

from gptkit.interop import megatron

from gptkit.store import folders as store
from gptkit.model.decoder import GPT
from gptkit.tokenizer.bpe import EOD, PROBE, load_tokenizer
from gptkit.store.torch_files import read_torch_file
from gptkit_cli.main import app

runner = CliRunner()
HEAVY = ('torch', 'deepspeed', 'tokenizers', 'transformers', 'safetensors', 'megatron')
TEXTS = [PROBE, 'In the beginning God created the heaven and the earth.', ' And God said, Let there be light: and there was light.\n']


def make_hf(tok_dir: str, folder: Path, activation: str, seed: int = 0):
    "A random GPT2LMHeadModel with non-trivial biases and norms, saved with its tokenizer by transformers"
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    tok = load_tokenizer(tok_dir)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=tok.vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function=activation, initializer_range=0.2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.eod, eos_token_id=tok.eod)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():            # GPT-2 starts with zero biases and unit norms, which would hide a wrong mapping of them
        for name, p in model.named_parameters():
            if name.endswith('bias') or '.ln_' in name: p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / 'tokenizer.json'), bos_token=EOD, eos_token=EOD,
                            unk_token=EOD).save_pretrained(folder)
    return model


@pytest.fixture(scope='module', params=['gelu_new', 'gelu'])
def imported(request, tiny_data, tmp_path_factory):
    "(HF model, its folder, the gptkit run imported from it) for each GPT-2 activation gptkit represents"
    d = tmp_path_factory.mktemp(f'hf_{request.param}')
    model = make_hf(tiny_data[1], d / 'hf', request.param)
    return model, d / 'hf', interop.import_hf(d / 'hf', d / 'run')


def ids_for(vocab: int, batch: int = 2, seq: int = 32):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_hf_import_gives_the_same_logits_and_greedy_text(imported):
    hf, _, run = imported
    got = ck.load_model(run)
    want_act = {'gelu_new': 'gelu_tanh', 'gelu': 'gelu'}[hf.config.activation_function]
    assert got.config.model.activation == want_act and got.config.model.vocab == 512 and got.model.wte.weight.shape[0] == 512
    ids = ids_for(512)
    with torch.no_grad():
        diff = (got.model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    other = GPT(dataclasses.replace(got.config.model, activation='gelu' if want_act == 'gelu_tanh' else 'gelu_tanh')).eval()
    other.load_state_dict(got.model.state_dict())
    with torch.no_grad(): assert (other(ids) - hf(ids).logits).abs().max() > 1e-4   # the test can tell the two GELUs apart
    prompt = ids[:1, :8]
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=hf.config.eos_token_id)[0, 8:].tolist()
        x = prompt
        for _ in range(12): x = torch.cat([x, got.model(x)[:, -1:].argmax(-1)], 1)
    assert x[0, 8:].tolist() == want


def test_hf_round_trip_gives_identical_tensors(imported, tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel
    hf, hf_dir, run = imported
    out = interop.export_hf(run, tmp_path / 'hf')
    orig, back = load_file(hf_dir / 'model.safetensors'), load_file(out / 'model.safetensors')
    assert set(orig) - {'lm_head.weight'} == set(back)
    for k, v in back.items(): assert torch.equal(orig[k], v), k
    c_in, c_out = json.loads((hf_dir / 'config.json').read_text()), json.loads((out / 'config.json').read_text())
    for k in ('n_embd', 'n_layer', 'n_head', 'n_positions', 'vocab_size', 'activation_function', 'layer_norm_epsilon', 'tie_word_embeddings'):
        assert c_out[k] == c_in[k], k
    again, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
    ids = ids_for(512)
    with torch.no_grad(): assert torch.equal(again.eval()(ids).logits, hf(ids).logits)


def test_exported_tokenizer_loads_offline_and_encodes_like_gptkit(imported, tiny_data, tmp_path):
    from transformers import AutoTokenizer
    out = interop.export_hf(imported[2], tmp_path / 'hf')
    hf_tok, tok = AutoTokenizer.from_pretrained(out), load_tokenizer(tiny_data[1])
    for text in TEXTS: assert hf_tok(text)['input_ids'] == tok.encode(text)
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == tok.eod == json.loads((out / 'config.json').read_text())['eos_token_id']
    assert hf_tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]


def test_imported_checkpoint_trains_from_the_imported_weights(imported, tiny_data):
    "`gptkit train --config OUT/config.json --out OUT --resume`: step 1's loss is the HF model's loss on that batch"
    from gptkit.config.run import resolve
    from gptkit.train.microbatches import micro_batch
    from gptkit.train.loop import _split
    hf, _, run = imported
    prefix, _ = tiny_data
    r = runner.invoke(app, ['train', '--config', str(run / 'config.json'), '--out', str(run), '--resume', '--data', prefix,
                            '--iters', '2', '--set', 'train.log_interval=1', '--set', 'train.eval_iters=1'])
    assert r.exit_code == 0, r.output
    steps = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
    losses = [s['loss'] for s in steps if s['kind'] == 'train']
    assert len(losses) == 2 and losses[0] != losses[1]
    cfg = resolve(file=run / 'config.json', overrides={'data': {'prefix': prefix}, 'train': {'iters': 2}})
    ids = torch.from_numpy(micro_batch(_split(cfg, 'train', 0), 0, 1, 512, prefix))
    with torch.no_grad(): want = F.cross_entropy(hf(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    assert abs(losses[0] - want) < 1e-5, (losses[0], want)
    assert ck.load_model(run).state['iteration'] == 2


def test_megatron_round_trip_gives_identical_tensors(imported, tmp_path):
    run = imported[2]
    meg = megatron.export_megatron(run, tmp_path / 'meg')
    raw = read_torch_file(megatron_file(meg))
    assert raw['checkpoint_version'] == 3.0 and raw['iteration'] == ck.inspect(run)['iteration']
    enc = raw['model']['language_model']['encoder']
    assert enc['layers.1.self_attention.query_key_value.weight'].shape == (96, 32) and 'final_layernorm.bias' in enc
    assert raw['args'].padded_vocab_size == 512 and raw['args'].num_attention_heads == 4
    back = megatron.import_megatron(meg, tmp_path / 'back')
    a, b = ck.load_weights(run), ck.load_weights(back)
    assert set(a) == set(b)
    for k in a: assert torch.equal(a[k], b[k]), k
    assert ck.read_config(store.find(back)).model == ck.read_config(store.find(run)).model


@pytest.fixture
def mcore():
    "megatron-core's parallel state for one CPU process, with the two CUDA-only spots of its local attention bypassed"
    from gptkit.train.engine import init_distributed
    init_distributed()
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(1, 1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    # DotProductAttention forks the CUDA RNG around its dropout (0 here, and the model is in eval mode) ...
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    # ... and takes its score buffer from a global buffer allocated with torch.cuda.current_device(): give it a CPU one
    parallel_state.get_global_memory_buffer().buffer[('mpu', torch.float32)] = torch.empty(1 << 20)
    yield
    del tracker.fork
    parallel_state.destroy_model_parallel()


def megatron_file(meg: Path) -> Path:
    "The model_optim_rng.pt that latest_checkpointed_iteration.txt points at"
    return meg / f"iter_{int((meg / 'latest_checkpointed_iteration.txt').read_text()):07d}" / 'mp_rank_00' / 'model_optim_rng.pt'


def legacy_to_mcore(lm: dict) -> dict:
    "Megatron legacy names -> megatron-core GPTModel names (QKV rows keep their per-head layout)"
    renames = (('self_attention.query_key_value', 'self_attention.linear_qkv'), ('self_attention.dense', 'self_attention.linear_proj'),
               ('post_attention_layernorm', 'pre_mlp_layernorm'), ('mlp.dense_h_to_4h', 'mlp.linear_fc1'), ('mlp.dense_4h_to_h', 'mlp.linear_fc2'))
    out = {f'embedding.{k}.weight': v['weight'] for k, v in lm['embedding'].items()}
    for k, v in lm['encoder'].items():
        for old, new in renames: k = k.replace(old, new)
        out[f'decoder.{k}'] = v
    if 'output_layer' in lm: out['output_layer.weight'] = lm['output_layer']['weight']
    return out


def mcore_logits(raw: dict, ids, qkv_fix=lambda t: t):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    a = raw['args']
    cfg = TransformerConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                            ffn_hidden_size=a.ffn_hidden_size, layernorm_epsilon=a.layernorm_epsilon, add_bias_linear=True,
                            activation_func=partial(F.gelu, approximate='tanh') if a.openai_gelu else F.gelu,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
                            bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                            persist_layer_norm=False, apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                     position_embedding_type='learned_absolute', share_embeddings_and_output_weights=True).eval()
    sd = {k: qkv_fix(v) if 'linear_qkv' in k else v for k, v in legacy_to_mcore(raw['model']['language_model']).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith('_extra_state') for k in missing), (missing, unexpected)
    s = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(s).expand_as(ids), torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))[..., :a.vocab_size]


def test_megatron_export_runs_in_megatron_core_with_the_same_logits(imported, tmp_path, mcore):
    "The exported legacy weights, loaded into megatron-core's own GPTModel, compute gptkit's logits"
    run = imported[2]
    meg = megatron.export_megatron(run, tmp_path / 'meg')
    raw = read_torch_file(megatron_file(meg))
    ids = ids_for(512)
    with torch.no_grad(): want = ck.load_model(run).model(ids)
    diff = (mcore_logits(raw, ids) - want).abs().max().item()
    assert diff <= 1e-5, diff
    # the control: gptkit's [3, heads, head_dim] rows, left un-interleaved, load without complaint but compute something else
    wrong = (mcore_logits(raw, ids, lambda t: megatron.qkv_from_megatron(t, 4)) - want).abs().max().item()
    assert wrong > 1e-3, wrong


class _CudaOnCPU(TorchFunctionMode):
    "Tensors megatron-core makes on 'cuda' (its sliding-window mask) made on the CPU: this machine has no GPU"
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get('device')) == 'cuda': kwargs = {**kwargs, 'device': 'cpu'}
        return func(*args, **kwargs)


# Megatron-LM's training copies YaRN's args onto the config under these names (megatron/training/argument_utils.py)
YARN_ATTRS = {'yarn_rotary_scaling_factor': 'rotary_scaling_factor', 'yarn_mscale': 'mscale', 'yarn_mscale_all_dim': 'mscale_all_dim',
              'yarn_original_max_position_embeddings': 'yarn_original_max_position_embeddings', 'yarn_beta_fast': 'yarn_beta_fast',
              'yarn_beta_slow': 'yarn_beta_slow', 'yarn_correction_range_round_to_int': 'yarn_correction_range_round_to_int'}


def mcore_llama_logits(raw: dict, ids, plain: bool = False):
    "megatron-core's GPTModel built from the exported args (Llama family, local spec) on the exported weights; `plain`: no window, no YaRN"
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    a = raw['args']
    cfg = TransformerConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                            num_query_groups=a.num_query_groups, kv_channels=a.kv_channels, ffn_hidden_size=a.ffn_hidden_size,
                            normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, gated_linear_unit=a.swiglu,
                            activation_func=F.silu, add_bias_linear=a.add_bias_linear, add_qkv_bias=a.add_qkv_bias,
                            qk_layernorm=a.qk_layernorm, window_size=None if plain else a.window_size, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
                            masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                            apply_rope_fusion=False, apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True)
    position = 'rope' if plain and a.position_embedding_type == 'yarn' else a.position_embedding_type
    if position == 'yarn':
        for attr, arg in YARN_ATTRS.items(): setattr(cfg, attr, getattr(a, arg))
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=a.qk_layernorm, normalization=a.normalization),
                     vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings, position_embedding_type=position,
                     rotary_base=int(a.rotary_base), share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights).eval()
    missing, unexpected = model.load_state_dict(legacy_to_mcore(raw['model']['language_model']), strict=False)
    assert not unexpected and all(k.endswith('_extra_state') for k in missing), (missing, unexpected)
    s = ids.shape[1]
    with torch.no_grad(), _CudaOnCPU():
        return model(ids, torch.arange(s).expand_as(ids), torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))[..., :a.vocab_size]


# every choice of issue 31 in one model: Qwen3's QK norms and 12-wide heads (hidden 32 over 4 heads), Qwen2's QKV bias alone,
# Mistral's window of 5 and YaRN's angles for 4 x an original context of 8, over 16 positions
EVERY = dict(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, tie_embeddings=False, position='rotary', norm='rmsnorm',
             activation='swiglu', bias=False, dropout=0.0, qk_norm=True, head_size=12, qkv_bias=True, sliding_window=5,
             rope_scaling='yarn', rope_factor=4.0, rope_original_context=8)


def test_qwen_and_mistral_choices_export_to_megatron_core_with_the_same_logits(tiny_data, tmp_path, mcore, monkeypatch):
    "megatron-core's GPTModel (qk_layernorm, kv_channels, add_qkv_bias, window_size, YaRN) computes gptkit's logits from the export"
    from gptkit.config.sections import ModelConfig
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 'cpu')     # its rotary tables go to the current device
    tok = load_tokenizer(tiny_data[1])
    cfg = ModelConfig(vocab=tok.vocab_size, **EVERY)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():       # norms of ones and biases of zeros would hide a weight put in the wrong place
        for p in model.parameters(): p += 0.1 * torch.randn_like(p)
    run = interop.write_run(model.state_dict(), cfg, tok, tmp_path / 'run', 'every choice')
    raw = read_torch_file(megatron_file(megatron.export_megatron(run, tmp_path / 'meg')))
    ids = ids_for(tok.vocab_size, seq=16)
    with torch.no_grad(): want = model.eval()(ids)
    diff = (mcore_llama_logits(raw, ids) - want).abs().max().item()
    assert diff <= 1e-5, diff
    off = (mcore_llama_logits(raw, ids, plain=True) - want).abs().max().item()   # the control: without the window and YaRN
    assert off > 1e-3, off
    back = megatron.import_megatron(tmp_path / 'meg', tmp_path / 'back')
    a, b = ck.load_weights(run), ck.load_weights(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert ck.read_config(store.find(back)).model == cfg


@pytest.mark.parametrize('change,said', [
    (dict(bias=True, qkv_bias=False), "model.qkv_bias false with model.bias true has no Megatron export"),
    (dict(norm='layernorm'), "model.qk_norm with model.norm layernorm has no Megatron export"),
    (dict(rope_attention_factor=2.0), "model.rope_attention_factor 2.0 has no Megatron export"),
    (dict(rope_scaling='linear'), "model.rope_scaling 'linear' has no Megatron export yet"),
])
def test_what_megatron_args_cannot_say_is_refused_on_export(change, said):
    from gptkit.config.sections import ModelConfig
    refusal = megatron.megatron_refusal(ModelConfig(vocab=64, **{**EVERY, **change}))
    assert refusal.startswith(said) and '\n' not in refusal, refusal


@pytest.mark.parametrize('args,said', [
    (dict(window_size=(4, 4)), 'args.window_size = (4, 4) is not supported'),
    (dict(window_size='wide'), "args.window_size = 'wide' is not supported"),
    (dict(window_attn_skip_freq=4), 'args.window_attn_skip_freq = 4 is not supported'),
    (dict(normalization='LayerNorm', qk_layernorm=True), "args.qk_layernorm = True with normalization 'LayerNorm' is not supported"),
    (dict(mscale=0.707), 'args.mscale = 0.707 is not supported'),
    (dict(yarn_correction_range_round_to_int=False), 'args.yarn_correction_range_round_to_int = False is not supported'),
    (dict(kv_channels=0), 'describes no valid gptkit model'),
    (dict(rotary_scaling_factor='x'), 'describes no valid gptkit model'),
])
def test_megatron_args_of_the_new_choices_gptkit_cannot_read_are_refused(args, said):
    from gptkit.config.sections import ModelConfig
    good = vars(megatron.megatron_args(ModelConfig(vocab=64, **EVERY)))
    assert megatron.config_from_megatron(good, 64, 16) == ModelConfig(vocab=64, **EVERY)
    with pytest.raises(store.CheckpointError, match='^args') as e:
        megatron.config_from_megatron({**good, **args}, 64, 16)
    assert said in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_inspect(imported):
    run = imported[2]
    info = ck.inspect(run)
    model = ck.load_model(run).model
    assert info['parameters'] == sum(p.numel() for p in model.parameters()) and info['dtypes'] == ['float32']
    assert info['layout']['zero'] == 0 and info['layout']['world_size'] == 1 and info['tokenizer']['vocab_size'] == 512
    assert info['folder'] == str(store.find(run)) and info['bytes'] == sum(info['files'].values()) > 0
    r = runner.invoke(app, ['checkpoint', 'inspect', str(run)])
    assert r.exit_code == 0, r.output
    text = ' '.join(r.output.split())
    assert f"parameters {info['parameters']:,}" in text and 'ZeRO 0' in text and 'mp_rank_00_model_states.pt' in text
    r = runner.invoke(app, ['checkpoint', 'inspect', str(run), '--json'])
    assert r.exit_code == 0 and json.loads(r.stdout) == json.loads(json.dumps(info))


def test_cli_export_and_import(imported, tmp_path):
    hf, hf_dir, _ = imported
    r = runner.invoke(app, ['checkpoint', 'import', str(hf_dir), str(tmp_path / 'run'), '--from', 'hf'])
    assert r.exit_code == 0 and 'imported' in r.stdout, r.output
    r = runner.invoke(app, ['checkpoint', 'export', str(tmp_path / 'run'), str(tmp_path / 'hf'), '--to', 'hf'])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ['checkpoint', 'export', str(tmp_path / 'run'), str(tmp_path / 'meg'), '--to', 'megatron'])
    assert r.exit_code == 0 and (tmp_path / 'meg' / 'iter_0000000' / 'mp_rank_00' / 'model_optim_rng.pt').is_file(), r.output
    r = runner.invoke(app, ['checkpoint', 'import', str(tmp_path / 'meg'), str(tmp_path / 'run2'), '--from', 'megatron'])
    assert r.exit_code == 0, r.output
    from transformers import GPT2LMHeadModel
    ids = ids_for(512)
    with torch.no_grad():
        want = hf(ids).logits
        assert (GPT2LMHeadModel.from_pretrained(tmp_path / 'hf').eval()(ids).logits - want).abs().max() <= 1e-5
        assert (ck.load_model(tmp_path / 'run2').model(ids) - want).abs().max() <= 1e-5


@pytest.fixture(scope='module')
def bad_hf(tiny_data, tmp_path_factory):
    d = tmp_path_factory.mktemp('bad_hf')
    make_hf(tiny_data[1], d, 'gelu_new')
    c = json.loads((d / 'config.json').read_text())
    (d / 'config.json').write_text(json.dumps({**c, 'activation_function': 'relu'}))
    return d


@pytest.mark.parametrize('args,code,message', [
    (['inspect', '{tmp}'], 1, 'is not a gptkit checkpoint: it has no state.json'),
    (['inspect', '{tmp}/nowhere'], 1, 'checkpoint path {tmp}/nowhere does not exist'),
    (['import', '{bad_hf}', '{tmp}/out', '--from', 'hf'], 1, "activation_function 'relu' is not supported"),
    (['import', '{tmp}', '{tmp}/out', '--from', 'hf'], 1, 'is not a Hugging Face model folder: it has no config.json'),
    (['import', '{bad_hf}', '{tmp}/out', '--from', 'megatron'], 1, 'is not a Megatron legacy checkpoint'),
    (['export', '{tmp}', '{tmp}/out', '--to', 'xyz'], 2, "--to must be hf, megatron or peft, not 'xyz'"),
    (['import', '{tmp}', '{tmp}/out', '--from', 'onnx'], 2, "--from must be hf or megatron, not 'onnx'"),
    (['export', '{tmp}', '{tmp}/out', '--to', 'hf'], 1, 'is not a gptkit checkpoint'),
])
def test_bad_input_is_one_clear_line(args, code, message, tmp_path, bad_hf):
    fill = lambda s: s.format(tmp=tmp_path, bad_hf=bad_hf)
    r = runner.invoke(app, ['checkpoint', *map(fill, args)])
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith('error: '), r.output
    assert fill(message) in ' '.join(r.output.split()) and 'Traceback' not in r.output
    assert not (tmp_path / 'out').exists()


def test_help_imports_nothing_heavy():
    code = ('import sys; from gptkit_cli.main import app\n'
            "try: app(['checkpoint', 'export', '--help'])\nexcept SystemExit: pass\n"
            'print("HEAVY=" + ",".join(m for m in %r if m in sys.modules))') % (HEAVY,)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and '--to' in r.stdout, r.stderr
    assert r.stdout.strip().splitlines()[-1] == 'HEAVY='


def test_hf_import_reads_the_original_pytorch_model_bin_layout(imported, tmp_path):
    "OpenAI's GPT-2 as first published on the Hub: pytorch_model.bin, names without `transformer.`, causal-mask buffers, lm_head"
    import shutil
    hf, hf_dir, _ = imported
    sd = {k.removeprefix('transformer.'): v.clone() for k, v in hf.state_dict().items()}
    for i in range(hf.config.n_layer): sd[f'h.{i}.attn.bias'] = torch.ones(1, 1, 32, 32).tril()
    (tmp_path / 'old').mkdir()
    for name in ('config.json', 'tokenizer.json', 'tokenizer_config.json'): shutil.copy(hf_dir / name, tmp_path / 'old' / name)
    torch.save(sd, tmp_path / 'old' / 'pytorch_model.bin')
    got = ck.load_model(interop.import_hf(tmp_path / 'old', tmp_path / 'run'))
    ids = ids_for(512)
    with torch.no_grad(): assert (got.model(ids) - hf(ids).logits).abs().max() <= 1e-5
    sd['lm_head.weight'] = sd['lm_head.weight'] + 1                   # an untied output layer is refused, not dropped
    torch.save(sd, tmp_path / 'old' / 'pytorch_model.bin')
    with pytest.raises(store.CheckpointError, match='lm_head.weight differs from transformer.wte.weight'):
        interop.import_hf(tmp_path / 'old', tmp_path / 'run2')
    assert not (tmp_path / 'run2').exists()
