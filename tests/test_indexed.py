"""gptkit's .bin/.idx against megatron-core's own builder and reader, and random round trips."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gptkit.data.indexed import IndexedDataset, IndexedWriter, data_paths, token_dtype
from gptkit.errors import DataError

mcore = pytest.importorskip('megatron.core.datasets.indexed_dataset')


def random_docs(seed, n=50, vocab=50257):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 400)) for _ in range(n)]


def write_gptkit(prefix, docs, dtype, split=False):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs: w.add_document(d, [len(d) // 2, len(d) - len(d) // 2] if split else None)


def write_megatron(prefix, docs, dtype, split=False):
    import torch
    bin_path, idx_path = data_paths(prefix)
    b = mcore.IndexedDatasetBuilder(str(bin_path), dtype=np.dtype(dtype).type)
    for d in docs: b.add_document(torch.tensor(d), [len(d) // 2, len(d) - len(d) // 2] if split else [len(d)])
    b.finalize(str(idx_path))


@pytest.mark.parametrize('vocab', [50257, 100_000])
@pytest.mark.parametrize('split', [False, True])
def test_same_bytes_as_megatron_builder(tmp_path, vocab, split):
    docs, dtype = random_docs(vocab, vocab=vocab), token_dtype(vocab)
    write_gptkit(tmp_path / 'ours', docs, dtype, split)
    write_megatron(tmp_path / 'theirs', docs, dtype, split)
    for ours, theirs in zip(data_paths(tmp_path / 'ours'), data_paths(tmp_path / 'theirs')):
        assert ours.read_bytes() == theirs.read_bytes(), ours.name


def test_megatron_reads_ours(tmp_path):
    docs = random_docs(1)
    write_gptkit(tmp_path / 'ours', docs, np.uint16)
    ds = mcore.IndexedDataset(str(tmp_path / 'ours'))
    assert len(ds) == len(docs) and list(ds.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs): assert (ds[i] == d).all()
    assert (ds.get(3, offset=2, length=5) == docs[3][2:7]).all()


def test_we_read_megatrons(tmp_path):
    docs = random_docs(2)
    write_megatron(tmp_path / 'theirs', docs, np.int32, split=True)
    ds = IndexedDataset(tmp_path / 'theirs')
    assert ds.dtype == np.int32 and ds.num_documents == len(docs) and len(ds) == 2 * len(docs)
    for j, d in enumerate(docs): assert (ds.document(j) == d).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 65499), min_size=0, max_size=50), min_size=0, max_size=30))
def test_round_trip(tmp_path_factory, docs):
    prefix = tmp_path_factory.mktemp('rt') / 'd'
    write_gptkit(prefix, docs, np.uint16)
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(docs) and ds.num_tokens == sum(map(len, docs))
    for j, d in enumerate(docs): assert ds.document(j).tolist() == d


def test_foreign_and_damaged_files(tmp_path):
    write_gptkit(tmp_path / 'ok', random_docs(3, n=5), np.uint16)
    (tmp_path / 'foreign.idx').write_bytes(b'{"not": "an index"}')
    (tmp_path / 'foreign.bin').write_bytes(b'')
    with pytest.raises(DataError, match='foreign.idx: not a Megatron indexed dataset index'): IndexedDataset(tmp_path / 'foreign')
    idx = (tmp_path / 'ok.idx').read_bytes()
    (tmp_path / 'v2.idx').write_bytes(idx[:9] + (2).to_bytes(8, 'little') + idx[17:])
    (tmp_path / 'v2.bin').write_bytes((tmp_path / 'ok.bin').read_bytes())
    with pytest.raises(DataError, match='index version 2 is not supported'): IndexedDataset(tmp_path / 'v2')
    (tmp_path / 'ok.bin').unlink()
    with pytest.raises(DataError, match='ok.bin: no such file'): IndexedDataset(tmp_path / 'ok')


def test_add_documents_writes_what_add_document_writes(tmp_path):
    from gptkit.data.indexed import IndexedWriter
    docs = [[5, 6, 7], [65535], [1, 2], [9] * 1000, [0]]
    with IndexedWriter(tmp_path / 'one') as w:
        for d in docs: w.add_document(d)
    with IndexedWriter(tmp_path / 'many') as w:
        w.add_documents(docs[:2]); w.add_documents([]); w.add_documents(docs[2:])
        assert (w.tokens, len(w.doc_index)) == (1007, 6)
    with IndexedWriter(tmp_path / 'arrays') as w:   # uint32 arrays, as Tokenizer.encode_arrays gives them
        w.add_documents([np.array(d, np.uint32) for d in docs])
    for suffix in ('.bin', '.idx'):
        for other in ('many', 'arrays'):
            assert (tmp_path / f'one{suffix}').read_bytes() == (tmp_path / f'{other}{suffix}').read_bytes()
    for bad in ([[1], [65536]], [[-1]], [np.array([1], np.uint32), np.array([70000], np.uint32)]):
        w = IndexedWriter(tmp_path / 'bad')
        with pytest.raises(DataError, match=f'token id {bad[-1][0]} does not fit in uint16'): w.add_documents(bad)
        w.abort()


def test_add_documents_ends_each_document_with_eod(tmp_path):
    from gptkit.data.indexed import IndexedDataset, IndexedWriter
    docs, eod = [[5, 6, 7], [], [1, 2]], 50256
    for name, given in (('lists', docs), ('arrays', [np.array(d, np.uint32) for d in docs])):
        with IndexedWriter(tmp_path / name) as w: w.add_documents(given, eod=eod)
        ds = IndexedDataset(tmp_path / name)
        assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7, eod], [eod], [1, 2, eod]]
