"""`data prepare --tokenizer FOLDER` on a Hugging Face model folder of each family gives the ids transformers'
AutoTokenizer gives, then the family's end-of-text id from config.json (issue 31, item 4).

Each family's tokenizer is a tiny BPE trained here with that family's normalizer, pre-tokenizer, post-processor and
special tokens, saved with the tokenizer_config.json and config.json fields the published checkpoints carry."""
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from gptkit.data.indexed import IndexedDataset
from gptkit.data.prepare import PrepareConfig, prepare
from gptkit.errors import DataError
from gptkit.tokenizer.bpe import load_tokenizer, save_tokenizer

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TRAIN = ["Hello world! It's 3.14159 -- isn't it? naïve café 日本語 🙂", 'The quick brown fox jumps over the lazy dog.',
         '  Indented\tline\r\n and more lines\n\nTHE END 1234567',
         "Don't stop, we'll see; they're here. 2024-11-25"] * 20
DOCS = ["Hello world! It's 3.14159 -- isn't it?", '  Indented\tline\r\n 日本語 🙂 x  ',
        'numbers 1234567 and 42, DON\'T', 'cafe\u0301 (NFD) and café', ' leading space\n\n\ntrailing   ']
SPECIAL_TEXT = ['a <|end_of_text|> b <|endoftext|> c <s> d </s> <|im_start|>', 'think: <think>x</think>']


def _byte_level(split: str | None, specials: list[str], nfc: bool = False, ignore_merges: bool = False) -> Tokenizer:
    "A byte-level BPE (GPT-2's pre-tokenizer, or `split` before a regex-free one), specials added after training"
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = level if split is None else pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), 'isolated'), level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN, trainer)
    tok.add_special_tokens(specials)
    return tok


def _write(d, tok: Tokenizer, tokenizer_config: dict, config: dict):
    d.mkdir(parents=True)
    tok.save(str(d / 'tokenizer.json'))
    (d / 'tokenizer_config.json').write_text(json.dumps(tokenizer_config))
    (d / 'config.json').write_text(json.dumps({'vocab_size': tok.get_vocab_size(), **config}))


def llama3(d, eos_list: bool = False):
    tok = _byte_level(LLAMA3, ['<|begin_of_text|>', '<|end_of_text|>', '<|eom_id|>', '<|eot_id|>'],
                      ignore_merges=True)                      # as Llama 3's tokenizer.json says
    bos, eos = tok.token_to_id('<|begin_of_text|>'), tok.token_to_id('<|end_of_text|>')
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single='<|begin_of_text|> $A:0', pair='<|begin_of_text|> $A:0 <|begin_of_text|>:1 $B:1',
        special_tokens=[('<|begin_of_text|>', bos)])])
    eos_id = [eos, eos + 1, eos + 2] if eos_list else eos            # Llama 3.1/3.2 Instruct list three
    _write(d, tok, {'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>' if eos_list else '<|end_of_text|>',
                    'clean_up_tokenization_spaces': True, 'model_max_length': 131072,
                    'tokenizer_class': 'PreTrainedTokenizerFast'},
           {'model_type': 'llama', 'bos_token_id': bos, 'eos_token_id': eos_id})


def qwen(d, model_type: str = 'qwen2'):
    tok = _byte_level(QWEN, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], nfc=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if model_type == 'qwen3':
        tok.add_tokens(['<think>', '</think>'])                      # added, not special: matched in text
    eos = tok.token_to_id('<|endoftext|>')
    _write(d, tok, {'add_bos_token': False, 'add_prefix_space': False, 'bos_token': None, 'eos_token': '<|endoftext|>',
                    'pad_token': '<|endoftext|>', 'errors': 'replace', 'split_special_tokens': False,
                    'tokenizer_class': 'Qwen2Tokenizer', 'unk_token': None},
           {'model_type': model_type, 'bos_token_id': eos, 'eos_token_id': eos})


def smollm2(d):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=420, special_tokens=['<|endoftext|>', '<|im_start|>',
                            '<|im_end|>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    _write(d, tok, {'add_prefix_space': False, 'bos_token': '<|endoftext|>', 'eos_token': '<|endoftext|>',
                    'unk_token': '<|endoftext|>', 'tokenizer_class': 'GPT2Tokenizer', 'model_max_length': 8192},
           {'model_type': 'llama', 'bos_token_id': 0, 'eos_token_id': 0})


def mistral_hf_trained(d):
    "sentencepiece-like, trained by HF: Metaspace, byte fallback to <0x..> tokens, <s> added before each text"
    tok = Tokenizer(models.BPE(unk_token='<unk>', byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first', split=True)
    tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(' ', 1, 0)])
    specials = ['<unk>', '<s>', '</s>'] + [f'<0x{i:02X}>' for i in range(256)]
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=700, special_tokens=specials))
    # pieces trained inside words, as sentencepiece trains them; saved without a split, as Mistral's tokenizer.json is
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first', split=False)
    tok.post_processor = processors.TemplateProcessing(single='<s> $A', pair='<s> $A <s>:1 $B:1',
                                                       special_tokens=[('<s>', 1)])
    spec = json.loads(tok.to_str())
    spec['added_tokens'] = spec['added_tokens'][:3]                    # the byte tokens are plain vocabulary
    tok = Tokenizer.from_str(json.dumps(spec))
    _write(d, tok, {'add_bos_token': True, 'add_eos_token': False, 'bos_token': '<s>', 'eos_token': '</s>',
                    'unk_token': '<unk>', 'legacy': False, 'tokenizer_class': 'LlamaTokenizer'},
           {'model_type': 'mistral', 'bos_token_id': 1, 'eos_token_id': 2})


def mistral(d, change=None):
    """As Mistral's and Llama 2's tokenizers were made: a BPE trained by sentencepiece (byte fallback), converted by
    transformers into tokenizer.json; `change(spec)` edits that file"""
    import sentencepiece
    import transformers
    src = Path(tempfile.mkdtemp())
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TRAIN), model_prefix=str(src / 'tokenizer'),
                                             model_type='bpe', vocab_size=520, byte_fallback=True, minloglevel=2)
    (src / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'LlamaTokenizer', 'legacy': False, 'add_bos_token': True, 'add_eos_token': False,
        'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>'}))
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(d))
    shutil.rmtree(src)
    if change:
        spec = json.loads((d / 'tokenizer.json').read_text())
        change(spec)
        (d / 'tokenizer.json').write_text(json.dumps(spec))
    (d / 'config.json').write_text(json.dumps({'vocab_size': 520, 'model_type': 'mistral', 'bos_token_id': 1,
                                               'eos_token_id': 2}))


def _drop_a_split(spec):
    "A merge less: one split of a piece that has two is no merge (so tiktoken, which takes any split, stands aside)"
    merges = spec['model']['merges']
    k = next(k for k in range(len(merges)) if ''.join(merges[k]) == ''.join(merges[k + 1]))
    del merges[k]


def _hub_prepend(spec):
    "The Hub's Mistral 7B v0.1 and Llama 2 files: a Prepend and a Replace normalizer instead of Metaspace"
    spec['pre_tokenizer'] = None
    spec['normalizer'] = {'type': 'Sequence', 'normalizers': [
        {'type': 'Prepend', 'prepend': '▁'}, {'type': 'Replace', 'pattern': {'String': ' '}, 'content': '▁'}]}


FAMILIES = {'llama3': llama3, 'qwen2.5': qwen, 'qwen3': lambda d: qwen(d, 'qwen3'), 'smollm2': smollm2,
            'mistral': mistral, 'mistral-hf-trained': mistral_hf_trained,
            'mistral-split-missing': lambda d: mistral(d, _drop_a_split)}
# the encoder each family's documents take: tiktoken on its own split rule (sentencepiece's merges for Mistral's),
# or the word cache of Mistral's Metaspace and byte fallback where a split of a piece is no merge
ENGINE = {'llama3': 'tiktoken', 'qwen2.5': 'tiktoken', 'qwen3': 'tiktoken', 'smollm2': 'tiktoken', 'mistral': 'tiktoken',
          'mistral-hf-trained': 'tiktoken', 'mistral-split-missing': 'words'}


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp('families')
    for name, make in FAMILIES.items():
        make(root / name)
    return root


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp('corpus') / 'docs.jsonl'
    path.write_text(''.join(json.dumps({'text': t}) + '\n' for t in DOCS + SPECIAL_TEXT))
    return path


def _auto(folder):
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _prepared(folder, corpus, out) -> list[list[int]]:
    "The documents `prepare` writes with the tokenizer in `folder`, read back from the .bin/.idx"
    res = prepare(PrepareConfig(inputs=(str(corpus),), output_prefix=str(out / 'data'), tokenizer=str(folder),
                                clean=False, workers=2))
    ds = IndexedDataset(res.prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize('family', FAMILIES)
def test_prepared_ids_are_autotokenizer_ids_then_the_config_eos(family, folders, corpus, tmp_path):
    folder = folders / family
    auto, eos = _auto(folder), json.loads((folder / 'config.json').read_text())['eos_token_id']
    got = _prepared(folder, corpus, tmp_path)
    assert got[:len(DOCS)] == [auto(t)['input_ids'] + [eos] for t in DOCS]
    # the name of a special token in a document is text, as AutoTokenizer(split_special_tokens=True) reads it;
    # an added token that is not special (Qwen3's <think>) is still found, as there
    assert got[len(DOCS):] == [auto(t, split_special_tokens=True)['input_ids'] + [eos] for t in SPECIAL_TEXT]
    docs = load_tokenizer(folder).documents
    assert ('tiktoken' if docs.fast else 'words' if docs.words else 'hf') == ENGINE[family]
    bos = '<s>' if family.startswith('mistral') else {'llama3': '<|begin_of_text|>'}.get(family)
    assert all(doc[0] == auto.convert_tokens_to_ids(bos) for doc in got) if bos else auto.bos_token_id not in got[0][:1]


@functools.lru_cache
def _encoders() -> dict:
    "Each family's DocumentEncoder, on folders built once"
    root = Path(tempfile.mkdtemp())
    for name, make in FAMILIES.items():
        make(root / name)
    mistral(root / 'mistral-hub',
            _hub_prepend)        # AutoTokenizer rebuilds this one's steps, HF reads them as written
    return {name: load_tokenizer(root / name).documents for name in [*FAMILIES, 'mistral-hub']}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=120) | st.text('0123456789 \n\t\r.,\'aéA日🙂\u0301\u2581', max_size=60),
                min_size=1, max_size=3))
def test_every_encoder_gives_hf_tokenizers_ids_on_random_text(texts):
    for name, docs in _encoders().items():
        assert [ids.tolist() for ids in docs.encode(texts)] == [ids.tolist() for ids in docs.exact(texts)], name


def test_llama3_instruct_lists_three_eos_ids_and_the_first_is_end_of_text(tmp_path, corpus):
    llama3(tmp_path / 'instruct', eos_list=True)
    tok = load_tokenizer(tmp_path / 'instruct')
    assert tok.hf.id_to_token(tok.eod) == '<|end_of_text|>'
    assert {d[-1] for d in _prepared(tmp_path / 'instruct', corpus, tmp_path)} == {tok.eod}


def test_an_imported_folder_keeps_the_family_eos_and_bos(folders, corpus, tmp_path):
    "import_hf saves the tokenizer into the run's tokenizer/ without config.json: tokenizer_config.json carries the eos"
    for family in FAMILIES:
        saved = save_tokenizer(load_tokenizer(folders / family), tmp_path / family / 'tokenizer')
        tok = load_tokenizer(folders / family)
        assert json.loads((saved / 'tokenizer_config.json').read_text())['eos_token'] == tok.hf.id_to_token(tok.eod)
        assert load_tokenizer(saved).eod == tok.eod
        want = _prepared(folders / family, corpus, tmp_path / f'{family}-hf')
        assert _prepared(saved, corpus, tmp_path / family) == want


def _llama3_model(folders, tmp_path):
    "(a Hugging Face folder of a tiny random LlamaForCausalLM with the llama3 tokenizer folder's files, its config)"
    import transformers
    hf = tmp_path / 'hf'
    shutil.copytree(folders / 'llama3', hf)
    config = json.loads((hf / 'config.json').read_text())
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=config['vocab_size'], hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32, bos_token_id=config['bos_token_id'],
        eos_token_id=config['eos_token_id'])).save_pretrained(hf)
    return hf, config


def test_prepare_with_the_tokenizer_of_a_run_imported_from_hugging_face(folders, corpus, tmp_path):
    "gptkit checkpoint import --from hf, then data prepare --tokenizer RUN/tokenizer: AutoTokenizer's ids, then eos"
    from gptkit.interop.hf import import_hf
    hf, config = _llama3_model(folders, tmp_path)
    run = import_hf(hf, tmp_path / 'run')
    want = [_auto(hf)(t)['input_ids'] + [config['eos_token_id']] for t in DOCS]
    assert _prepared(run / 'tokenizer', corpus, tmp_path)[:len(DOCS)] == want


def test_a_tokenizer_json_length_limit_does_not_cut_documents(folders, corpus, tmp_path):
    shutil.copytree(folders / 'llama3', tmp_path / 'cut')
    spec = json.loads((tmp_path / 'cut' / 'tokenizer.json').read_text())
    spec['truncation'] = {'direction': 'Right', 'max_length': 4, 'strategy': 'LongestFirst', 'stride': 0}
    (tmp_path / 'cut' / 'tokenizer.json').write_text(json.dumps(spec))
    assert _prepared(tmp_path / 'cut', corpus, tmp_path / 'a') == _prepared(folders / 'llama3', corpus, tmp_path / 'b')


def test_a_post_processor_that_ends_each_text_with_eos_gets_no_second_one(folders, corpus, tmp_path):
    shutil.copytree(folders / 'mistral', tmp_path / 'eos')
    tok = Tokenizer.from_file(str(tmp_path / 'eos' / 'tokenizer.json'))
    tok.post_processor = processors.TemplateProcessing(single='<s> $A </s>', special_tokens=[('<s>', 1), ('</s>', 2)])
    tok.save(str(tmp_path / 'eos' / 'tokenizer.json'))
    got = _prepared(tmp_path / 'eos', corpus, tmp_path)
    assert got[:len(DOCS)] == [_auto(tmp_path / 'eos')(t)['input_ids'] for t in DOCS]
    assert all(d[-1] == 2 and d[-2] != 2 for d in got)


@pytest.mark.parametrize('config, said', [
    ({'model_type': 'llama'}, "config.json: eos_token_id None is no token of"),
    ({'eos_token_id': 10**6}, 'config.json: eos_token_id 1000000 is no token of'),
    ({'eos_token_id': '</s>'}, "config.json: eos_token_id '</s>' is no token of"),
    ({'eos_token_id': []}, 'config.json: eos_token_id [] is no token of'),
    ({'eos_token_id': True}, 'config.json: eos_token_id True is no token of'),
])
def test_a_config_without_a_usable_eos_id_is_refused_naming_file_and_key(folders, tmp_path, config, said):
    shutil.copytree(folders / 'llama3', tmp_path / 'f')
    (tmp_path / 'f' / 'config.json').write_text(json.dumps(config))
    with pytest.raises(DataError, match=said.replace('[', r'\[').replace(']', r'\]')) as e:
        load_tokenizer(tmp_path / 'f')
    assert 'end-of-text id between documents is unknown' in str(e.value)


def test_a_missing_broken_or_hostile_tokenizer_json_is_refused_in_one_sentence(folders, tmp_path):
    d = tmp_path / 'f'
    shutil.copytree(folders / 'qwen2.5', d)
    spec = (d / 'tokenizer.json').read_text()
    cases = [('{"model": {"type": "Nonesuch"}', 'tokenizer.json: not a HuggingFace tokenizer file'),
             ('not json', 'tokenizer.json: not a HuggingFace tokenizer file'),
             ('[' * 100_000, 'tokenizer.json: not a HuggingFace tokenizer file'),
             (Tokenizer(models.WordLevel({'<|endoftext|>': 0, 'a': 1}, unk_token='a')).to_str(),
              'tokenizer.json: model type WordLevel is not supported')]
    for text, said in cases:
        (d / 'tokenizer.json').write_text(text)
        with pytest.raises(DataError, match=said):
            load_tokenizer(d)
    with open(d / 'tokenizer.json', 'wb') as f:
        f.truncate(4 * 2**30)                                  # sparse: refused before it is read
    with pytest.raises(DataError, match='tokenizer.json holds 4.0 GiB, more than the 128.0 MiB read'):
        load_tokenizer(d)
    (d / 'tokenizer.json').unlink()
    with pytest.raises(DataError, match='holds neither tokenizer.json nor vocab.json and merges.txt'):
        load_tokenizer(d)
    (d / 'tokenizer.json').write_text(spec)
    (d / 'tokenizer_config.json').write_text('{"eos_token": "<|nonesuch|>"}')
    (d / 'config.json').unlink()                              # without config.json, tokenizer_config.json names it
    with pytest.raises(DataError, match=r'tokenizer_config.json: eos_token .<\|nonesuch\|>. is no token of'):
        load_tokenizer(d)


def test_the_cli_refuses_a_folder_without_an_eos_id_in_one_red_line(folders, corpus, tmp_path):
    from typer.testing import CliRunner

    from gptkit_cli.main import app
    shutil.copytree(folders / 'llama3', tmp_path / 'f')
    (tmp_path / 'f' / 'config.json').write_text('{"model_type": "llama"}')
    r = CliRunner().invoke(app, ['data', 'prepare', '-i', str(corpus), '--output-prefix', str(tmp_path / 'd'),
                                 '--tokenizer', str(tmp_path / 'f')])
    assert r.exit_code == 1 and 'eos_token_id None is no token of' in r.output and 'Traceback' not in r.output
    assert not list(tmp_path.glob('d_*'))


def test_an_imported_family_tokenizer_exports_as_autotokenizer_reads_it(folders, corpus, tmp_path):
    "Import, then export: AutoTokenizer on the export gives the original folder's ids, vocabulary and end of text"
    from gptkit.interop.hf import export_hf, import_hf
    hf, config = _llama3_model(folders, tmp_path)
    out = export_hf(import_hf(hf, tmp_path / 'run'), tmp_path / 'export')
    original, exported = _auto(hf), _auto(out)
    assert len(exported) == len(original) and exported.eos_token_id == config['eos_token_id']
    assert [exported(t)['input_ids'] for t in DOCS] == [original(t)['input_ids'] for t in DOCS]
