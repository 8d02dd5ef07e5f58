"""Input formats and encoding speed of `gptkit data prepare`, each against a peer measured in the same run (issue 14).

1. Parquet against the same documents as JSON Lines (goal >= 0.9x), and whether the .bin/.idx bytes are identical.
2. prepare of the JSON Lines file against the tokenizer's raw batch encode of the same texts already in memory
   (HF tokenizers' encode_batch, Rust on all cores, and gptkit's own Tokenizer.encode_batch; goal >= 0.8x).
3. prepare with 1, 2 (and os.cpu_count(), if more) workers: MB/s, speed-up and MB/s per core.
4. A MediaWiki multistream dump (.xml.bz2): gptkit's reader alone (read_documents) with 1, 2 (and os.cpu_count())
   worker processes, then the dump to .bin/.idx against wikiextractor 3.0.6's extraction alone (run under a Python
   < 3.11, as tests/test_mediawiki.py finds it). Megatron's tools/preprocess_data.py is not installed here, so
   the printed ratio is a lower bound of the issue's (wikiextractor, then preprocess_data.py; goal >= 3x).

Inputs: the built-in corpora (gptkit/assets/corpora/*.jsonl.gz) repeated to 30 MB x --scale, written as JSON Lines
and as Parquet (pyarrow, --row-group rows per row group); the pages of tests/data/mediawiki/enwiki-sample-*.xml.bz2
repeated with distinct titles and ids to 12 MB x --scale of XML, compressed as a multistream dump (streams of 100
pages, like Wikimedia's, with its index file). Every prepare runs
in this process with GPT-2's tokenizer and the default cleaning; times are wall clock around each call.

    .venv/bin/python benchmarks/bench_formats.py
    .venv/bin/python benchmarks/bench_formats.py --scale 4 --workers 8
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
from peers import wikiextractor  # noqa: E402

WIKI = ROOT / 'tests' / 'data' / 'mediawiki' / 'enwiki-sample-pages-articles.xml.bz2'


def make_jsonl(folder: Path, target: int) -> tuple[Path, list[str]]:
    "The built-in corpora's documents, taken in turn until `target` bytes of JSON Lines"
    from gptkit.tokenizer import asset
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


def make_dump(folder: Path, target: int, per_stream: int = 100) -> tuple[Path, int, int]:
    """The sample dump's pages repeated (titles and page ids made distinct) until `target` bytes of XML, as a
    multistream .xml.bz2 (a header stream, `per_stream` pages a stream, a footer stream) with its index beside it,
    as Wikimedia's"""
    xml = bz2.decompress(WIKI.read_bytes()).decode('utf-8')
    head, rest = xml.split('  <page>', 1)
    body, tail = ('  <page>' + rest).rsplit('  </page>\n', 1)
    sample = [p + '  </page>\n' for p in body.split('  </page>\n')]
    pages, size, k = [], len(head) + len(tail), 0
    while size < target:
        for page in sample:
            if k: page = re.sub(r'<title>(.*?)</title>', rf'<title>\1 ({k})</title>', page)
            page = re.sub(r'\n    <id>(\d+)</id>', lambda m: f'\n    <id>{int(m[1]) + k * 10**7}</id>', page)
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
    from gptkit.data.corpus import Tally, read_documents
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
    from gptkit.tokenizer import load
    os.environ['RAYON_NUM_THREADS'] = str(cores)   # HF's thread pool reads it when it starts (on first use)
    os.environ['TOKENIZERS_PARALLELISM'] = 'true'
    t = time.perf_counter()
    tok = load('gpt2'); tok.encode_batch(['warm up'], cores)
    loading = time.perf_counter() - t
    tok.hf.encode_batch(['warm up'], add_special_tokens=False)
    t = time.perf_counter()
    hf_tokens = sum(len(e.ids) for b in batches(texts) for e in tok.hf.encode_batch(b, add_special_tokens=False))
    hf = time.perf_counter() - t
    t = time.perf_counter()
    own_tokens = sum(len(ids) for b in batches(texts) for ids in tok.encode_batch(b, cores))
    return hf, hf_tokens, time.perf_counter() - t, own_tokens, loading


def run_wikiextractor(dump: Path, out: Path, processes: int) -> tuple[float, int, int] | str:
    "wikiextractor 3.0.6 --json on the dump: (seconds, records written, records with text), or why it cannot run"
    t = time.perf_counter()
    r = wikiextractor(dump, out, processes)
    seconds = time.perf_counter() - t
    if isinstance(r, str): return r
    if r.returncode: raise SystemExit(f'wikiextractor failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}')
    texts = [json.loads(line)['text'] for f in out.rglob('wiki_*') for line in f.read_bytes().splitlines()]
    return seconds, len(texts), sum(1 for t in texts if t.strip())   # it writes redirects as records without text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--scale', type=float, default=1.0, help='input sizes times this (30 MB of text, 12 MB of XML)')
    ap.add_argument('--workers', type=int, default=os.cpu_count(), help='workers of prepare (parts 1, 2 and 4)')
    ap.add_argument('--row-group', type=int, default=2048, help='Parquet rows per row group')
    ap.add_argument('--only-mediawiki', action='store_true', help='run part 4 alone')
    args = ap.parse_args()
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
              f'(repeats compress better than a real dump), {xml_mb:.1f} MB of XML, {pages:,} pages')
        reads = {w: run_read(dump, w) for w in sorted({1, 2, cores})}
        for w, (t, n) in reads.items():
            print(f'   read_documents(workers={w}) (decompress + parse + clean): {t:6.2f} s  {xml_mb / t:6.1f} MB/s '
                  f'of XML  {n:,} articles  speed-up {reads[1][0] / t:.2f}x  {xml_mb / t / min(w, cores):5.1f} MB/s '
                  f'per core')
        tw, rw = run_prepare(dump, d / 'wiki', args.workers)
        print(f'   gptkit prepare (extract + tokenize + write), --workers {args.workers}: {tw:6.2f} s  '
              f'{xml_mb / tw:6.1f} MB/s of XML  {rw.documents:,} articles  {rw.tokens:,} tokens')
        peer = run_wikiextractor(dump, d / 'wikiextractor', args.workers)
        if isinstance(peer, str):
            print(f'   wikiextractor skipped: {peer}')
        else:
            te, records, articles = peer
            print(f'   wikiextractor --json --processes {args.workers} (extract only): {te:6.2f} s  '
                  f'{xml_mb / te:6.1f} MB/s of XML  {records:,} records, {articles:,} with text')
            print(f'   ratio gptkit / wikiextractor alone (speed): {te / tw:.2f}x. A lower bound of the issue\'s '
                  f'ratio (goal >= 3x),\n   whose peer adds Megatron\'s preprocess_data.py (not installed here) '
                  f'to the extraction')


if __name__ == '__main__':
    main()
