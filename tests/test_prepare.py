"""prepare: the same bytes as a plain one-document-at-a-time encoding, and nothing half-written on interruption."""
import json

import pytest

from gptkit.data.corpus import read_documents
from gptkit.data.indexed import IndexedDataset, IndexedWriter
from gptkit.data.prepare import PrepareConfig, prepare
from gptkit.errors import DataError
from gptkit.tokenizer.bpe import gpt2


def test_same_bytes_as_plain_encoding(tmp_path):
    docs = [d.text for d in read_documents(['builtin:kjv', 'builtin:milton'])]
    (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
    res = prepare(PrepareConfig(inputs=(str(tmp_path / 'in.jsonl'),), output_prefix=str(tmp_path / 'fast'), clean=False,
                                batch_bytes=100_000))
    tok = gpt2()
    with IndexedWriter(tmp_path / 'plain', 'uint16') as w:
        for t in docs: w.add_document(tok.hf.encode(t, add_special_tokens=False).ids + [tok.eod])
    for suffix in ('.bin', '.idx'):
        assert (tmp_path / ('fast_text_document' + suffix)).read_bytes() == (tmp_path / ('plain' + suffix)).read_bytes()
    assert res.documents == len(docs)


def test_interrupted_run_leaves_no_dataset(tmp_path):
    def stop(progress): raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareConfig(inputs=('builtin:kjv',), output_prefix=str(tmp_path / 'out'), batch_bytes=10_000),
                progress=stop, every=0)
    assert list(tmp_path.iterdir()) == []                       # not even the lock file


def test_rerun_replaces_the_old_pair_only_with_overwrite(tmp_path):
    prepare(PrepareConfig(inputs=('builtin:milton',), output_prefix=str(tmp_path / 'out')))
    with pytest.raises(DataError, match=r'out_text_document.bin already exists and holds 7 documents .*--overwrite'):
        prepare(PrepareConfig(inputs=('builtin:kjv',), output_prefix=str(tmp_path / 'out')))
    assert IndexedDataset(tmp_path / 'out_text_document').num_documents == 7
    prepare(PrepareConfig(inputs=('builtin:kjv',), output_prefix=str(tmp_path / 'out'), overwrite=True))
    assert IndexedDataset(tmp_path / 'out_text_document').num_documents == 1189
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out_text_document.bin', 'out_text_document.idx',
                                                          'out_text_document.metadata']


def test_progress_reaches_the_input_size(tmp_path):
    events = []
    prepare(PrepareConfig(inputs=('builtin:kjv', 'builtin:milton'), output_prefix=str(tmp_path / 'p'),
                          batch_bytes=100_000), events.append, every=0)
    consumed = [e.input_bytes for e in events]
    assert len(events) > 5 and consumed == sorted(consumed)
    assert events[-1].input_bytes == events[-1].input_total > 0


def test_encode_write_read_decode_returns_the_cleaned_text(tmp_path):
    from gptkit.data.corpus import clean_text
    raw = ['Caf\u0065\u0301 au lait\r\nline two\x07', 'plain ASCII text.', 'naïve — 日本語 🙂\tend']
    (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in raw))
    res = prepare(PrepareConfig(inputs=(str(tmp_path / 'in.jsonl'),), output_prefix=str(tmp_path / 'rt')))
    ds, tok = IndexedDataset(res.prefix), gpt2()
    assert [tok.decode(ds.document(j)[:-1]) for j in range(ds.num_documents)] == [clean_text(t) for t in raw]
    assert all(ds.document(j)[-1] == tok.eod for j in range(ds.num_documents))


def test_refusal_comes_before_the_tokenizer_loads(tmp_path, monkeypatch):
    import gptkit.data.prepare
    from gptkit.errors import DataError
    # where prepare looks it up (patching gptkit.tokenizer.bpe, as this test did, never reached prepare's own name)
    monkeypatch.setattr(gptkit.data.prepare, 'load_tokenizer', lambda name: pytest.fail('the tokenizer loaded first'))
    (tmp_path / 'a.jsonl').write_text('{"text": "fine"}\n')
    (tmp_path / 'a.txt').write_bytes(b'PK\x03\x04' + bytes(30))
    with pytest.raises(DataError, match=r'a\.txt: its content is a zip archive, not text \(accepted: '):
        prepare(PrepareConfig(inputs=(str(tmp_path / 'a.jsonl'), str(tmp_path / 'a.txt')),
                              output_prefix=str(tmp_path / 'out')))


def test_shards_together_equal_one_run(tmp_path):
    from gptkit.data.prepare import shard_inputs
    texts = [d.text for d in read_documents(['builtin:milton'])]
    for k, t in enumerate(texts): (tmp_path / f'in{k:02d}.jsonl').write_text(json.dumps({'text': t}) + '\n' + json.dumps({'text': t[:99]}) + '\n')
    spec = str(tmp_path / 'in*.jsonl')
    whole = IndexedDataset(prepare(PrepareConfig(inputs=(spec,), output_prefix=str(tmp_path / 'whole'))).prefix)
    parts, seen = [], []
    for i in range(1, 4):
        res = prepare(PrepareConfig(inputs=(spec,), output_prefix=str(tmp_path / f'part{i}'), shard=f'{i}/3'))
        ds = IndexedDataset(res.prefix)
        parts += [ds.document(j).tolist() for j in range(ds.num_documents)]
        seen += list(res.tally.inputs)
    assert parts == [whole.document(j).tolist() for j in range(whole.num_documents)]
    assert seen == sorted(str(p) for p in tmp_path.glob('in*.jsonl'))   # each file in exactly one shard, in order
    sizes = [sum(p.stat().st_size for p in shard_inputs(sorted(tmp_path.glob('in*.jsonl')), f'{i}/3')) for i in (1, 2, 3)]
    assert max(sizes) <= 2 * sum(sizes) / 3   # cut by bytes, not by file count


def test_prepare_reads_parquet_like_jsonl(tmp_path):
    pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
    texts = [d.text for d in read_documents(['builtin:kjv'])][:200]
    (tmp_path / 'k.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts))
    pq.write_table(pa.table({'text': texts}), tmp_path / 'k.parquet', row_group_size=64)
    a = prepare(PrepareConfig(inputs=(str(tmp_path / 'k.jsonl'),), output_prefix=str(tmp_path / 'j')))
    b = prepare(PrepareConfig(inputs=(str(tmp_path / 'k.parquet'),), output_prefix=str(tmp_path / 'p')))
    for suffix in ('.bin', '.idx'):
        assert (tmp_path / ('j_text_document' + suffix)).read_bytes() == (tmp_path / ('p_text_document' + suffix)).read_bytes()
    assert (a.documents, b.tally.inputs[str(tmp_path / 'k.parquet')]['documents']) == (200, 200)
