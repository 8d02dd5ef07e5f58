"""Reading every kind of input, and every kind of bad input, without crashing or losing count."""
import gzip
import json

import pytest
import zstandard
from hypothesis import given, settings, strategies as st

from gptkit.config import DataError
from gptkit.data.corpus import BUILTIN, Tally, clean_text, read_documents


def test_a_single_100mb_line(tmp_path):
    text = 'x' * (100 * 2**20)
    (tmp_path / 'big.jsonl').write_text(json.dumps({'text': text}) + '\n' + json.dumps({'text': 'small'}) + '\n')
    t = Tally()
    lengths = [len(d.text) for d in read_documents([tmp_path / 'big.jsonl'], t)]
    assert lengths == [len(text), 5] and not t.problems


def test_zstd_and_gzip_and_directories(tmp_path):
    docs = [{'text': f'doc {i}'} for i in range(10)]
    raw = ''.join(json.dumps(d) + '\n' for d in docs).encode()
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'a.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / 'sub' / 'b.jsonl.gz').write_bytes(gzip.compress(raw))
    (tmp_path / 'sub' / 'notes.md').write_text('ignored: not a known suffix')
    t = Tally()
    got = [d.text for d in read_documents([tmp_path], t)]
    assert got == [d['text'] for d in docs] * 2 and not t.problems


@pytest.mark.parametrize('content,reason', [
    (b'{"text": "ok"}\n{broken\n', 'invalid_json'),
    (b'{"text": "ok"}\n{"content": "no text key"}\n', 'missing_text_key'),
    (b'{"text": "ok"}\n{"text": 5}\n', 'missing_text_key'),
    (b'{"text": "ok"}\n{"text": "bad \xff byte"}\n', 'invalid_utf8'),
])
def test_bad_lines_are_counted_and_strict_names_the_line(tmp_path, content, reason):
    (tmp_path / 'd.jsonl').write_bytes(content)
    t = Tally()
    list(read_documents([tmp_path / 'd.jsonl'], t))
    assert t.problems == {reason: 1} and t.examples[0].startswith(f'{tmp_path / "d.jsonl"}:2: ')
    with pytest.raises(DataError, match=r'd\.jsonl:2: '):
        list(read_documents([tmp_path / 'd.jsonl'], Tally(strict=True)))


def test_empty_and_unreadable_files(tmp_path):
    (tmp_path / 'empty.jsonl').write_bytes(b'\n\n')
    (tmp_path / 'bad.jsonl.zst').write_bytes(b'not zstd at all')
    t = Tally()
    assert list(read_documents([tmp_path / 'empty.jsonl', tmp_path / 'bad.jsonl.zst'], t)) == []
    assert t.problems == {'empty_file': 1, 'unreadable_file': 1}


def test_missing_inputs_and_unknown_builtins(tmp_path):
    with pytest.raises(DataError, match='no such file'): list(read_documents([tmp_path / 'nope.jsonl']))
    with pytest.raises(DataError, match='builtin:nope: no such built-in corpus'): list(read_documents(['builtin:nope']))


@pytest.mark.parametrize('name', list(BUILTIN))
def test_builtin_corpora_read_cleanly(name):
    t = Tally()
    docs = list(read_documents([f'builtin:{name}'], t))
    assert docs and not t.problems and all(d.text.strip() for d in docs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1), max_size=20))
def test_jsonl_round_trip(tmp_path_factory, texts):
    p = tmp_path_factory.mktemp('j') / 'd.jsonl'
    p.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts), encoding='utf-8')
    assert [d.text for d in read_documents([p])] == texts


@given(st.text())
def test_clean_text_is_idempotent(text):
    assert clean_text(clean_text(text)) == clean_text(text)
