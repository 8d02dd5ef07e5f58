"""gptkit's sample indices against megatron-core's GPTDataset, built by megatron-core itself."""
import numpy as np
import pytest

from gptkit.data.indexed import IndexedWriter
from gptkit.data.samples import GPTSamples, SampleSpec, build_indices

gpt = pytest.importorskip('megatron.core.datasets.gpt_dataset')
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402


def write(prefix, n_docs, seed, max_len=300):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50000, rng.integers(1, max_len)) for _ in range(n_docs)]
    with IndexedWriter(prefix, np.uint16) as w:
        for d in docs: w.add_document(d)
    return docs


def megatron_datasets(prefix, sizes, seq_len, seed, split, cache):
    config = gpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, blend=([str(prefix)], None), split=split,
                                  path_to_cache=str(cache), reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False, mmap_bin_files=True, tokenizer=NullTokenizer(50256))
    return BlendedMegatronDatasetBuilder(gpt.GPTDataset, sizes, lambda: True, config).build()


# Every split must hold documents: megatron-core 0.16.1 loops forever on an empty one (gptkit raises instead).
@pytest.mark.parametrize('n_docs,split,samples,seq_len,seed', [
    (1000, '949,50,1', [300, 10, 2], 64, 1234),   # less than one epoch
    (60, '90,8,2', [3000, 50, 10], 32, 7),         # many epochs
    (120, '80,15,5', [777, 30, 3], 128, 99),
])
def test_same_indices_and_samples_as_megatron(tmp_path, n_docs, split, samples, seq_len, seed):
    write(tmp_path / 'd', n_docs, seed)
    theirs = megatron_datasets(tmp_path / 'd', samples, seq_len, seed, split, tmp_path / 'mcache')
    for name, n, ds in zip(('train', 'valid', 'test'), samples, theirs):
        ours = GPTSamples(tmp_path / 'd', SampleSpec(split, name, n, seq_len, seed), cache=False)
        np.testing.assert_array_equal(ours.document_index, ds.document_index)
        np.testing.assert_array_equal(ours.sample_index, ds.sample_index)
        np.testing.assert_array_equal(ours.shuffle_index, ds.shuffle_index)
        assert ours.sample_index.dtype == ds.sample_index.dtype and ours.shuffle_index.dtype == ds.shuffle_index.dtype
        for i in range(0, len(ours), max(1, len(ours) // 50)):
            text, _ = ds._query_document_sample_shuffle_indices(i)
            np.testing.assert_array_equal(ours[i], text)


def test_training_far_past_one_epoch_never_runs_out(tmp_path):
    docs = write(tmp_path / 'd', 5, 0, max_len=20)
    tokens = sum(map(len, docs))
    s = GPTSamples(tmp_path / 'd', SampleSpec('1', 'train', num_samples=50 * tokens // 8, seq_len=8, seed=3))
    assert len(s) >= 50 * tokens // 8
    assert all(len(s[i]) == 9 for i in range(len(s)))



def test_runs_building_one_cache_at_once_do_not_collide(tmp_path):
    # two trainings started together on one dataset used to share one temporary name, and one of them crashed
    import threading

    from gptkit.data.samples import _save_atomic
    arr, errors = np.arange(200_000), []
    def save():
        try:
            for _ in range(20): _save_atomic(tmp_path / 'index.npy', arr)
        except Exception as e: errors.append(e)
    threads = [threading.Thread(target=save) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors[0]
    np.testing.assert_array_equal(np.load(tmp_path / 'index.npy'), arr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['index.npy']


def test_a_full_disk_leaves_no_partial_cache(tmp_path, monkeypatch):
    from gptkit.data import samples
    def full(file, arr):
        open(file, 'wb').write(b'half')
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(samples.np, 'save', full)
    with pytest.raises(OSError, match='No space'): samples._save_atomic(tmp_path / 'index.npy', np.arange(10))
    assert list(tmp_path.iterdir()) == []

def test_brute_force_reference():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 30, 40).astype(np.int32)
    doc_index, sample_index, _ = build_indices(lengths, np.arange(40, dtype=np.int32), 500, 7, 11)
    stream = np.concatenate([np.full(lengths[d], d) for d in doc_index])
    offsets = np.concatenate([np.arange(lengths[d]) for d in doc_index])
    for i, (row, off) in enumerate(sample_index):
        assert doc_index[row] == stream[i * 7] and off == offsets[i * 7]


def test_an_empty_split_is_an_error_not_a_hang(tmp_path):
    from gptkit.errors import DataError
    write(tmp_path / 'd', 200, 1)
    with pytest.raises(DataError, match="the test split of '949,50,1' is empty"):
        GPTSamples(tmp_path / 'd', SampleSpec('949,50,1', 'test', 10, 16, 1))


@pytest.mark.parametrize('weights,size', [([0.7, 0.2, 0.1], 5000), ([1, 1], 777), ([3, 0, 5, 0.25], 10_000), ([1], 10)])
def test_blending_indices_match_megatron(weights, size):
    from megatron.core.datasets import helpers
    from megatron.core.datasets.utils import normalize

    from gptkit.data.samples import blending_indices
    ds, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(ds, dsi, normalize(weights), len(weights), size, False)
    ours = blending_indices(weights, size)
    np.testing.assert_array_equal(ours[0], ds)
    np.testing.assert_array_equal(ours[1], dsi)


def test_blended_samples(tmp_path):
    from gptkit.data.samples import BlendedSamples
    write(tmp_path / 'a', 30, 1); write(tmp_path / 'b', 30, 2)
    a = GPTSamples(tmp_path / 'a', SampleSpec('1', 'train', 80, 16, 1))
    b = GPTSamples(tmp_path / 'b', SampleSpec('1', 'train', 30, 16, 1))
    blend = BlendedSamples([a, b], [0.75, 0.25], 100)
    assert (blend[0] == a[0]).all() and len(blend) == 100
    with pytest.raises(Exception, match='the blend draws'):
        BlendedSamples([a, b], [0.1, 0.9], 1000)


@pytest.fixture
def one_rank(monkeypatch):
    "megatron-core's BlendedDataset asks torch.distributed for its rank when it caches: this process is rank 0 of 1"
    import torch.distributed
    monkeypatch.setattr(torch.distributed, 'get_rank', lambda *a, **k: 0)


def megatron_config(seq_len, seed, cache, **blend):
    return gpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, path_to_cache=str(cache),
                                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                mmap_bin_files=True, tokenizer=NullTokenizer(50256), **blend)


def assert_same_blend(ours, theirs):
    "gptkit's split (BlendedSamples or GPTSamples) equals megatron-core's: blend indices, each dataset's, the tokens"
    from gptkit.data.samples import BlendedSamples
    if isinstance(ours, BlendedSamples):
        np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
        np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
        assert len(ours.datasets) == len(theirs.datasets)
        pairs = list(zip(ours.datasets, theirs.datasets))
    else:
        pairs = [(ours, theirs)]
    for o, t in pairs:
        for k in ('document_index', 'sample_index', 'shuffle_index'):
            np.testing.assert_array_equal(getattr(o, k), getattr(t, k))
    for i in range(0, len(ours), max(1, len(ours) // 60)):
        if isinstance(ours, BlendedSamples):
            d, j = int(theirs.dataset_index[i]), int(theirs.dataset_sample_index[i])
            text, _ = theirs.datasets[d]._query_document_sample_shuffle_indices(j)
        else:
            text, _ = theirs._query_document_sample_shuffle_indices(i)
        np.testing.assert_array_equal(ours[i], text)


@pytest.mark.parametrize('weights,docs,split,sizes,seq_len,seed', [
    ([0.3, 0.7], [200, 90], '90,8,2', [500, 40, 8], 32, 1234),
    ([2, 5, 1.5], [150, 60, 40], '80,15,5', [1000, 64, 16], 16, 7),     # weights normalized; several epochs
    ([1.0], [100], '90,8,2', [300, 20, 4], 32, 3),                       # '1.0 A': a blend of one, as Megatron
])
def test_blend_equals_megatron(tmp_path, one_rank, weights, docs, split, sizes, seq_len, seed):
    from gptkit.data.samples import split_samples
    prefixes = [str(tmp_path / f'd{k}') for k in range(len(docs))]
    for k, (p, n) in enumerate(zip(prefixes, docs)): write(p, n, seed + k)
    config = megatron_config(seq_len, seed, tmp_path / 'mcache', blend=(prefixes, weights), split=split)
    theirs = BlendedMegatronDatasetBuilder(gpt.GPTDataset, sizes, lambda: True, config).build()
    for name, n, t in zip(('train', 'valid', 'test'), sizes, theirs):
        assert_same_blend(split_samples(prefixes, weights, name, num_samples=n, seq_len=seq_len, seed=seed, split=split,
                                        cache=False), t)


def test_per_split_blends_equal_megatron(tmp_path, one_rank):
    from gptkit.data.samples import split_samples
    p = [str(tmp_path / f'd{k}') for k in range(4)]
    for k, n in enumerate((120, 80, 30, 25)): write(p[k], n, k)
    blends = [([p[0], p[1]], [0.6, 0.4]), ([p[2]], None), ([p[3], p[2]], [1.0, 3.0])]
    sizes, seq_len, seed = [700, 30, 50], 32, 11
    config = megatron_config(seq_len, seed, tmp_path / 'mcache', blend_per_split=blends, split=None)
    theirs = BlendedMegatronDatasetBuilder(gpt.GPTDataset, sizes, lambda: True, config).build()
    for name, n, (prefixes, weights), t in zip(('train', 'valid', 'test'), sizes, blends, theirs):
        assert_same_blend(split_samples(prefixes, weights, name, num_samples=n, seq_len=seq_len, seed=seed,
                                        cache=False), t)


def test_plan_split_counts_what_the_blend_builds(tmp_path):
    from gptkit.data.samples import plan_split, split_samples
    write(tmp_path / 'a', 50, 1); write(tmp_path / 'b', 20, 2)
    prefixes = [tmp_path / 'a', tmp_path / 'b']
    parts = plan_split(prefixes, [1, 3], 'train', 400, 16, split='90,10,0')
    blend = split_samples(prefixes, [1, 3], 'train', num_samples=400, seq_len=16, seed=5, split='90,10,0', cache=False)
    assert [p.weight for p in parts] == [0.25, 0.75]
    assert [p.samples for p in parts] == np.bincount(blend.dataset_index).tolist() == [100, 300]
    assert [p.built for p in parts] == [101, 302]
    n_docs = [45, 18]
    assert [p.epochs for p in parts] == [len(ds.document_index) // n for ds, n in zip(blend.datasets, n_docs)]
