"""`gptkit data prepare` against a plain single-process reference and, if given, Megatron's preprocess_data.py.

Input: the built-in Shakespeare, Milton and KJV corpora as one JSON Lines file, repeated --copies times
(3 copies: 33 MB, 3,714 documents). Every run writes .bin/.idx with GPT-2's tokenizer and --append-eod, and
the bytes are compared. gptkit runs with --no-clean so its output can be byte-identical to Megatron's.

    .venv/bin/python benchmarks/bench_prepare.py
    .venv/bin/python benchmarks/bench_prepare.py --megatron-lm DIR --megatron-python PY

DIR is a Megatron-LM checkout (tag core_v0.16.1: tools/preprocess_data.py and megatron/ without core/),
PY a Python with megatron-core 0.16.1, triton, six, regex, pyyaml and pydantic installed. Megatron's
code is never part of gptkit; run it from a temporary folder.
"""
from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def make_input(folder: Path, copies: int) -> tuple[Path, int, int]:
    from gptkit.tokenizer.bpe import asset
    chunks = [gzip.decompress(asset('corpora', f'{n}.jsonl.gz').read_bytes()) for n in ('shakespeare', 'milton', 'kjv')]
    data = b''.join(chunks) * copies
    path = folder / 'input.jsonl'
    path.write_bytes(data)
    return path, len(data), data.count(b'\n')


def timed(cmd, **kw) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode: raise SystemExit(f'{cmd[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}')
    return time.perf_counter() - t


def reference(path: Path, prefix: Path, tokenizer: str) -> float:
    "The plain way: one process, HF tokenizers one document at a time, gptkit's writer"
    import json
    from gptkit.data.indexed import IndexedWriter, token_dtype
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tokenizer)
    t = time.perf_counter()
    with open(path, encoding='utf-8') as f, IndexedWriter(prefix, token_dtype(tok.vocab_size)) as w:
        for line in f:
            ids = tok.hf.encode(json.loads(line)['text'], add_special_tokens=False).ids
            w.add_document(ids + [tok.eod])
    return time.perf_counter() - t


def same(a: Path, b: Path) -> bool:
    return all(Path(str(a) + s).read_bytes() == Path(str(b) + s).read_bytes() for s in ('.bin', '.idx'))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--copies', type=int, default=3)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--megatron-lm', type=Path)
    ap.add_argument('--megatron-python', type=Path)
    ap.add_argument('--tokenizer', default='gpt2', help="'gpt2' or a directory saved by gptkit (vocab.json, merges.txt)")
    args = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        path, size, docs = make_input(d, args.copies)
        mb = size / 2**20
        print(f'input: {mb:.1f} MB, {docs:,} documents, {os.cpu_count()} cores, tokenizer {args.tokenizer}')
        ours = timed([str(BIN / 'gptkit'), 'data', 'prepare', '-i', str(path), '--output-prefix', str(d / 'gptkit'),
                      '--no-clean', '--workers', str(args.workers), '--tokenizer', args.tokenizer])
        ref = reference(path, d / 'ref_text_document', args.tokenizer)
        print(f'gptkit data prepare --workers {args.workers}: {ours:6.2f} s  {mb / ours:6.1f} MB/s  {docs / ours:8,.0f} docs/s  (whole process)')
        print(f'single-process reference (HF):    {ref:6.2f} s  {mb / ref:6.1f} MB/s  {docs / ref:8,.0f} docs/s')
        print(f'ratio gptkit / reference: {ref / ours:.2f}x faster; same bytes: {same(d / "gptkit_text_document", d / "ref_text_document")}')
        if args.megatron_lm:
            from gptkit.tokenizer.bpe import load_tokenizer, save_tokenizer
            vocab = save_tokenizer(load_tokenizer(args.tokenizer), d / 'tokenizer')   # vocab.json + merges.txt, as Megatron reads them
            meg = timed([str(args.megatron_python or sys.executable), 'tools/preprocess_data.py', '--input', str(path),
                         '--output-prefix', str(d / 'megatron'), '--tokenizer-type', 'GPT2BPETokenizer',
                         '--vocab-file', str(vocab / 'vocab.json'), '--merge-file', str(vocab / 'merges.txt'),
                         '--legacy-tokenizer', '--append-eod', '--workers', str(args.workers)],
                        cwd=args.megatron_lm, env={**os.environ, 'PYTHONPATH': str(args.megatron_lm)})
            print(f'Megatron preprocess_data.py --workers {args.workers}: {meg:6.2f} s  {mb / meg:6.1f} MB/s  {docs / meg:8,.0f} docs/s')
            print(f'ratio gptkit / Megatron: {meg / ours:.2f}x faster; same bytes: {same(d / "gptkit_text_document", d / "megatron_text_document")}')


if __name__ == '__main__':
    main()
