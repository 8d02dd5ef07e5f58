"""gptkit generate: the library against plain references, the CLI's prompts, files, interactive mode and bad input."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from gptkit.inference.generator import Generator, reference_greedy
from gptkit.inference.sampling import Sampling
from gptkit_cli.main import app


def run(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


@pytest.fixture(scope='module')
def gen(tiny_checkpoint):
    return Generator.from_checkpoint(tiny_checkpoint, device='cpu')


def test_cache_and_batches_match_the_plain_loop(gen):
    prompts = ['In the beginning God', 'And', 'Thus saith the LORD of hosts, the God of Israel']
    got = gen.complete(prompts, Sampling(max_new_tokens=20, greedy=True, stop_at_eod=False))
    for p, c in zip(prompts, got):
        assert c.tokens == reference_greedy(gen.model, gen.tok.encode(p), 20)
        assert c.text == gen.tok.decode(c.tokens)


def test_sampling_never_yields_padded_ids_and_is_seeded():
    from gptkit.config.sections import ModelConfig
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import gpt2
    torch.manual_seed(0)
    tok = gpt2()
    gen = Generator(GPT(ModelConfig(layers=1, hidden=32, heads=2, seq_len=64, vocab=tok.vocab_size, dropout=0.0)), tok)
    with torch.no_grad(): gen.model.wte.weight[tok.vocab_size:] = 100.0   # padding rows that would win every draw if they had logits
    assert gen.model.wte.weight.shape[0] == 50304 > tok.vocab_size    # the embedding has Megatron's padding rows
    s = Sampling(max_new_tokens=30, temperature=3.0, seed=5, stop_at_eod=False)
    a, b = gen.complete(['And'] * 6, s), gen.complete(['And'] * 6, s)
    assert all(0 <= t < gen.tok.vocab_size for c in a for t in c.tokens)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert len({tuple(c.tokens) for c in a}) > 1                   # rows of a batch are sampled independently


def test_end_of_document_stops_a_row(gen):
    "A row whose next token is the end-of-document token stops there, and <|endoftext|> never shows in its text"
    bias = torch.zeros(gen.tok.vocab_size); bias[gen.tok.eod] = 1e4
    original = gen.model.logits
    gen.model.logits = lambda x: original(x) + bias
    try: c = gen.complete(['And', 'In the beginning'], Sampling(max_new_tokens=5, greedy=True))
    finally: del gen.model.logits
    assert [(x.tokens, x.text, x.finish_reason) for x in c] == [([gen.tok.eod], '', 'stop')] * 2


def test_cli_prompt_streams_the_greedy_text(tiny_checkpoint, gen):
    r = run('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'In the beginning', '--greedy', '--max-new-tokens', '12')
    assert r.exit_code == 0, r.output
    want = gen.complete(['In the beginning'], Sampling(max_new_tokens=12, greedy=True))[0]
    assert 'In the beginning' + want.text in r.output and f'({want.finish_reason})' in r.output


def test_cli_prompt_file_and_samples(tiny_checkpoint, tmp_path):
    f = tmp_path / 'prompts.txt'
    f.write_text('And God said\n\nIn the beginning\n')
    r = run('generate', '--checkpoint', tiny_checkpoint, '--prompt-file', f, '--num-samples', '2', '--max-new-tokens', '6', '--seed', '1')
    assert r.exit_code == 0, r.output
    assert r.output.count('sample 1') == 2 and r.output.count('sample 2') == 2
    assert f'{f} line 1' in r.output and f'{f} line 3' in r.output


def test_cli_interactive(tiny_checkpoint, gen):
    r = subprocess.run([sys.executable, '-m', 'gptkit_cli.main', 'generate', '--checkpoint', str(tiny_checkpoint), '--greedy',
                        '--max-new-tokens', '8'], input='And God said\nIn the beginning\n\n', capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for p in ('And God said', 'In the beginning'):
        assert p + gen.complete([p], Sampling(max_new_tokens=8, greedy=True))[0].text in r.stdout


@pytest.mark.parametrize('args,message', [
    (['--temperature', '0'], '--temperature must be a number greater than 0, not 0.0'),
    (['--top-p', '1.5', '--top-k', '-1'], '--top-k must be a whole number, 0 or more, not -1; --top-p must be a number in (0, 1], not 1.5'),
    (['--max-new-tokens', '0'], '--max-new-tokens must be a whole number of at least 1, not 0'),
    (['--num-samples', '0'], '--num-samples must be at least 1, not 0'),
    (['--prompt-file', 'nowhere.txt'], '--prompt-file nowhere.txt cannot be read: No such file or directory'),
])
def test_cli_bad_flags(tiny_checkpoint, args, message):
    r = run('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'x', *args)
    assert r.exit_code != 0 and message in ' '.join(r.output.split()), r.output
    assert 'Traceback' not in r.output


def test_cli_bad_checkpoints_and_prompts(tiny_checkpoint, tmp_path):
    r = run('generate', '--checkpoint', tmp_path, '--prompt', 'x')
    assert r.exit_code != 0 and 'is not a gptkit checkpoint' in r.output
    r = run('generate', '--checkpoint', tmp_path / 'missing', '--prompt', 'x')
    assert r.exit_code != 0 and 'does not exist' in r.output
    f = tmp_path / 'long.txt'
    f.write_text('short\n' + ' '.join(['word'] * 200) + '\n')
    r = run('generate', '--checkpoint', tiny_checkpoint, '--prompt-file', f)
    assert r.exit_code != 0 and f'{f} line 2 has' in ' '.join(r.output.split()) and 'reads at most 64' in r.output


def test_checkpoints_with_dropped_settings_still_load(tiny_checkpoint, tmp_path):
    "A checkpoint written by an older gptkit, with a setting that has since been removed, loads with a warning"
    from gptkit.checkpoint.checkpointing import load_model
    from gptkit.store.folders import find, manifest
    copy = tmp_path / 'old'
    shutil.copytree(tiny_checkpoint, copy)
    folder = find(copy)
    cfg = json.loads((folder / 'config.json').read_text())
    cfg['data']['num_workers'] = 2
    (folder / 'config.json').write_text(json.dumps(cfg))
    state = json.loads((folder / 'state.json').read_text())
    state['files'] = manifest(folder)
    state.pop('checksum')                                  # older versions wrote no checksum
    (folder / 'state.json').write_text(json.dumps(state))
    assert load_model(copy).config.model == load_model(tiny_checkpoint).config.model


def test_rows_near_the_context_join_and_leave_a_running_batch(gen):
    """A prompt that nearly fills the context joins a row that may generate up to the context, and a third joins after
    it left: each gets the tokens the plain loop gives, and the cache never holds more columns than the context"""
    from gptkit.inference.batching import RunningBatch
    ctx = gen.context
    text = gen.tok.encode('In the beginning God created the heaven and the earth. ' * (ctx // 4))
    prompts = {'short': text[:3], 'long': text[:ctx - 6], 'later': text[5:9]}
    s = Sampling(max_new_tokens=ctx, greedy=True, stop_at_eod=False)
    rb, got, widest = RunningBatch(gen), {}, 0
    names = dict(zip(rb.join([prompts['short']], s), ['short']))
    for step in range(3 * ctx):
        if step == 20: names.update(zip(rb.join([prompts['long']], s), ['long']))
        if step == 40: names.update(zip(rb.join([prompts['later']], s), ['later']))
        for c in rb.sample(): got.setdefault(names[c.index], []).append(c.token)
        if not rb: break
        widest = max(widest, rb.cache.max_len)
    assert widest <= ctx and not rb
    for name, p in prompts.items(): assert got[name] == reference_greedy(gen.model, p, ctx - len(p)), name
