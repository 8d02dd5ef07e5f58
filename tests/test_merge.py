"""merge: the bytes megatron-core writes when Megatron's tools/merge_datasets.py joins the same datasets, documents
read back in order, and inputs that cannot be merged refused with nothing written."""
import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from gptkit.data.indexed import IndexedDataset, IndexedWriter, data_paths, merge_datasets
from gptkit.data.prepare import PrepareConfig, prepare
from gptkit.errors import DataError
from gptkit_cli.main import app

mcore = pytest.importorskip('megatron.core.datasets.indexed_dataset')


@pytest.fixture(scope='module')
def parts(tmp_path_factory):
    "Three datasets prepared by gptkit from small JSON Lines files (GPT-2 tokens, uint16), and their documents' texts"
    d = tmp_path_factory.mktemp('parts')
    prefixes, texts = [], []
    for k, n in enumerate((7, 1, 12)):
        docs = [f'Part {k}, document {i}: ' + 'lorem ipsum dolor ' * (i + k) for i in range(n)]
        (d / f'p{k}.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
        prefixes.append(str(prepare(PrepareConfig(inputs=(str(d / f'p{k}.jsonl'),),
                                                  output_prefix=str(d / f'p{k}'))).prefix))
        texts += docs
    return prefixes, texts


def megatron_merge(prefixes, out):
    "What tools/merge_datasets.py does: a builder with the first input's dtype, add_index for each input, finalize"
    bin_path, idx_path = data_paths(out)
    builder = mcore.IndexedDatasetBuilder(str(bin_path), dtype=mcore.IndexedDataset(str(prefixes[0])).index.dtype)
    for p in prefixes: builder.add_index(str(p))
    builder.finalize(str(idx_path))


def assert_same_files(a, b):
    for x, y in zip(data_paths(a), data_paths(b)): assert x.read_bytes() == y.read_bytes(), x.name


def test_same_bytes_as_megatron_merge(parts, tmp_path):
    prefixes, _ = parts
    res = merge_datasets(prefixes, tmp_path / 'ours')
    megatron_merge(prefixes, tmp_path / 'theirs')
    assert_same_files(tmp_path / 'ours', tmp_path / 'theirs')
    assert (res.datasets, res.documents, res.sequences) == (3, 20, 20)
    assert res.tokens == sum(IndexedDataset(p).num_tokens for p in prefixes)
    assert res.bytes == sum(p.stat().st_size for p in data_paths(tmp_path / 'ours'))


def test_split_and_empty_datasets_like_megatron(tmp_path):
    "Documents of several sequences, an empty dataset between two others, int32 tokens, a small copy chunk"
    rng = np.random.default_rng(0)
    for name, n in (('a', 30), ('empty', 0), ('b', 17)):
        with IndexedWriter(tmp_path / name, np.int32) as w:
            for _ in range(n):
                doc = rng.integers(0, 100_000, rng.integers(2, 60))
                w.add_document(doc, [1, len(doc) - 1])
    inputs = [tmp_path / 'a', tmp_path / 'empty', tmp_path / 'b', tmp_path / 'a']
    merge_datasets(inputs, tmp_path / 'ours', chunk_bytes=40)
    megatron_merge(inputs, tmp_path / 'theirs')
    assert_same_files(tmp_path / 'ours', tmp_path / 'theirs')
    ds = IndexedDataset(tmp_path / 'ours')
    assert (ds.num_documents, len(ds)) == (77, 154)
    assert (ds.document(47) == IndexedDataset(tmp_path / 'a').document(0)).all()


def test_a_folder_merges_in_megatrons_order(parts, tmp_path):
    "Megatron's tool takes a folder and merges its pairs sorted by name; gptkit does the same with a folder input"
    import shutil
    folder = tmp_path / 'shards'
    folder.mkdir()
    for p, name in zip(parts[0], ('s2', 's0', 's1')):
        for src, dst in zip(data_paths(p), data_paths(folder / name)): shutil.copy(src, dst)
    merge_datasets([folder], tmp_path / 'ours')
    megatron_merge([folder / 's0', folder / 's1', folder / 's2'], tmp_path / 'theirs')
    assert_same_files(tmp_path / 'ours', tmp_path / 'theirs')


def test_documents_read_back_in_order(parts, tmp_path):
    from gptkit.tokenizer.bpe import gpt2
    prefixes, texts = parts
    merge_datasets([prefixes[2], prefixes[0], prefixes[1]], tmp_path / 'm')
    ds, tok = IndexedDataset(tmp_path / 'm'), gpt2()
    order = texts[8:] + texts[:7] + texts[7:8]
    assert ds.num_documents == len(order)
    assert [tok.decode(ds.document(j)[:-1]) for j in range(ds.num_documents)] == order
    theirs = mcore.IndexedDataset(str(tmp_path / 'm'))   # megatron-core reads it too (kept: its __del__ unmaps)
    assert (theirs[5] == ds[5]).all() and list(theirs.document_indices) == list(range(21))


def test_mixed_dtypes_refused(parts, tmp_path):
    with IndexedWriter(tmp_path / 'wide', np.int32) as w: w.add_document([70_000, 1])
    with pytest.raises(DataError, match=r'wide holds int32 tokens but .*p0_text_document holds uint16'):
        merge_datasets([parts[0][0], tmp_path / 'wide'], tmp_path / 'm')
    assert list(tmp_path.glob('m*')) == []


def test_missing_index_refused_before_writing(parts, tmp_path):
    import shutil
    shutil.copy(data_paths(parts[0][1])[0], tmp_path / 'lonely.bin')
    with pytest.raises(DataError, match=r'lonely\.idx: no such file'):
        merge_datasets([parts[0][0], tmp_path / 'lonely'], tmp_path / 'm')
    with pytest.raises(DataError, match='the output prefix is also an input'):
        merge_datasets([parts[0][0]], parts[0][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['lonely.bin']


def test_interrupted_merge_leaves_no_files(parts, tmp_path):
    merge_datasets(parts[0][:1], tmp_path / 'm')   # an old merge, which must survive untouched
    old = [p.read_bytes() for p in data_paths(tmp_path / 'm')]
    calls = []
    def stop(p):
        calls.append(p)
        if len(calls) == 3: raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt): merge_datasets(parts[0], tmp_path / 'm', stop, chunk_bytes=64, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['m.bin', 'm.idx', 'm.metadata']   # the metadata kept too
    assert [p.read_bytes() for p in data_paths(tmp_path / 'm')] == old


def test_a_merge_holds_its_output_lock_until_the_pair_is_in_place(parts, tmp_path):
    "Another process sees the merge as the writer of its output from its first copied chunk to its last"
    import subprocess
    import sys
    out, seen = tmp_path / 'm', []
    ask = 'import sys; from gptkit.data.indexed import dataset_writer; print(dataset_writer(sys.argv[1]))'
    def probe(event):
        if len(seen) < 2 and (not seen or event.bytes == event.total):   # the first event and the last
            r = subprocess.run([sys.executable, '-c', ask, str(out)], capture_output=True, text=True, timeout=60)
            seen.append(r.stdout.strip())
    merge_datasets(parts[0], out, probe, chunk_bytes=64)
    assert len(seen) == 2 and all(s.startswith(f'process {os.getpid()} on ') for s in seen), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ['m.bin', 'm.idx', 'm.metadata']   # and no lock file left

def test_cli(parts, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ['data', 'merge', *(a for p in parts[0] for a in ('-i', p)), '--output-prefix',
                            str(tmp_path / 'out' / 'merged')])
    assert r.exit_code == 0, r.output
    ds = IndexedDataset(tmp_path / 'out' / 'merged')
    for label, n in (('datasets merged', 3), ('documents written', 20), ('tokens written', ds.num_tokens)):
        assert f'{label}' in r.output and f'{n:,}' in r.output.split(label)[1].splitlines()[0], r.output
    r = runner.invoke(app, ['data', 'merge', '-i', parts[0][0], '-i', str(tmp_path / 'nope'),
                            '--output-prefix', str(tmp_path / 'bad')])
    assert r.exit_code == 1 and 'nope.idx: no such file' in r.output and 'Traceback' not in r.output
    assert not list(tmp_path.glob('bad*'))
