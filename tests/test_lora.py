"""LoRA (chapter 07e) end to end: adapters trained through DeepSpeed with the base frozen, saved alone, resumed,
merged when the checkpoint is loaded and when it is exported to Hugging Face, where the merged model equals peft's LoRA
with the same adapters on the export of the base (GPT-2 and a Llama-style model)."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

os.environ['HF_HUB_OFFLINE'] = '1'          # nothing here may reach the network

from conftest import TINY_SETS, run_here

from gptkit.checkpoint import checkpointing as ck

from gptkit.interop import hf as interop
from gptkit.model import lora
from gptkit.config.sections import LLAMA, ModelConfig, TrainConfig
from gptkit.train.engine import build_engine, init_distributed
from gptkit.errors import ConfigError
from gptkit.estimate.sizing import adapter_params
from gptkit.model.decoder import GPT
from gptkit.config.run import resolve
from gptkit.store.folders import CheckpointError
from gptkit.store.torch_files import read_torch_file

VOCAB = 96
GPT2_TINY = ModelConfig(layers=2, hidden=32, heads=2, seq_len=32, vocab=VOCAB, dropout=0.0)
LLAMA_TINY = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=32, vocab=VOCAB, tie_embeddings=False,
                         **LLAMA)
# peft's names for the layers gptkit's qkv, proj, fc1 and fc2 are (fused ones split into their parts)
PEFT_TARGETS = {'gpt2': (['c_attn', 'c_proj', 'c_fc'], True),
                'llama': (['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'], False)}


def config(model: ModelConfig, out, zero: int = 0, rank: int = 0, init=None):
    cfg = resolve('tiny', sets=['train.micro_batch=2', 'train.global_batch=2', 'train.precision=fp32', 'optim.warmup=0',
                                'optim.lr=1e-2', f'parallel.zero={zero}', f'train.lora_rank={rank}',
                                'train.lora_alpha=8'])
    return dataclasses.replace(cfg, model=model, out=str(out), init=None if init is None else str(init))


def save_run(cfg, model, steps: int = 0):
    "(engine, checkpoint folder, losses) of `steps` DeepSpeed steps on random tokens, saved by gptkit.checkpoint.checkpointing.save"
    engine, ds = build_engine(cfg, model, iters=max(steps, 1))
    data = torch.randint(0, VOCAB, (steps, 2, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for x in data:
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    client = {'iteration': steps, 'consumed_samples': 2 * steps, 'tokens': 2 * steps * cfg.model.seq_len}
    return engine, ck.save(engine, f'{cfg.out}/checkpoints', steps, client=client, cfg=cfg, ds_config=ds,
                           tokenizer_dir=None), losses


@pytest.fixture(scope='module', params=[(GPT2_TINY, 0), (LLAMA_TINY, 2)], ids=['gpt2-zero0', 'llama-zero2'])
def lora_run(request, tmp_path_factory):
    "(model config, base checkpoint, LoRA checkpoint, its engine, the base weights, the adapters before training)"
    model_cfg, zero = request.param
    d = tmp_path_factory.mktemp('lora')
    init_distributed()
    torch.manual_seed(0)
    _, base, _ = save_run(config(model_cfg, d / 'base'), GPT(model_cfg))
    cfg = config(model_cfg, d / 'lora', zero, rank=4, init=base)
    model = GPT(model_cfg)
    model.load_state_dict(ck.load_weights(base))
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = lora.add_adapters(model, cfg.train, cfg.parallel)
    assert len(wrapped) == 4 * model_cfg.layers
    start = {k: v.clone() for k, v in lora.adapter_state(model).items()}
    engine, folder, losses = save_run(cfg, model, steps=3)
    assert losses[-1] < losses[0], losses
    return model_cfg, base, folder, engine, base_weights, start


def test_training_moves_the_adapters_alone_and_saves_only_them(lora_run):
    model_cfg, base, folder, engine, base_weights, start = lora_run
    now = engine.module.state_dict()
    for k, v in base_weights.items():
        assert torch.equal(now[k], v), k                                    # the base is frozen
    for k, v in start.items():
        assert not torch.equal(now[k], v), k                                # every adapter trained (B from 0)
    saved = read_torch_file(folder / 'mp_rank_00_model_states.pt')['module']
    assert set(saved) == set(start)                                         # the adapters alone
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    assert trainable == adapter_params(model_cfg, TrainConfig(lora_rank=4)) == sum(v.numel() for v in saved.values())


def test_loading_merges_the_adapters_into_their_base(lora_run):
    model_cfg, base, folder, engine, _, _ = lora_run
    got = ck.load_model(folder)                                             # what generate, serve and eval load
    assert not lora.has_adapters(got.model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    engine.module.eval()
    with torch.no_grad():
        diff = (got.model(ids) - engine.module(ids)).abs().max().item()
        plain = GPT(model_cfg).eval()
        plain.load_state_dict(ck.load_weights(base))
        moved = (got.model(ids) - plain(ids)).abs().max().item()
    engine.module.train()
    assert diff < 1e-5 and moved > 1e-4, (diff, moved)


def test_resume_restores_the_adapters_on_the_base(lora_run):
    model_cfg, base, folder, engine, _, _ = lora_run
    cfg = ck.read_config(folder)
    model = GPT(model_cfg)
    model.load_state_dict(ck.load_weights(lora.base_checkpoint(cfg, folder)))   # the base first, from `init`
    lora.add_adapters(model, cfg.train, cfg.parallel)
    fresh, _ = build_engine(cfg, model, iters=4)
    state = ck.load(fresh, folder)
    assert state['iteration'] == 3
    for k, v in engine.module.state_dict().items():
        assert torch.equal(fresh.module.state_dict()[k], v), k


def test_merged_hugging_face_export_equals_peft_on_the_base_export(lora_run, tmp_path):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    model_cfg, base, folder, engine, _, _ = lora_run
    interop.export_hf(base, tmp_path / 'base_hf')
    interop.export_hf(folder, tmp_path / 'merged_hf')
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / 'merged_hf').eval()
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / 'base_hf').eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = hf_base(ids).logits                 # (get_peft_model adapts hf_base in place)
    family = 'gpt2' if model_cfg.position == 'learned' else 'llama'
    targets, fan_in_fan_out = PEFT_TARGETS[family]
    cfg = ck.read_config(folder).train
    peft_model = get_peft_model(hf_base, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                    target_modules=targets, fan_in_fan_out=fan_in_fan_out)).eval()
    adapters = lora.peft_state(lora.adapter_state(engine.module), model_cfg)
    result = set_peft_model_state_dict(peft_model, adapters)
    assert not result.unexpected_keys
    names = {n for n, _ in peft_model.named_parameters() if 'lora_' in n}
    assert len(names) == len(adapters) == 2 * model_cfg.layers * len(targets) + 2 * model_cfg.layers * (
        family == 'gpt2')                           # GPT-2's c_proj is attention's and the MLP's
    with torch.no_grad():
        want, got = peft_model(ids).logits, merged(ids).logits
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5 and (want - before).abs().max().item() > 1e-4, diff
    # the adapters as peft's own folder (interop.export_peft), loaded by PeftModel.from_pretrained on the base export
    from peft import PeftModel
    interop.export_peft(folder, tmp_path / 'peft')
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / 'base_hf'),
                                       tmp_path / 'peft').eval()
    with torch.no_grad():
        assert (loaded(ids).logits - got).abs().max().item() <= 1e-5
    with pytest.raises(CheckpointError, match='holds no LoRA adapters'):
        interop.export_peft(base, tmp_path / 'peft_of_base')


def test_a_gone_base_is_one_sentence(lora_run, tmp_path):
    _, base, folder, _, _, _ = lora_run
    run = base.parent.parent
    away = tmp_path / 'moved'
    shutil.move(run, away)
    try:
        with pytest.raises(CheckpointError, match='holds LoRA adapters only, and their base model .* is gone'):
            ck.load_weights(folder)
    finally:
        shutil.move(away, run)


def test_bad_targets_and_layouts_are_one_sentence_naming_the_key():
    with pytest.raises(ConfigError) as e:
        lora.add_adapters(GPT(GPT2_TINY), TrainConfig(lora_rank=4, lora_targets='qkv,q_proj'))
    text = e.value.render(lambda k: k)
    assert text == ("train.lora_targets names 'q_proj', which is no linear layer of this model; its linear layers are "
                    'fc1, fc2, proj, qkv'), text
    cfg = resolve('tiny', sets=['train.lora_rank=4', 'parallel.tp=2', 'parallel.pp=2'])
    assert [k for k, _ in lora.lora_problems(cfg)] == ['parallel.tp', 'parallel.pp', 'init']
    assert lora.lora_problems(resolve('tiny')) == []


def test_estimate_counts_lora_and_names_its_flags():
    r = run_here('estimate', '--preset', '125m', '--lora-rank', '8', '--json')
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    full = json.loads(run_here('estimate', '--preset', '125m', '--json').stdout)
    assert d['params']['trainable'] == adapter_params(resolve('125m').model, TrainConfig(lora_rank=8))
    assert d['params']['trainable'] < full['params']['trainable'] == full['params']['total']
    assert d['memory']['optimizer'] < full['memory']['optimizer'] / 50          # Adam for the adapters alone
    bad = run_here('estimate', '--preset', '125m', '--lora-rank', '8', '--lora-targets', 'qkv,wq')
    assert bad.returncode != 0 and "--lora-targets names 'wq'" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    tp = run_here('estimate', '--preset', '125m', '--lora-rank', '8', '--tp', '2', '--gpus', '2')
    assert tp.returncode != 0 and '--tp 2: LoRA' in tp.stdout + tp.stderr, tp.stdout + tp.stderr


def test_a_lora_run_through_gptkit_train_resumes_on_its_base(tiny_data, tmp_path):
    "train.train with train.lora_rank: the checkpoints hold the adapters; a resume puts them back on the base (init)"
    from gptkit.train import loop as train
    from gptkit.train.plan import run_config
    prefix, tok = tiny_data
    sets = [*TINY_SETS, f'data.prefix={prefix}', f'data.tokenizer={tok}']
    train.train(run_config(sets=[*sets, 'train.iters=1'], out=str(tmp_path / 'base')))
    cfg = run_config(sets=[*sets, 'train.iters=3', 'train.save_interval=2', 'train.lora_rank=4'],
                     out=str(tmp_path / 'lora'), init=str(tmp_path / 'base'))
    first = train.train(cfg, stop_after=2)
    saved = read_torch_file(tmp_path / 'lora' / 'checkpoints' / 'iter_0000002' / 'mp_rank_00_model_states.pt')
    assert saved['module'] and all(lora.is_adapter(k) for k in saved['module'])
    adapters = {k: v.clone() for k, v in lora.adapter_state(first.engine.module).items()}
    second = train.train(run_config(sets=[], resume=True, out=str(tmp_path / 'lora')), resume=True)
    assert second.checkpoint.name == 'iter_0000003'
    base = ck.load_weights(tmp_path / 'base')
    now = second.engine.module.state_dict()
    assert all(torch.equal(now[k], v) for k, v in base.items())            # the base under the resumed adapters
    assert all(not torch.equal(now[k], v) for k, v in adapters.items())     # which trained on from step 2


def test_checkpoint_export_to_peft_on_the_command_line(lora_run, tmp_path):
    "`gptkit checkpoint export RUN OUT --to peft` writes peft's adapter folder; a run without adapters is refused"
    import json as _json

    from typer.testing import CliRunner

    from gptkit_cli.main import app
    _, base, run, *_ = lora_run
    r = CliRunner().invoke(app, ['checkpoint', 'export', str(run), str(tmp_path / 'peft'), '--to', 'peft'])
    assert r.exit_code == 0, r.output
    config = _json.loads((tmp_path / 'peft' / 'adapter_config.json').read_text())
    assert config['peft_type'] == 'LORA' and (tmp_path / 'peft' / 'adapter_model.safetensors').is_file()
    r = CliRunner().invoke(app, ['checkpoint', 'export', str(base), str(tmp_path / 'none'), '--to', 'peft'])
    assert r.exit_code == 1 and 'holds no LoRA adapters' in r.output and not (tmp_path / 'none').exists()
