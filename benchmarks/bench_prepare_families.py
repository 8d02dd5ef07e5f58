"""`gptkit data prepare` with a model family's tokenizer folder against the GPT-2 path in one run (issue 31, item 4).

Input: the built-in Shakespeare, Milton and KJV corpora as one JSON Lines file, repeated --copies times (3 copies:
33 MB, 3,714 documents), as in bench_prepare.py. The family folders are built here at real size from GPT-2's merges
(50,257 entries), so only the family's own rules differ from the GPT-2 path:
- llama-3-style: Llama 3's split rule (digits in threes) and ignore_merges, <|begin_of_text|> put before each
  document by the post-processor, <|end_of_text|> as config.json's eos_token_id (tiktoken on the family's rule);
- qwen-style: Qwen2's split rule (single digits) and NFC normalizer, no BOS, <|endoftext|> (tiktoken, NFC first);
- smollm2-style: SmolLM2's Digits step before GPT-2's (tiktoken on DIGITS_PATTERN, one expression for both);
- mistral-style: made as Mistral's and Llama 2's were, a 32,000-piece BPE trained by sentencepiece on the input's
  first 4 MB with their options (byte fallback, digits split, whitespace kept), converted by transformers into
  tokenizer.json (Metaspace, <s> before each document, </s> as eos; gptkit runs its merges on tiktoken);
- metaspace-hf-trained: the same rules on a 32,000-entry BPE trained by HF tokenizers instead, whose merges miss
  splits of pieces that transformers' conversion lists, so gptkit falls back to MetaspaceWords (each distinct word
  tokenized once by HF's model); shown for the fallback's speed, --families adds it.
Each path runs --repeats (5) times, alternating, and its fastest run counts (the machine is shared). Each family's
documents are also checked against HF tokenizers' own encoding (BOS from the post-processor, special-token names
read as text) plus the eos id, over the whole corpus.

    .venv/bin/python benchmarks/bench_prepare_families.py
    .venv/bin/python benchmarks/bench_prepare_families.py --copies 1 --repeats 2 --families llama-3-style
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench_prepare import make_input      # the same input as the GPT-2 path's own benchmark

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def first_texts(data: Path, size: int = 4 * 2**20) -> list[str]:
    "The documents in the first `size` bytes of the JSON Lines file `data`"
    with open(data, encoding='utf-8') as f:
        return [json.loads(line)['text'] for line in f.read(size).splitlines()[:-1]]


def mistral_folder(folder: Path, data: Path) -> Path:
    "A Mistral-style model folder: sentencepiece's BPE trained on the start of `data`, converted by transformers"
    import sentencepiece
    import transformers
    src = folder / 'mistral-sentencepiece'
    src.mkdir()
    lines = (line for text in first_texts(data) for line in text.splitlines() if line.strip())
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines, model_prefix=str(src / 'tokenizer'), model_type='bpe', vocab_size=32000,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name='identity', character_coverage=0.99995, num_threads=2, minloglevel=2)
    (src / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'LlamaTokenizer', 'legacy': False, 'add_bos_token': True, 'add_eos_token': False,
        'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>'}))
    d = folder / 'mistral-style'
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(d))
    (d / 'config.json').write_text(json.dumps({'vocab_size': 32000, 'model_type': 'mistral', 'bos_token_id': 1,
                                               'eos_token_id': 2}))
    return d


def metaspace_hf_folder(folder: Path, data: Path) -> Path:
    "Mistral's rules (Metaspace, byte fallback, <s> before each text) on a BPE trained by HF on the start of `data`"
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token='<unk>', byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='\u2581', prepend_scheme='first', split=True)
    specials = ['<unk>', '<s>', '</s>'] + [f'<0x{i:02X}>' for i in range(256)]
    tok.train_from_iterator(first_texts(data), trainers.BpeTrainer(vocab_size=32000, special_tokens=specials))
    # trained inside words as sentencepiece trains; saved without a split, as Mistral's tokenizer.json is
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='\u2581', prepend_scheme='first', split=False)
    tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 1)])
    spec = json.loads(tok.to_str())
    spec['added_tokens'] = spec['added_tokens'][:3]                   # the byte tokens are plain vocabulary
    d = folder / 'metaspace-hf-trained'
    d.mkdir()
    (d / 'tokenizer.json').write_text(json.dumps(spec))
    (d / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'LlamaTokenizer', 'bos_token': '<s>',
                                                         'eos_token': '</s>', 'unk_token': '<unk>'}))
    (d / 'config.json').write_text(json.dumps({'vocab_size': 32000, 'model_type': 'mistral', 'bos_token_id': 1,
                                               'eos_token_id': 2}))
    return d


def family_folder(folder: Path, family: str, data: Path | None = None) -> Path:
    "A Hugging Face model folder (tokenizer.json, tokenizer_config.json, config.json) of `family` on GPT-2's merges"
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers as pt, processors

    from gptkit.tokenizer.bpe import gpt2
    tok = Tokenizer.from_str(gpt2().hf.to_str())
    if family == 'llama-3-style':
        spec = json.loads(tok.to_str())
        spec['model']['ignore_merges'] = True                       # as Llama 3's tokenizer.json says
        tok = Tokenizer.from_str(json.dumps(spec))
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(LLAMA3), 'isolated'), pt.ByteLevel(add_prefix_space=False,
                                                                                             use_regex=False)])
        tok.add_special_tokens(['<|begin_of_text|>', '<|end_of_text|>'])
        bos, eos = tok.token_to_id('<|begin_of_text|>'), tok.token_to_id('<|end_of_text|>')
        tok.post_processor = processors.TemplateProcessing(single='<|begin_of_text|> $A',
                                                           special_tokens=[('<|begin_of_text|>', bos)])
        config = {'model_type': 'llama', 'bos_token_id': bos, 'eos_token_id': eos}
    elif family == 'qwen-style':
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(QWEN), 'isolated'), pt.ByteLevel(add_prefix_space=False,
                                                                                           use_regex=False)])
        tok.add_special_tokens(['<|endoftext|>', '<|im_start|>', '<|im_end|>'])
        config = {'model_type': 'qwen2', 'eos_token_id': tok.token_to_id('<|endoftext|>')}
    elif family == 'mistral-style':
        return mistral_folder(folder, data)
    elif family == 'metaspace-hf-trained':
        return metaspace_hf_folder(folder, data)
    elif family == 'smollm2-style':
        tok.pre_tokenizer = pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)])
        config = {'model_type': 'llama', 'eos_token_id': tok.token_to_id('<|endoftext|>')}
    else:
        raise SystemExit(f'unknown family {family}')
    d = folder / family
    d.mkdir()
    tok.save(str(d / 'tokenizer.json'))
    (d / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'PreTrainedTokenizerFast'}))
    (d / 'config.json').write_text(json.dumps({'vocab_size': tok.get_vocab_size(), **config}))
    return d


def run(path: Path, prefix: Path, tokenizer: str, workers: int) -> tuple[float, int]:
    "Seconds for one whole prepare (tokenizer load included) and the tokens it wrote"
    from gptkit.data.prepare import PrepareConfig, prepare
    t = time.perf_counter()
    res = prepare(PrepareConfig(inputs=(str(path),), output_prefix=str(prefix), tokenizer=tokenizer, workers=workers,
                                clean=False, overwrite=True))
    return time.perf_counter() - t, res.tokens


def same_as_hf(path: Path, prefix: Path, folder: Path) -> bool:
    "Whether every document of the dataset at `prefix` is HF tokenizers' encoding of its text, then the eos id"
    from tokenizers import Tokenizer

    from gptkit.data.indexed import IndexedDataset
    hf = Tokenizer.from_file(str(folder / 'tokenizer.json'))
    hf.encode_special_tokens = True
    eos = json.loads((folder / 'config.json').read_text())['eos_token_id']
    texts = [json.loads(line)['text'] for line in path.read_text(encoding='utf-8').splitlines()]
    ds = IndexedDataset(f'{prefix}_text_document')
    want = (e.ids + [eos] for e in hf.encode_batch(texts, add_special_tokens=True))
    return len(ds) == len(texts) and all(ds[i].tolist() == w for i, w in enumerate(want))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--copies', type=int, default=3)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--repeats', type=int, default=5)
    ap.add_argument('--families', nargs='+', default=['llama-3-style', 'qwen-style', 'smollm2-style',
                                                      'mistral-style'])
    ap.add_argument('--no-check', action='store_true', help='skip the comparison with HF tokenizers')
    args = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        path, size, docs = make_input(d, args.copies)
        mb = size / 2**20
        print(f'input: {mb:.1f} MB, {docs:,} documents, {os.cpu_count()} cores, --workers {args.workers}, '
              f'best of {args.repeats}')
        paths = {'gpt2': 'gpt2', **{f: str(family_folder(d, f, path)) for f in args.families}}
        best = {name: (float('inf'), 0) for name in paths}
        for _ in range(args.repeats):
            for name, tokenizer in paths.items():
                best[name] = min(best[name], run(path, d / name, tokenizer, args.workers))
        gpt2_rate = best['gpt2'][1] / best['gpt2'][0]
        for name, (seconds, tokens) in best.items():
            rate = tokens / seconds
            check = '' if name == 'gpt2' or args.no_check else \
                f'  same ids as HF tokenizers: {same_as_hf(path, d / name, Path(paths[name]))}'
            print(f'{name:20s} {seconds:6.2f} s  {mb / seconds:6.1f} MB/s  {rate / 1e6:5.2f} M tokens/s  '
                  f'ratio to gpt2 {rate / gpt2_rate:4.2f}{check}')


if __name__ == '__main__':
    main()
