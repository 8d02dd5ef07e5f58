"""Continued pre-training through the CLI (issue 31, item 6): a Llama 3 (scaled rotary), Qwen2 (QKV bias), Qwen3
(QK norm, wide heads) and Mistral (sliding window) checkpoint that transformers saves, imported, a corpus prepared with
its tokenizer, trained from step 0 with `gptkit train --init` (a fresh optimizer and schedule), evaluated and exported
back to a folder transformers loads with gptkit's logits; and the one-sentence refusals of --init."""
import json
import math
import shlex
from pathlib import Path

import pytest
import torch
from conftest import run_here

from gptkit.tokenizer.bpe import EOD, load_tokenizer
from gptkit.store.torch_files import read_torch_file

SIZES = dict(hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.1)
LLAMA3 = {'rope_type': 'llama3', 'rope_theta': 5e5, 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
          'original_max_position_embeddings': 16}
FAMILIES = {'llama3': ('LlamaConfig', dict(rope_parameters=LLAMA3, tie_word_embeddings=False)),
            'qwen2': ('Qwen2Config', dict(tie_word_embeddings=True)),
            'qwen3': ('Qwen3Config', dict(head_dim=16, tie_word_embeddings=False)),
            'mistral': ('MistralConfig', dict(sliding_window=6, tie_word_embeddings=False))}
# Qwen2.5 and Qwen3 publish more embedding rows than their tokenizers have entries (151,936 for 151,665): so does qwen2
EXTRA_ROWS = {'qwen2': 40}
ITERS, WARMUP, LR = 8, 4, 3e-3
TRAIN = ['--iters', ITERS, *(a for s in ('train.micro_batch=4', 'train.global_batch=8', f'optim.lr={LR}',
                                         f'optim.warmup={WARMUP}', 'train.log_interval=1', 'train.eval_interval=4',
                                         'train.eval_iters=1', 'train.precision=fp32') for a in ('--set', s))]


def gptkit(*args):
    r = run_here(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def refused(r, *said):
    "A one-sentence refusal (exit 1 or 2, no traceback) that says each of `said`"
    text = ' '.join((r.stdout + r.stderr).split())
    assert r.returncode in (1, 2) and 'Traceback' not in r.stdout + r.stderr, r.stdout + r.stderr
    assert all(s in text for s in said), text


def make_hf(family: str, tok_dir: str, folder):
    "A random model of `family` with non-trivial norms and biases, saved by transformers with a fast tokenizer"
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    transformers.logging.set_verbosity_error()
    tok = load_tokenizer(tok_dir)
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(vocab_size=tok.vocab_size + EXTRA_ROWS.get(family, 0),
                                              bos_token_id=tok.eod, eos_token_id=tok.eod, **SIZES, **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'norm' in n or n.endswith('bias'):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_file=f'{tok_dir}/tokenizer.json', bos_token=EOD, eos_token=EOD,
                            unk_token=EOD).save_pretrained(folder)
    return model


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    "(training documents as JSON Lines, held-out text): chapters of the built-in KJV, the held-out ones later"
    from gptkit.data.corpus import read_documents
    d = tmp_path_factory.mktemp('corpus')
    docs = [doc.text for _, doc in zip(range(80), read_documents(['builtin:kjv']))]
    (d / 'train.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs[:40]))
    (d / 'held_out.txt').write_text(docs[-1][:1500])
    return d / 'train.jsonl', d / 'held_out.txt'


def held_out_loss(run, text) -> float:
    return json.loads(gptkit('eval', '--checkpoint', run, '--text', text, '--json'))['perplexity']['loss']


@pytest.fixture(scope='module', params=list(FAMILIES))
def workflow(request, tiny_data, corpus, tmp_path_factory):
    "The whole workflow on one family, step by step through the CLI; what each step left"
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf(request.param, tiny_data[1], d / 'hf')
    gptkit('checkpoint', 'import', d / 'hf', d / 'imported', '--from', 'hf')
    gptkit('data', 'prepare', '-i', corpus[0], '--output-prefix', d / 'data' / 'corpus',
           '--tokenizer', d / 'imported' / 'tokenizer')
    before = held_out_loss(d / 'imported', corpus[1])
    said = gptkit('train', '--init', d / 'imported', '--data', d / 'data' / 'corpus_text_document',
                  '--out', d / 'continued', *TRAIN)
    after = held_out_loss(d / 'continued', corpus[1])
    gptkit('checkpoint', 'export', d / 'continued', d / 'export', '--to', 'hf')
    return dict(family=request.param, hf=hf, dir=d, said=' '.join(said.split()), before=before, after=after)


def test_training_starts_at_step_0_with_a_fresh_optimizer_and_schedule(workflow):
    d = workflow['dir']
    assert f'weights from {d}/imported/checkpoints/iter_0000000: step 0, a fresh optimizer' in workflow['said']
    metrics = [json.loads(line) for line in (d / 'continued' / 'metrics.jsonl').read_text().splitlines()]
    steps = [m for m in metrics if m['kind'] == 'train']
    assert [m['iteration'] for m in steps] == list(range(1, ITERS + 1))
    # the lr after step 1 of this run's warm-up (DeepSpeed's scheduler has stepped): 2 of 4 warm-up steps to LR
    assert steps[0]['lr'] == pytest.approx(LR * 2 / WARMUP) and steps[WARMUP - 1]['lr'] == pytest.approx(LR)
    last = d / 'continued' / 'checkpoints' / f'iter_{ITERS:07d}'
    states = read_torch_file(last / 'mp_rank_00_model_states.pt')
    assert {int(s['step']) for s in states['optimizer']['state'].values()} == {ITERS}   # AdamW: this run's steps
    assert states['lr_scheduler']['last_epoch'] == ITERS and states['lr_scheduler']['base_lrs'][0] == LR
    imported = json.loads((d / 'imported' / 'config.json').read_text())
    config = json.loads((last / 'config.json').read_text())
    assert config['model'] == imported['model']                                   # the checkpoint's model
    assert config['model']['vocab'] == workflow['hf'].config.vocab_size          # its rows, more than the tokens too
    assert config['init'] == str(d / 'imported' / 'checkpoints' / 'iter_0000000')  # and where it began, recorded
    assert config['data']['tokenizer'] == str(d / 'imported' / 'checkpoints' / 'iter_0000000' / 'tokenizer')


def test_the_held_out_loss_goes_down(workflow):
    print(f"{workflow['family']}: held-out loss {workflow['before']:.3f} -> {workflow['after']:.3f}")
    assert math.isfinite(workflow['before']) and workflow['after'] < workflow['before'] - 0.05, workflow


def test_the_export_is_the_same_family_with_gptkit_logits(workflow):
    from transformers import AutoModelForCausalLM

    from gptkit.checkpoint.checkpointing import load_model
    hf, d = workflow['hf'], workflow['dir']
    back = AutoModelForCausalLM.from_pretrained(d / 'export').eval()
    assert type(back) is type(hf) and back.config.model_type == hf.config.model_type
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = back(ids).logits
        ours = load_model(d / 'continued').model(ids)
        assert (got - ours).abs().max().item() <= 1e-4
        assert (got - hf(ids).logits).abs().max().item() > 1e-3               # trained: not the imported weights


@pytest.fixture(scope='module')
def small(tiny_data, tiny_checkpoint, tmp_path_factory):
    "A run continued for 3 steps from the tiny GPT checkpoint, on the tiny KJV data (prepared with its tokenizer)"
    d = tmp_path_factory.mktemp('small')
    gptkit('train', '--init', tiny_checkpoint, '--data', tiny_data[0], '--out', d / 'a', '--iters', 3,
           '--set', 'train.global_batch=4', '--set', 'train.micro_batch=4', '--set', 'train.eval_iters=1',
           '--set', 'train.log_interval=1', '--set', 'train.precision=fp32')    # compared with runs in other layouts
    return d


def test_a_trained_run_starts_another_fresh_and_the_new_run_resumes_as_usual(small, tiny_data):
    "Its optimizer, schedule and data position are not taken: AdamW counts the new run's steps alone"
    common = ['--data', tiny_data[0], '--set', 'train.precision=fp32', '--set', 'train.global_batch=4', '--set', 'train.micro_batch=4',
              '--set', 'train.eval_iters=1', '--set', 'optim.warmup=1']
    gptkit('train', '--init', small / 'a', '--out', small / 'b', '--iters', 2, *common)
    states = read_torch_file(small / 'b' / 'checkpoints' / 'iter_0000002' / 'mp_rank_00_model_states.pt')
    assert {int(s['step']) for s in states['optimizer']['state'].values()} == {2}
    assert (states['iteration'], states['consumed_samples']) == (2, 8)
    said = ' '.join(gptkit('train', '--resume', '--out', small / 'b', '--iters', 3).split())
    assert 'weights from' not in said and 'resumed from' in said and 'iter_0000002 (step 2)' in said
    states = read_torch_file(small / 'b' / 'checkpoints' / 'iter_0000003' / 'mp_rank_00_model_states.pt')
    assert {int(s['step']) for s in states['optimizer']['state'].values()} == {3}


def test_init_refusals_say_why_in_one_sentence(small, tiny_data, tiny_checkpoint, tmp_path):
    data = ['--data', tiny_data[0]]
    (tmp_path / 'empty').mkdir()
    refused(run_here('train', '--init', tmp_path / 'empty', *data, '--out', tmp_path / 'x'),
            '--init names no checkpoint to start from', 'is not a gptkit checkpoint')
    (tmp_path / 'hf').mkdir()
    (tmp_path / 'hf' / 'config.json').write_text('{"model_type": "llama"}')
    refused(run_here('train', '--init', tmp_path / 'hf', *data, '--out', tmp_path / 'x'),
            'a Hugging Face folder: import it first, gptkit checkpoint import')
    refused(run_here('train', '--init', tiny_checkpoint, *data, '--out', tmp_path / 'x', '--set', 'model.hidden=64'),
            f'--init {tiny_checkpoint}/checkpoints/iter_0000000 holds another model than this run describes',
            'model.hidden 32 there, 64 here from --set model.hidden')
    refused(run_here('train', '--init', tiny_checkpoint, *data, '--out', tmp_path / 'x', '--preset', '125m'),
            'model.layers 2 there, 12 here from --preset 125m')
    refused(run_here('train', '--init', tiny_checkpoint, *data, '--out', tmp_path / 'x', '--tokenizer', 'gpt2'),
            '--tokenizer gpt2 is not the tokenizer', '(50,257 entries, the model 512)')
    refused(run_here('train', '--init', tiny_checkpoint, *data, '--out', small / 'a'),
            'already holds checkpoints', 'resume them with --resume or choose another --out')
    refused(run_here('train', '--init', tiny_checkpoint, '--resume', '--out', small / 'a'),
            "--init starts a new run from a checkpoint's weights at step 0, and --resume continues")
    refused(run_here('train', '--init', '', *data, '--out', tmp_path / 'x'), '--init needs a checkpoint folder')
    (tmp_path / 'run.yaml').write_text(f'init: {tiny_checkpoint}\nmodel:\n  layers: 3\n')    # a file's init
    refused(run_here('train', '--config', tmp_path / 'run.yaml', *data, '--out', tmp_path / 'x'),
            f"(model.layers 2 there, 3 here from --config {tmp_path / 'run.yaml'}): the model comes from")
    assert not (tmp_path / 'x').exists()


def test_data_prepared_with_another_tokenizer_is_refused(tiny_checkpoint, corpus, tmp_path):
    gptkit('data', 'prepare', '-i', corpus[0], '--output-prefix', tmp_path / 'gpt2', '--tokenizer', 'gpt2')
    refused(run_here('train', '--init', tiny_checkpoint, '--data', tmp_path / 'gpt2_text_document',
                     '--out', tmp_path / 'x'),
            'gpt2_text_document was prepared with the tokenizer gpt2 (50257 entries and end of document 50256, not 512',
            'prepare it again with gptkit data prepare --tokenizer')
    assert not (tmp_path / 'x').exists()


def readme_commands() -> list[list[str]]:
    "The gptkit command lines of the README's continued pre-training section: continuation lines joined, comments cut"
    text = (Path(__file__).resolve().parents[1] / 'README.md').read_text(encoding='utf-8')
    section = text.split('## Continue pre-training a Llama, Qwen or Mistral checkpoint\n')[1]
    block = section.split('```sh\n')[1].split('```')[0].replace('\\\n', ' ')
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith('gptkit ')]


def test_the_readme_commands_are_the_workflow_tested_here_and_parse():
    "The steps the fixture above runs, in its order, each command's options known and every --set a real setting"
    from gptkit.config.run import resolve
    commands = readme_commands()
    assert [c[1:3] for c in commands] == [['checkpoint', 'import'], ['data', 'prepare'], ['eval', '--checkpoint'],
                                         ['train', '--init'], ['eval', '--checkpoint'], ['checkpoint', 'export']]
    for c in commands:
        r = run_here(*c[1:], '--help')                  # an unknown option fails before --help is acted on
        assert r.returncode == 0 and 'Usage:' in r.stdout, (c, r.stdout + r.stderr)
    train = commands[3]
    sets = [train[i + 1] for i, a in enumerate(train) if a == '--set']
    assert len(sets) == 5 and resolve('tiny', sets=sets).model.seq_len == 4096


def test_the_weights_reach_a_tensor_parallel_run(small, tiny_data, tiny_checkpoint):
    "Loaded before the model is split: two tensor-parallel processes start from the same loss as one process"
    gptkit('train', '--init', tiny_checkpoint, '--data', tiny_data[0], '--out', small / 'tp2', '--iters', 1,
           '--tp', 2, '--nproc', 2, '--set', 'train.global_batch=4', '--set', 'train.micro_batch=4',
           '--set', 'train.eval_iters=1', '--set', 'train.log_interval=1', '--set', 'train.precision=fp32')
    first = [json.loads((small / run / 'metrics.jsonl').read_text().splitlines()[0]) for run in ('a', 'tp2')]
    assert first[0]['iteration'] == first[1]['iteration'] == 1
    assert first[1]['loss'] == pytest.approx(first[0]['loss'], abs=1e-5)


def test_the_run_records_its_start_checkpoint_whole(tiny_checkpoint, tiny_data, tmp_path, monkeypatch):
    "--init given relative to here: the run's config names it absolutely (a LoRA run reads its base from there later)"
    from gptkit.train.plan import run_config
    monkeypatch.chdir(tiny_checkpoint.parent)
    cfg = run_config(sets=[f'data.prefix={tiny_data[0]}'], init=tiny_checkpoint.name, out=str(tmp_path / 'run'))
    assert Path(cfg.init).is_absolute() and Path(cfg.init).is_relative_to(tiny_checkpoint.resolve())
