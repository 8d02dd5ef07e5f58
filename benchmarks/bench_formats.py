"""Input formats and encoding speed of `gptkit data prepare`, each against a peer measured in the same run (issue 14).

1. Parquet against the same documents as JSON Lines (goal >= 0.9x), and whether the .bin/.idx bytes are identical.
2. prepare of the JSON Lines file against the tokenizer's raw batch encode of the same texts already in memory
   (HF tokenizers' encode_batch, Rust on all cores, and gptkit's own Tokenizer.encode_batch; goal >= 0.8x).
3. prepare with 1, 2 (and os.cpu_count(), if more) workers: MB/s, speed-up and MB/s per core.
4. A MediaWiki multistream dump (.xml.bz2): gptkit's reader alone (read_documents) with 1, 2 (and os.cpu_count())
   worker processes; then the dump to .bin/.idx by `gptkit data prepare` against the peers' pipeline, as
   Megatron-DeepSpeed's walkthrough runs it: wikiextractor 3.0.6 --json (under a Python < 3.11, as
   tests/test_mediawiki.py finds it), its wiki_* files joined into one file, then Megatron-LM's
   tools/preprocess_data.py with GPT2BPETokenizer (goal >= 3x). Every step runs as its command in a subprocess,
   start-up included; each is also run on the one-copy sample dump, and the ratio is printed both with start-up and
   for the extra pages alone. preprocess_data.py is not in the megatron-core wheel: give a Megatron-LM source tree
   with --megatron-lm PATH (or MEGATRON_LM), e.g. `git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM`
   (the tag of the installed megatron-core); without it the peer is wikiextractor alone, a lower bound.

Inputs: the built-in corpora (gptkit/assets/corpora/*.jsonl.gz) repeated to 30 MB x --scale, written as JSON Lines
and as Parquet (pyarrow, --row-group rows per row group); the pages of tests/data/mediawiki/enwiki-sample-*.xml.bz2
repeated with distinct titles and ids to 12 MB x --scale of XML, each article with about 24 KB of distinct paragraphs
from the built-in corpora added (12.6 MB of distinct text in all, then it repeats), compressed as a multistream dump
(streams of 100 pages, like Wikimedia's, with its index file). Every prepare runs
in this process with GPT-2's tokenizer and the default cleaning; times are wall clock around each call.

    .venv/bin/python benchmarks/bench_formats.py
    .venv/bin/python benchmarks/bench_formats.py --scale 4 --workers 8
    .venv/bin/python benchmarks/bench_formats.py --only-mediawiki --megatron-lm ~/Megatron-LM
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
from peers import megatron_checkout, megatron_preprocess, wikiextractor  # noqa: E402

WIKI = ROOT / 'tests' / 'data' / 'mediawiki' / 'enwiki-sample-pages-articles.xml.bz2'


def make_jsonl(folder: Path, target: int) -> tuple[Path, list[str]]:
    "The built-in corpora's documents, taken in turn until `target` bytes of JSON Lines"
    from gptkit.tokenizer.bpe import asset
    lines = [line for p in sorted(asset('corpora').glob('*.jsonl.gz'))
             for line in gzip.decompress(p.read_bytes()).splitlines(keepends=True) if line.strip()]
    out, size, i = [], 0, 0
    while size < target:
        out.append(lines[i % len(lines)]); size += len(lines[i % len(lines)]); i += 1
    path = folder / 'docs.jsonl'
    path.write_bytes(b''.join(out))
    return path, [json.loads(line)['text'] for line in out]


def make_parquet(folder: Path, texts: list[str], row_group: int) -> tuple[Path, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = folder / 'docs.parquet'
    pq.write_table(pa.table({'text': texts}), path, row_group_size=row_group)
    return path, pq.ParquetFile(path).num_row_groups


def corpus_paragraphs():
    "The built-in corpora's documents as blank-line paragraphs of distinct text, in turn, forever"
    from gptkit.tokenizer.bpe import asset
    while True:
        for p in sorted(asset('corpora').glob('*.jsonl.gz')):
            for line in gzip.decompress(p.read_bytes()).splitlines():
                if line.strip(): yield from (q for q in json.loads(line)['text'].split('\n\n') if q.strip())


_NOT_XML = re.compile('[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]')   # characters XML 1.0 does not allow


def make_dump(folder: Path, target: int, per_stream: int = 100, extra: int = 24_000) -> tuple[Path, int, int]:
    """The sample dump's pages repeated (titles and page ids made distinct) until `target` bytes of XML, each article
    given about `extra` characters of distinct paragraphs from the built-in corpora (so the text is not the same few
    pages again, which a tokenizer's word cache would make cheap), as a multistream .xml.bz2 (a header stream,
    `per_stream` pages a stream, a footer stream) with its index beside it, as Wikimedia's"""
    from html import escape
    xml = bz2.decompress(WIKI.read_bytes()).decode('utf-8')
    head, rest = xml.split('  <page>', 1)
    body, tail = ('  <page>' + rest).rsplit('  </page>\n', 1)
    sample = [p + '  </page>\n' for p in body.split('  </page>\n')]
    paragraphs = corpus_paragraphs()
    pages, size, k = [], len(head) + len(tail), 0
    while size < target or not pages:   # at least one copy
        for page in sample:
            if k: page = re.sub(r'<title>(.*?)</title>', rf'<title>\1 ({k})</title>', page)
            page = re.sub(r'\n    <id>(\d+)</id>', lambda m: f'\n    <id>{int(m[1]) + k * 10**7}</id>', page)
            if '<ns>0</ns>' in page and '#REDIRECT' not in page.upper() and '</text>' in page:
                added, n = [], 0
                while n < extra: added.append(next(paragraphs)); n += len(added[-1])
                added = _NOT_XML.sub('', escape('\n\n' + '\n\n'.join(added), quote=False))   # as dumps are
                page = page.replace('</text>', added + '</text>', 1)
            pages.append(page); size += len(page)
        k += 1
    path = folder / 'enwiki-repeated-pages-articles-multistream.xml.bz2'
    index, offset = [], 0
    with open(path, 'wb') as f:
        offset += f.write(bz2.compress(head.encode('utf-8')))
        for i in range(0, len(pages), per_stream):
            group = pages[i:i + per_stream]
            for p in group:
                pid, title = re.search(r'<id>(\d+)</id>', p)[1], re.search(r'<title>(.*?)</title>', p)[1]
                index.append(f'{offset}:{pid}:{title}\n')
            offset += f.write(bz2.compress(''.join(group).encode('utf-8')))
        f.write(bz2.compress(tail.encode('utf-8')))
    path.with_name(path.name.replace('.xml.bz2', '-index.txt.bz2')).write_bytes(bz2.compress(''.join(index).encode()))
    return path, size, len(pages)


def run_read(dump: Path, workers: int) -> tuple[float, int]:
    "gptkit's read_documents alone on the dump (decompress, parse, clean), no tokenizing: (seconds, articles)"
    from gptkit.data.corpus import read_documents
    from gptkit.data.document import Tally
    t = time.perf_counter()
    n = sum(1 for _ in read_documents([dump], Tally(), workers=workers))
    return time.perf_counter() - t, n


def run_prepare(inputs: Path, prefix: Path, workers: int, fmt: str = 'auto'):
    "gptkit's prepare in this process: (seconds, result)"
    from gptkit.data.prepare import PrepareConfig, prepare
    t = time.perf_counter()
    r = prepare(PrepareConfig(inputs=(str(inputs),), output_prefix=str(prefix), workers=workers, format=fmt))
    return time.perf_counter() - t, r


def same(a: str, b: str) -> bool:
    return all(Path(a + s).read_bytes() == Path(b + s).read_bytes() for s in ('.bin', '.idx'))


def batches(texts: list[str], batch_bytes: int = 1 << 20):
    "The texts in batches of about `batch_bytes` characters, as prepare batches them"
    batch, n = [], 0
    for t in texts:
        batch.append(t); n += len(t)
        if n >= batch_bytes: yield batch; batch, n = [], 0
    if batch: yield batch


def raw_encode(texts: list[str], cores: int) -> tuple[float, int, float, int, float]:
    """HF tokenizers' encode_batch and gptkit's Tokenizer.encode_batch on the texts in memory: seconds and tokens;
    and the seconds it takes to load the tokenizer and build its fast encoder (which prepare's time includes)"""
    from gptkit.tokenizer.bpe import load_tokenizer
    os.environ['RAYON_NUM_THREADS'] = str(cores)   # HF's thread pool reads it when it starts (on first use)
    os.environ['TOKENIZERS_PARALLELISM'] = 'true'
    t = time.perf_counter()
    tok = load_tokenizer('gpt2'); tok.encode_batch(['warm up'], cores)
    loading = time.perf_counter() - t
    tok.hf.encode_batch(['warm up'], add_special_tokens=False)
    t = time.perf_counter()
    hf_tokens = sum(len(e.ids) for b in batches(texts) for e in tok.hf.encode_batch(b, add_special_tokens=False))
    hf = time.perf_counter() - t
    t = time.perf_counter()
    own_tokens = sum(len(ids) for b in batches(texts) for ids in tok.encode_batch(b, cores))
    return hf, hf_tokens, time.perf_counter() - t, own_tokens, loading


def timed(cmd: list[str], what: str, **kw) -> float:
    "Seconds `cmd` takes as a subprocess; stops the benchmark with its output if it fails"
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw) if isinstance(cmd, list) else cmd()
    seconds = time.perf_counter() - t
    if isinstance(r, str): raise SystemExit(f'{what} cannot run: {r}')
    if r.returncode: raise SystemExit(f'{what} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}')
    return seconds


def gptkit_cli(dump: Path, prefix: Path, workers: int) -> float:
    "`gptkit data prepare` on the dump as a command: seconds, start-up included"
    cli = Path(sys.executable).with_name('gptkit')
    return timed([str(cli), 'data', 'prepare', '-i', str(dump), '--output-prefix', str(prefix),
                  '--workers', str(workers)], 'gptkit data prepare')


def peer_pipeline(dump: Path, out: Path, workers: int, tree) -> dict:
    """wikiextractor --json on the dump, its wiki_* files joined in order into one JSON Lines file, then
    preprocess_data.py on it if `tree` is a Megatron-LM source tree: seconds of each step, and the records"""
    out.mkdir()
    times = {'wikiextractor': timed(lambda: wikiextractor(dump, out / 'text', workers), 'wikiextractor')}
    t = time.perf_counter()
    joined = out / 'wiki.json'
    with open(joined, 'wb') as f:
        for part in sorted((out / 'text').rglob('wiki_*')): f.write(part.read_bytes())
    times['join'] = time.perf_counter() - t
    lines = joined.read_bytes().splitlines()
    times['records'] = len(lines)
    times['with_text'] = sum(1 for line in lines if json.loads(line)['text'].strip())
    if isinstance(tree, Path):
        times['preprocess_data'] = timed(lambda: megatron_preprocess(tree, joined, out / 'megatron', workers),
                                         'preprocess_data.py')
        from gptkit.data.indexed import IndexedDataset
        times['tokens'] = IndexedDataset(out / 'megatron_text_document').num_tokens
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--scale', type=float, default=1.0, help='input sizes times this (30 MB of text, 12 MB of XML)')
    ap.add_argument('--workers', type=int, default=os.cpu_count(), help='workers of prepare (parts 1, 2 and 4)')
    ap.add_argument('--row-group', type=int, default=2048, help='Parquet rows per row group')
    ap.add_argument('--only-mediawiki', action='store_true', help='run part 4 alone')
    ap.add_argument('--megatron-lm', help='a Megatron-LM source tree, for tools/preprocess_data.py (part 4)')
    args = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    cores = os.cpu_count()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        if not args.only_mediawiki:
            jsonl, texts = make_jsonl(d, int(30 * 2**20 * args.scale))
            parquet, groups = make_parquet(d, texts, args.row_group)
            mb = jsonl.stat().st_size / 2**20
            pq_mb = parquet.stat().st_size / 2**20
            print(f'input: {mb:.1f} MB of JSON Lines, {len(texts):,} documents; Parquet {pq_mb:.1f} MB in {groups} '
                  f'row groups of {args.row_group} rows;\n{cores} cores (load average before: '
                  f'{os.getloadavg()[0]:.2f}), '
                  f'GPT-2 tokenizer, prepare --workers {args.workers}')
            warm = d / 'warm.jsonl'
            warm.write_bytes(b''.join(jsonl.read_bytes().splitlines(keepends=True)[:50]))
            run_prepare(warm, d / 'warm', args.workers)   # imports and first builds, not timed

            print('\n1. Parquet against the same documents as JSON Lines')
            tj, rj = run_prepare(jsonl, d / 'jsonl', args.workers)
            tp, rp = run_prepare(parquet, d / 'parquet', args.workers)
            for name, t, r in (('JSON Lines', tj, rj), ('Parquet', tp, rp)):
                print(f'   prepare {name + ":":11} {t:6.2f} s  {mb / t:6.1f} MB/s  {r.documents:,} documents  '
                      f'{r.tokens:,} tokens')
            print(f'   ratio Parquet / JSON Lines: {tj / tp:.2f}x (goal >= 0.9x); '
                  f'same .bin/.idx bytes: {same(rj.prefix, rp.prefix)}  (MB/s: of the JSON Lines size)')

            print(f'\n2. prepare against the raw batch encode of the same texts (in memory, {cores} threads)')
            text_mb = sum(len(t.encode('utf-8')) for t in texts) / 2**20
            hf, hf_tokens, own, own_tokens, loading = raw_encode(texts, cores)
            print(f'   HF tokenizers encode_batch:     {hf:6.2f} s  {text_mb / hf:6.1f} MB/s  {hf_tokens:,} tokens')
            print(f'   gptkit Tokenizer.encode_batch:  {own:6.2f} s  {text_mb / own:6.1f} MB/s  {own_tokens:,} tokens')
            print(f'   prepare JSON Lines (part 1):    {tj:6.2f} s  {text_mb / tj:6.1f} MB/s  '
                  f'{rj.tokens - rj.documents:,} tokens + {rj.documents:,} end-of-document')
            print(f'   ratio prepare / HF encode_batch: {hf / tj:.2f}x; prepare / Tokenizer.encode_batch: '
                  f'{own / tj:.2f}x (goal >= 0.8x)\n   (MB/s: of the {text_mb:.1f} MB of UTF-8 text; prepare reads, '
                  f'cleans, encodes, writes it)')
            print(f'   loading GPT-2\'s tokenizer and building its fast encoder: {loading:.2f} s, inside prepare\'s '
                  f'time, outside the raw encodes\'.\n   With it counted on both sides: prepare / '
                  f'Tokenizer.encode_batch: {(own + loading) / tj:.2f}x; without it on either: '
                  f'{own / max(tj - loading, 1e-9):.2f}x')

            print('\n3. prepare of the JSON Lines with more workers (encoding scales with cores)')
            counts = sorted({1, 2, cores})
            times = {w: tj if w == args.workers else run_prepare(jsonl, d / f'w{w}', w)[0] for w in counts}
            for w in counts:
                print(f'   --workers {w:<3}: {times[w]:6.2f} s  {mb / times[w]:6.1f} MB/s  '
                      f'speed-up {times[1] / times[w]:.2f}x  {mb / times[w] / min(w, cores):5.1f} MB/s per core')

        else:
            print(f'{cores} cores (load average before: {os.getloadavg()[0]:.2f}), GPT-2 tokenizer, prepare --workers '
                  f'{args.workers}')
        print('\n4. a MediaWiki multistream dump: the reader alone by workers, prepare, and wikiextractor 3.0.6')
        dump, xml_size, pages = make_dump(d, int(12 * 2**20 * args.scale))
        xml_mb = xml_size / 2**20
        print(f'   dump: {dump.stat().st_size / 2**20:.2f} MB .xml.bz2 in streams of 100 pages with its index '
              f'({xml_size / dump.stat().st_size:.1f}x smaller than its XML), {xml_mb:.1f} MB of XML, {pages:,} pages')
        reads = {w: run_read(dump, w) for w in sorted({1, 2, cores})}
        for w, (t, n) in reads.items():
            print(f'   read_documents(workers={w}) (decompress + parse + clean): {t:6.2f} s  {xml_mb / t:6.1f} MB/s '
                  f'of XML  {n:,} articles  speed-up {reads[1][0] / t:.2f}x  {xml_mb / t / min(w, cores):5.1f} MB/s '
                  f'per core')
        tw, rw = run_prepare(dump, d / 'wiki', args.workers)
        print(f'   gptkit prepare (extract + tokenize + write) in this process, --workers {args.workers}: {tw:6.2f} s  '
              f'{xml_mb / tw:6.1f} MB/s of XML  {rw.documents:,} articles  {rw.tokens:,} tokens')
        tree = megatron_checkout(args.megatron_lm or os.environ.get('MEGATRON_LM'))
        (d / 'small').mkdir()
        small, small_size, small_pages = make_dump(d / 'small', 1)
        runs = {}
        for name, path in (('full', dump), ('sample', small)):
            runs[name] = {'gptkit': gptkit_cli(path, d / f'cli-{name}', args.workers),
                          **peer_pipeline(path, d / f'peer-{name}', args.workers, tree)}
        full, one = runs['full'], runs['sample']
        steps = ['wikiextractor', 'join'] + (['preprocess_data'] if 'preprocess_data' in full else [])
        print(f'   as commands, --workers/--processes {args.workers}, on this dump and on the one-copy sample '
              f'({small_pages} pages, {small_size / 2**20:.1f} MB of XML; start-up and imports):')
        for step in ['gptkit'] + steps:
            extra = full[step] - one[step]
            print(f'     {step:16} {full[step]:7.2f} s   sample {one[step]:6.2f} s   extra pages '
                  f'{extra:7.2f} s  {(xml_mb - small_size / 2**20) / max(extra, 1e-9):6.1f} MB/s of XML')
        print(f'   wikiextractor wrote {full["records"]:,} records, {full["with_text"]:,} with text (redirects are '
              f'records without text); gptkit wrote {rw.documents:,} articles')
        peer, peer_one = sum(full[s] for s in steps), sum(one[s] for s in steps)
        name = ' + '.join(steps)
        if 'preprocess_data' in full:
            print(f'   preprocess_data.py wrote {full["tokens"]:,} tokens (gptkit: {rw.tokens:,})')
        else:
            print(f'   preprocess_data.py skipped: {tree}; the ratio below is a lower bound of the issue\'s')
        print(f'   ratio gptkit / ({name}) (speed): {peer / full["gptkit"]:.2f}x with start-up, '
              f'{(peer - peer_one) / max(full["gptkit"] - one["gptkit"], 1e-9):.2f}x on the extra pages '
              f'(goal >= 3x)')

if __name__ == '__main__':
    main()
