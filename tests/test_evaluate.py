"""Evaluation: windows against a one-token-at-a-time reference, Megatron's word-level perplexity, cloze accuracy with known
answers, and `gptkit eval` (table, --json, bad input)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SETS, torch_threads
from typer.testing import CliRunner

import gptkit.eval.perplexity as ev
from gptkit.checkpoint.checkpointing import load_model
from gptkit.data.corpus import HELD_OUT, read_documents
from gptkit.config.run import resolve
from gptkit_cli.main import app

CLOZE = Path(__file__).parent / 'data' / 'cloze_kjv.jsonl'
runner = CliRunner()


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    with torch_threads(1): yield


@pytest.fixture(scope='module')
def run(tiny_data, tmp_path_factory):
    "A run folder trained for a few steps on the KJV (context 32, vocabulary 512)"
    from gptkit.train.loop import train
    prefix, tok = tiny_data
    out = tmp_path_factory.mktemp('eval_run')
    train(resolve(sets=TINY_SETS + ['train.iters=8'], overrides={'data': {'prefix': prefix, 'tokenizer': tok}}, out=str(out)))
    return out


@pytest.fixture(scope='module')
def loaded(run):
    return load_model(run)


@pytest.fixture(scope='module')
def held_tokens(loaded):
    "About 300 tokens of the held-out text"
    text = next(iter(read_documents([HELD_OUT]))).text[:1200]
    return loaded.tokenizer.encode(text)[:300]


def test_windows_score_every_target_exactly_once():
    for n in range(0, 70, 3):
        for context in (1, 4, 32):
            for stride in sorted({s for s in (1, 2, 3, context // 2, context) if 1 <= s <= context}):
                ws = ev.windows(n, context, stride)
                got = [w.start + 1 + j for w in ws for j in range(w.first, w.stop - w.start)]
                assert got == list(range(1, n)), (n, context, stride)
                assert all(0 < w.stop - w.start <= context for w in ws)
                if stride == context: assert all(w.first == 0 and w.start % context == 0 for w in ws)
                else: assert all(w.stop - w.start - w.first <= stride for w in ws[1:])


def reference(model, toks, context, stride):
    "Summed loss, one forward pass per target, each with the context its window gives it"
    total = 0.0
    for t in range(1, len(toks)):
        start = 0 if t <= context else -(-(t - context) // stride) * stride
        assert context - stride < t - start <= context or t <= context
        with torch.no_grad(): logits = model(torch.tensor([toks[start:t]]))[0, -1]
        total += F.cross_entropy(logits.float(), torch.tensor(toks[t])).item()
    return total


@pytest.mark.parametrize('stride,batch', [(1, 7), (5, 3), (20, 8), (32, 2)])
def test_batched_windows_equal_a_one_token_at_a_time_reference(loaded, held_tokens, stride, batch):
    toks = held_tokens[:120]
    total, scored, nw = ev.token_losses(loaded.model, toks, 32, stride, batch)
    assert scored == len(toks) - 1 and nw == len(ev.windows(len(toks), 32, stride))
    assert total == pytest.approx(reference(loaded.model, toks, 32, stride), rel=1e-5)


def test_stride_equal_to_context_is_non_overlapping_chunks(loaded, held_tokens):
    from gptkit.eval.perplexity import text_loss
    toks = held_tokens[:32 * 9 + 1]
    total, scored, nw = ev.token_losses(loaded.model, toks, 32)
    assert (scored, nw) == (32 * 9, 9)
    assert total / scored == pytest.approx(text_loss(loaded.model, toks, 32), rel=1e-6)
    assert ev.token_losses(loaded.model, toks, 32, 4)[1:] == (scored, 1 + 8 * 8)     # same targets, 4 new per window


def test_one_window_equals_cross_entropy_computed_directly(loaded, held_tokens):
    toks = held_tokens[:25]
    total, scored, nw = ev.token_losses(loaded.model, toks, 32, 3)
    with torch.no_grad(): direct = F.cross_entropy(loaded.model(torch.tensor([toks[:-1]]))[0], torch.tensor(toks[1:]))
    assert (scored, nw) == (24, 1) and total / scored == pytest.approx(direct.item(), rel=1e-6)


def test_word_level_perplexity_is_megatrons_adjusted_perplexity(run, loaded, tmp_path):
    text = 'In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void.\n'
    f = tmp_path / 'a.txt'; f.write_text(text)
    r = ev.evaluate(run, f, stride=8)
    p = r.perplexity
    tok = loaded.tokenizer
    assert (p.documents, p.words, p.tokens) == (1, len(text.split()), len(tok.encode(text)) + 1)   # + end of document
    total, scored, _ = ev.token_losses(loaded.model, tok.encode(text) + [tok.eod], 32, 8)
    assert p.scored == scored and p.loss == pytest.approx(total / scored)
    assert p.perplexity == pytest.approx(math.exp(total / scored))
    assert p.word_perplexity == pytest.approx(math.exp(total / (p.words - 1)))
    assert ev.word_perplexity(2.0, 11, 6) == pytest.approx(math.exp(4.0)) and ev.word_perplexity(2.0, 3, 1) is None


def test_jsonl_documents_are_joined_with_end_of_document(run, loaded, tmp_path):
    f = tmp_path / 'd.jsonl'
    f.write_text(json.dumps({'body': 'The LORD is my shepherd'}) + '\n\n' + json.dumps({'body': 'I shall not want'}) + '\n')
    p = ev.evaluate(run, f, text_key='body').perplexity
    tok = loaded.tokenizer
    stream = tok.encode('The LORD is my shepherd') + [tok.eod] + tok.encode('I shall not want') + [tok.eod]
    total, scored, _ = ev.token_losses(loaded.model, stream, 32)
    assert (p.documents, p.words, p.tokens) == (2, 9, len(stream)) and p.loss == pytest.approx(total / scored)


class Bigram(torch.nn.Module):
    "Greedy prediction depends only on the current token: nxt[id]"
    def __init__(self, nxt: dict, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))
        with torch.no_grad():
            for a, b in nxt.items(): self.table[a, b] = 5.0
    def forward(self, ids): return self.table[ids]


def test_cloze_accuracy_with_a_known_answer(loaded):
    tok = loaded.tokenizer
    exs = ev.read_cloze(tok, CLOZE)
    assert len(exs) == 24 and tok.decode(exs[0].target) == ' earth' and tok.decode(exs[0].context).endswith('the')
    told, right = {}, []
    for i, ex in enumerate(exs):                      # tell the model the answers of examples whose pairs do not conflict
        seq = ex.context + ex.target
        pairs = {seq[t - 1]: seq[t] for t in range(len(ex.context), len(seq))}
        if i % 2 == 0 and all(told.get(a, b) == b for a, b in pairs.items()) and len(pairs) == len(ex.target):
            told.update(pairs); right.append(i)
    model = Bigram(told, tok.vocab_size)
    want = [i for i, ex in enumerate(exs)
            if all(told.get(a) == b for a, b in zip((ex.context + ex.target)[len(ex.context) - 1:-1], ex.target))]
    assert set(right) <= set(want) and len(right) >= 6
    for batch in (1, 5, 24):
        c = ev.cloze_accuracy(model, exs, 32, batch)
        assert (c.examples, c.correct) == (24, len(want)) and c.accuracy == pytest.approx(len(want) / 24)


def test_cloze_accuracy_equals_greedy_decoding_one_token_at_a_time(loaded):
    model, tok = loaded.model, loaded.tokenizer

    def greedy(prompt, n):
        ids = list(prompt[-(32 + 1 - n):])
        for _ in range(n):
            with torch.no_grad(): ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[-n:]

    exs = ev.read_cloze(tok, CLOZE)
    for ex in exs[::3]: ex.target = greedy(ex.context, len(ex.target))    # these are right by construction
    want = sum(greedy(ex.context, len(ex.target)) == ex.target for ex in exs)
    assert want >= 8
    assert ev.cloze_accuracy(model, exs, 32, 5).correct == want


def test_progress_reports_every_batch(run, tmp_path):
    seen = []
    f = tmp_path / 'a.txt'; f.write_text('And God said, Let there be light: and there was light. ' * 12)
    ev.evaluate(run, f, cloze=CLOZE, stride=16, batch_size=4, progress=lambda *a: seen.append(a))
    ppl = [a for a in seen if a[0] == 'perplexity']
    assert ppl[-1][1] == ppl[-1][2] and [a[1] for a in ppl] == sorted(a[1] for a in ppl)
    assert [a for a in seen if a[0] == 'cloze'] == [('cloze', n, 24) for n in (4, 8, 12, 16, 20, 24)]


def cli(*args):
    return runner.invoke(app, ['eval', *map(str, args)])


def test_cli_table_and_json(run, tmp_path):
    f = tmp_path / 'a.txt'; f.write_text('And God said, Let there be light: and there was light. ' * 20)
    r = cli('--checkpoint', run, '--text', f, '--lambada', CLOZE, '--stride', 16)
    assert r.exit_code == 0, r.output
    shown = ' '.join(r.stdout.split())
    for row in ('word perplexity', 'perplexity', 'loss', 'cloze accuracy', 'of 24 last words exact', 'tokens scored', 'stride 16', 'step 8'):
        assert row in shown, row
    r = cli('--checkpoint', run, '--text', f, '--lambada', CLOZE, '--stride', 16, '--json')
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)                                       # stdout is JSON and nothing else
    want = ev.evaluate(run, f, cloze=CLOZE, stride=16).to_dict()
    assert got['perplexity']['loss'] == pytest.approx(want['perplexity']['loss'], rel=1e-6)
    assert got['cloze'] | {'seconds': 0} == want['cloze'] | {'seconds': 0}
    assert got['iteration'] == 8 and got['perplexity']['stride'] == 16 and got['perplexity']['context'] == 32
    assert f'{got["perplexity"]["word_perplexity"]:,.2f}' in cli('--checkpoint', run, '--text', f, '--stride', 16).stdout
    assert f'{got["cloze"]["accuracy"]:.2%}' in shown


def test_cli_defaults_to_the_held_out_text(run):
    r = cli('--checkpoint', run, '--max-documents', 1, '--batch-size', 64, '--json')
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)['perplexity']
    first = next(iter(read_documents([HELD_OUT]))).text
    assert p['source'] == HELD_OUT and p['documents'] == 1 and p['words'] == len(first.split()) and p['stride'] == 32
    r = cli('--checkpoint', run, '--no-perplexity', '--lambada', CLOZE, '--json')
    assert r.exit_code == 0 and json.loads(r.stdout)['perplexity'] is None


@pytest.mark.parametrize('make,args,message', [
    (None, ['--text', '{d}/missing.txt'], 'missing.txt: no such file'),
    ('empty.txt', ['--text', '{d}/empty.txt'], 'empty.txt holds no text'),
    ('bad.jsonl', ['--jsonl', '{d}/bad.jsonl'], "bad.jsonl:2: no string under the key 'text'"),
    ('bad.jsonl', ['--lambada', '{d}/bad.jsonl'], "bad.jsonl:2: no string under the key 'text'"),
    ('broken.jsonl', ['--jsonl', '{d}/broken.jsonl'], 'broken.jsonl:1: not valid JSON'),
    ('one.jsonl', ['--lambada', '{d}/one.jsonl', '--no-perplexity'], 'one.jsonl:2: a cloze example needs a context and a last word'),
    (None, ['--stride', '0'], '--stride must be between 1 and the context of 32 tokens, not 0'),
    (None, ['--stride', '33'], '--stride must be between 1 and the context of 32 tokens, not 33'),
    (None, ['--batch-size', '0'], '--batch-size must be a positive number'),
    (None, ['--max-documents', '0'], '--max-documents must be a positive number'),
    ('empty.txt', ['--text', '{d}/empty.txt', '--jsonl', '{d}/empty.txt'], '--text and --jsonl both name a text'),
    (None, ['--no-perplexity'], '--lambada is needed with --no-perplexity'),
])
def test_cli_bad_input_is_one_sentence_without_traceback(run, tmp_path, make, args, message):
    files = {'empty.txt': ' \n\n', 'bad.jsonl': '{"text": "a b"}\n{"body": "c d"}\n', 'broken.jsonl': '{"text": \n',
             'one.jsonl': '{"text": "a b"}\n{"text": "alone"}\n'}
    if make: (tmp_path / make).write_text(files[make])
    r = cli('--checkpoint', run, '--max-documents', 1, *[a.format(d=tmp_path) for a in args])
    assert r.exit_code != 0
    assert message in r.output and 'Traceback' not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_cli_path_that_is_not_a_checkpoint(tmp_path):
    for path, message in ((tmp_path, 'is not a gptkit checkpoint'), (tmp_path / 'nowhere', 'does not exist')):
        r = cli('--checkpoint', path)
        assert r.exit_code == 1 and message in r.output and 'Traceback' not in r.output, r.output


def test_eval_help_imports_nothing_heavy():
    code = ('import sys; from gptkit_cli.main import app\n'
            'try: app(["eval", "--help"])\nexcept SystemExit: pass\n'
            'print("HEAVY=" + ",".join(m for m in ("torch", "deepspeed", "tokenizers", "numpy") if m in sys.modules))')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == 'HEAVY=' and '--lambada' in r.stdout
