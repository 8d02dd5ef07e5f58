"""Issue 51, items 1 and 2: an imported model's context capacity is not its training length (import keeps it,
`train --init` trains at a stated default or the length given, export writes it back, `eval --seq-len` compares models
in the same windows), and an import/export round trip of every family gives back transformers' config"""
import inspect
import json
from pathlib import Path

import pytest
import torch

from gptkit.interop import hf as interop
from gptkit.checkpoint.checkpointing import read_config
from gptkit.errors import ConfigError
from gptkit.train.plan import INIT_SEQ_LEN, run_config
from gptkit.tokenizer.bpe import EOD

SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {'rope_type': 'llama3', 'rope_theta': 5e5, 'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
          'original_max_position_embeddings': 8192}
# the eight families gptkit imports, each in its own configuration: the ids of the Mistral (bos 1, eos 2, no
# window: what a Llama computes), Llama 3.2's context of 131,072 positions, OLMoE's pad id
FAMILIES = {'gpt2': ('GPT2Config', dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=3,
                                        eos_token_id=4)),
            'llama': ('LlamaConfig', dict(SIZES, max_position_embeddings=131072, rope_parameters=LLAMA3,
                                          bos_token_id=5, eos_token_id=6, tie_word_embeddings=True)),
            'mistral': ('MistralConfig', dict(SIZES, sliding_window=None, bos_token_id=1, eos_token_id=2)),
            'qwen2': ('Qwen2Config', dict(SIZES, bos_token_id=7, eos_token_id=8)),
            'qwen3': ('Qwen3Config', dict(SIZES, head_dim=16, bos_token_id=7, eos_token_id=8)),
            'mixtral': ('MixtralConfig', dict(SIZES, num_local_experts=4, bos_token_id=1, eos_token_id=2)),
            'qwen3_moe': ('Qwen3MoeConfig', dict(SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                 bos_token_id=7, eos_token_id=8)),
            'olmoe': ('OlmoeConfig', dict(SIZES, num_experts=4, num_experts_per_tok=2, pad_token_id=1,
                                          bos_token_id=None, eos_token_id=9))}
# keys of the config classes' signatures that a round trip may change, and why: the class export names (a config
# made in code has none), the dtype of the weights as written
EXCEPTIONS = {'architectures': 'export names the class that loads the weights',
              'dtype': "the weights' dtype as export writes them"}


def hf_folder(name: str, tok_dir: str, folder: Path):
    "A random model of family `name` saved by transformers (config written by save_pretrained), with a tokenizer"
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cls)(vocab_size=512, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / 'tokenizer.json'), bos_token=EOD, eos_token=EOD,
                            unk_token=EOD).save_pretrained(folder)
    return cfg


def read_keys(cfg) -> list[str]:
    "The keys transformers' config class reads: its __init__ signature"
    return [k for k in inspect.signature(type(cfg).__init__).parameters if k not in ('self', 'kwargs')]


@pytest.fixture(scope='module')
def imported(tiny_data, tmp_path_factory):
    "family name -> (transformers' config, its folder, the run imported from it, that run exported back)"
    d = tmp_path_factory.mktemp('families')
    out = {}
    for name in FAMILIES:
        cfg = hf_folder(name, tiny_data[1], d / name / 'hf')
        run = interop.import_hf(d / name / 'hf', d / name / 'run')
        out[name] = cfg, d / name / 'hf', run, interop.export_hf(run, d / name / 'back')
    return out


@pytest.mark.parametrize('name', list(FAMILIES))
def test_round_trip_gives_back_every_key_transformers_reads(imported, name):
    import transformers
    cfg, hf, _, back = imported[name]
    want = json.loads((hf / 'config.json').read_text())
    got = json.loads((back / 'config.json').read_text())
    loaded = transformers.AutoConfig.from_pretrained(back).to_dict()
    wrong = {k: (cfg.to_dict().get(k), loaded.get(k)) for k in read_keys(cfg)
             if k not in EXCEPTIONS and cfg.to_dict().get(k) != loaded.get(k)}
    assert not wrong, wrong
    assert got['model_type'] == want['model_type'] and got['architectures'] == want['architectures']
    for k in ('bos_token_id', 'eos_token_id', 'pad_token_id'):
        assert got.get(k) == want.get(k), k


def test_import_keeps_the_capacity_and_init_trains_at_a_stated_length(imported, tiny_data, tmp_path):
    run = imported['llama'][2]
    m = read_config(run).model
    assert (m.seq_len, m.positions) == (131072, 131072)      # as transformers states it: the capacity
    cfg = run_config(init=run, out=str(tmp_path / 'a'))
    assert (cfg.model.seq_len, cfg.model.positions) == (INIT_SEQ_LEN, 131072)
    cfg = run_config(init=run, sets=['model.seq_len=256'], out=str(tmp_path / 'b'))
    assert (cfg.model.seq_len, cfg.model.positions) == (256, 131072)
    cfg = run_config(init=run, sets=['model.seq_len=200000'], out=str(tmp_path / 'c'))
    assert cfg.model.positions == 200000           # rotary positions trained beyond the capacity: it grows


def test_learned_positions_train_shorter_but_never_beyond_their_table(imported, tmp_path):
    run = imported['gpt2'][2]
    cfg = run_config(init=run, sets=['model.seq_len=32'], out=str(tmp_path / 'a'))
    assert (cfg.model.seq_len, cfg.model.positions) == (32, 128)
    with pytest.raises(ConfigError, match='256 is more than the 128 rows of the learned position table'):
        run_config(init=run, sets=['model.seq_len=256'], out=str(tmp_path / 'b'))


def test_export_after_training_shorter_keeps_the_capacity(imported, tiny_data, tmp_path):
    "A run from the import at seq_len 32 (its config as `train --init` saves it) exports the 128 positions it holds"
    import dataclasses

    from gptkit.checkpoint.checkpointing import checkpoint_parts
    run = imported['gpt2'][2]
    cfg = run_config(init=run, sets=['model.seq_len=32'], out=str(tmp_path / 'a'))
    _, _, _, weights, tok = checkpoint_parts(run)
    trained = interop.write_run(weights, dataclasses.replace(cfg.model, vocab=read_config(run).model.vocab), tok,
                                tmp_path / 'trained', 'the run')
    back = interop.export_hf(trained, tmp_path / 'hf')
    got = json.loads((back / 'config.json').read_text())
    assert (got['n_positions'], got['bos_token_id'], got['eos_token_id']) == (128, 3, 4)
    assert json.loads((back / 'tokenizer_config.json').read_text())['model_max_length'] == 128


def test_eval_seq_len_sets_the_window(imported, tmp_path):
    from typer.testing import CliRunner

    from gptkit.eval.perplexity import evaluate
    from gptkit_cli.main import app
    run = imported['gpt2'][2]
    text = tmp_path / 'a.txt'
    text.write_text('In the beginning God created the heaven and the earth. ' * 20)
    r = evaluate(run, text, seq_len=16, batch_size=64)
    assert r.perplexity.context == 16
    with pytest.raises(ConfigError, match='between 1 and the 128 positions'):
        evaluate(run, text, seq_len=129)
    res = CliRunner().invoke(app, ['eval', '--checkpoint', str(run), '--text', str(text), '--seq-len', '16', '--json'])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)['perplexity']['context'] == 16
