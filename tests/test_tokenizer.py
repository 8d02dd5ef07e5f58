"""gptkit tokenizers against transformers' own GPT-2 tokenizer, and bad tokenizer directories."""
import functools
import gzip
import shutil

import pytest
from hypothesis import given, settings, strategies as st

from gptkit.errors import DataError
from gptkit.tokenizer.bpe import asset, gpt2, load_tokenizer, save_tokenizer, train_bpe

TEXTS = ['Hello world', ' The quick brown fox jumps over the lazy dog.', "It's 3.14159 -- isn't it?\n\n  Indented\tline",
         'naïve café — 日本語 🙂', 'a<|endoftext|>b', '']


@pytest.fixture(scope='module')
def shakespeare():
    text = gzip.decompress(asset('corpora', 'tiny_shakespeare.txt.gz').read_bytes()).decode()
    return [b for b in text.split('\n\n') if b.strip()]


@pytest.fixture(scope='module')
def trained(shakespeare):
    return train_bpe(shakespeare[:3000], vocab_size=1000)


def _transformers_tokenizer(d):
    from transformers import GPT2TokenizerFast
    return GPT2TokenizerFast.from_pretrained(str(d))


@pytest.mark.parametrize('files', [('vocab.json', 'merges.txt'), ('tokenizer.json',)])
def test_transformers_loads_gpt2_with_the_same_ids(tmp_path, files):
    full = save_tokenizer(gpt2(), tmp_path / 'full')
    d = tmp_path / 'only'; d.mkdir()
    for f in files: shutil.copy(full / f, d / f)
    hf, ours = _transformers_tokenizer(d), gpt2()
    assert hf.vocab_size == 50257
    for t in TEXTS[:-2]: assert hf(t)['input_ids'] == ours.encode(t), t


def test_transformers_loads_a_trained_tokenizer(tmp_path, trained, shakespeare):
    save_tokenizer(trained, tmp_path / 't')
    d = tmp_path / 'pair'; d.mkdir()
    for f in ('vocab.json', 'merges.txt'): shutil.copy(tmp_path / 't' / f, d / f)
    hf = _transformers_tokenizer(d)
    for t in shakespeare[3000:3050]: assert hf(t)['input_ids'] == trained.encode(t)
    assert hf.convert_tokens_to_ids('<|endoftext|>') == trained.eod


_gpt2 = functools.lru_cache(gpt2)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_decode_inverts_encode(text):
    tok = _gpt2()
    assert tok.decode(tok.encode(text)) == text


def test_bad_directories(tmp_path):
    with pytest.raises(DataError, match='no such tokenizer directory'): load_tokenizer(tmp_path / 'missing')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(DataError, match='holds neither tokenizer.json nor vocab.json and merges.txt'): load_tokenizer(tmp_path / 'empty')
    (tmp_path / 'broken').mkdir(); (tmp_path / 'broken' / 'tokenizer.json').write_text('{not json')
    with pytest.raises(DataError, match='broken/tokenizer.json: not a HuggingFace tokenizer file'): load_tokenizer(tmp_path / 'broken')
    (tmp_path / 'noeod').mkdir()
    (tmp_path / 'noeod' / 'vocab.json').write_text('{"a": 0, "b": 1, "ab": 2}'); (tmp_path / 'noeod' / 'merges.txt').write_text('a b\n')
    with pytest.raises(DataError, match='has no <|endoftext|> token'): load_tokenizer(tmp_path / 'noeod')


def _builtin_sample(every: int = 4) -> list[str]:
    "Every built-in corpus, each by every `every`-th of its documents (its first one always)"
    from gptkit.data.corpus import BUILTIN, read_documents
    return [d.text for k in BUILTIN for d in list(read_documents([f'builtin:{k}']))[::every]]


def test_fast_encoder_matches_hf_on_every_builtin_corpus():
    tok = _gpt2()
    assert tok.fast is not None
    texts = _builtin_sample()
    want = [e.ids for e in tok.hf.encode_batch(texts, add_special_tokens=False)]
    assert tok.encode_batch(texts) == want
    assert [a.tolist() for a in tok.encode_arrays(texts, 2)] == want   # what prepare writes


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_fast_encoder_matches_hf_on_random_text(text):
    tok = _gpt2()
    assert tok.fast.encode_ordinary(text) == tok.hf.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope='module')
def builtin_by_hf(trained):
    "Every built-in corpus's documents (a quarter of each), and HF's encoding of them with the trained tokenizer"
    texts = _builtin_sample()
    return texts, [e.ids for e in trained.hf.encode_batch(texts, add_special_tokens=False)]


def test_trained_tokenizer_encodes_like_hf_on_every_builtin_corpus(trained, builtin_by_hf):
    texts, want = builtin_by_hf
    assert trained.fast is not None   # the probe found tiktoken equivalent
    assert trained.encode_batch(texts) == want
    assert [a.tolist() for a in trained.encode_arrays(texts[:50], 2)] == want[:50]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_trained_fast_encoder_matches_hf_on_random_text(text):
    from gptkit.tokenizer.bpe import Tokenizer
    tok = Tokenizer(_trained_hf())
    if '<|endoftext|>' in text: return   # HF cuts the special token out of text; gptkit treats it as text
    assert tok.encode(text) == _trained_hf().encode(text, add_special_tokens=False).ids


def test_megatron_core_loads_our_directories(tmp_path, trained, shakespeare):
    mtok = pytest.importorskip('megatron.core.tokenizers')
    for name, tok in (('gpt2', _gpt2()), ('trained', trained)):
        d = save_tokenizer(tok, tmp_path / name)
        theirs = mtok.MegatronTokenizer.from_pretrained(tokenizer_path=str(d), metadata_path={'library': 'huggingface'})
        for t in TEXTS[:-2] + shakespeare[3100:3110]: assert theirs.tokenize(t) == tok.encode(t), (name, t)
        assert theirs.vocab_size == tok.vocab_size


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_word_cache_matches_hf_on_random_text(text):
    if '<|endoftext|>' in text: return
    wc = _word_cache()
    assert wc.encode(text) == _trained_hf().encode(text, add_special_tokens=False).ids


@functools.lru_cache
def _trained_hf():
    text = gzip.decompress(asset('corpora', 'tiny_shakespeare.txt.gz').read_bytes()).decode()
    return train_bpe([b for b in text.split('\n\n') if b.strip()][:2000], vocab_size=700).hf


@functools.lru_cache
def _word_cache():
    from gptkit.tokenizer.bpe import WordCache
    return WordCache(_trained_hf())


def test_word_cache_matches_hf_on_every_builtin_corpus(trained, builtin_by_hf):
    from gptkit.tokenizer.bpe import WordCache
    texts, want = builtin_by_hf
    assert [WordCache(trained.hf).encode(t) for t in texts] == want


def test_fast_encoder_refuses_a_vocabulary_that_is_not_byte_level():
    from tokenizers import Tokenizer as HFTokenizer, models

    from gptkit.tokenizer.encoders import fast_encoder, unicode_to_bytes as _unicode_to_bytes
    for vocab in ({'a': 0, ' b': 1}, {'a': 0, '\x07': 1}, {'a': 0, 'é日': 1}):   # a raw space or control byte, CJK
        assert fast_encoder(HFTokenizer(models.BPE(vocab=vocab, merges=[]))) is None
    u2b, hf = _unicode_to_bytes(), gpt2().hf                 # GPT-2's ranks are its vocabulary's bytes
    ranks = {bytes(u2b[c] for c in t): i for t, i in hf.get_vocab().items() if t != '<|endoftext|>'}
    assert fast_encoder(hf)._mergeable_ranks == ranks
