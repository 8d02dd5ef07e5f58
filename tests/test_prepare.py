"""prepare: the same bytes as a plain one-document-at-a-time encoding, and nothing half-written on interruption."""
import json

import pytest

from gptkit.data.corpus import read_documents
from gptkit.data.indexed import IndexedDataset, IndexedWriter
from gptkit.data.prepare import PrepareConfig, prepare
from gptkit.tokenizer import gpt2


def test_same_bytes_as_plain_encoding(tmp_path):
    docs = [d.text for d in read_documents(['builtin:kjv', 'builtin:milton'])]
    (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
    res = prepare(PrepareConfig((str(tmp_path / 'in.jsonl'),), str(tmp_path / 'fast'), clean=False, batch_bytes=100_000))
    tok = gpt2()
    with IndexedWriter(tmp_path / 'plain', 'uint16') as w:
        for t in docs: w.add_document(tok.hf.encode(t, add_special_tokens=False).ids + [tok.eod])
    for suffix in ('.bin', '.idx'):
        assert (tmp_path / ('fast_text_document' + suffix)).read_bytes() == (tmp_path / ('plain' + suffix)).read_bytes()
    assert res.documents == len(docs)


def test_interrupted_run_leaves_no_dataset(tmp_path):
    def stop(progress): raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(('builtin:kjv',), str(tmp_path / 'out'), batch_bytes=10_000), progress=stop, every=0)
    assert list(tmp_path.iterdir()) == []


def test_rerun_replaces_the_old_pair(tmp_path):
    prepare(PrepareConfig(('builtin:milton',), str(tmp_path / 'out')))
    prepare(PrepareConfig(('builtin:kjv',), str(tmp_path / 'out')))
    assert IndexedDataset(tmp_path / 'out_text_document').num_documents == 1189
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out_text_document.bin', 'out_text_document.idx']


def test_progress_reaches_the_input_size(tmp_path):
    events = []
    prepare(PrepareConfig(('builtin:kjv', 'builtin:milton'), str(tmp_path / 'p'), batch_bytes=100_000), events.append, every=0)
    consumed = [e.input_bytes for e in events]
    assert len(events) > 5 and consumed == sorted(consumed)
    assert events[-1].input_bytes == events[-1].input_total > 0


def test_encode_write_read_decode_returns_the_cleaned_text(tmp_path):
    from gptkit.data.corpus import clean_text
    raw = ['Caf\u0065\u0301 au lait\r\nline two\x07', 'plain ASCII text.', 'naïve — 日本語 🙂\tend']
    (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in raw))
    res = prepare(PrepareConfig((str(tmp_path / 'in.jsonl'),), str(tmp_path / 'rt')))
    ds, tok = IndexedDataset(res.prefix), gpt2()
    assert [tok.decode(ds.document(j)[:-1]) for j in range(ds.num_documents)] == [clean_text(t) for t in raw]
    assert all(ds.document(j)[-1] == tok.eod for j in range(ds.num_documents))
