"""Rebuild the input-format samples in tests/data/formats/ from data that ships in this repository.

Not run by the tests: the samples are committed. It documents, and can repeat, how they were made
(tests/data/formats/README.md says what each file holds and where its text comes from):

    .venv/bin/python tools/make_format_samples.py            # needs pyarrow, datasets and wikiextractor (dev)

Every sample is made from gptkit's built-in corpora (gptkit/assets/corpora, provenance in
gptkit/assets/PROVENANCE.md) or from tests/data/mediawiki; nothing is downloaded.
"""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'tests' / 'data' / 'formats'
CORPORA = ROOT / 'gptkit' / 'assets' / 'corpora'
sys.path.insert(0, str(ROOT / 'tools'))


def corpus(name: str) -> list[dict]:
    "The documents ({'title', 'text'}) of a built-in corpus"
    with gzip.open(CORPORA / f'{name}.jsonl.gz', 'rt', encoding='utf-8') as f: return [json.loads(l) for l in f]


def fineweb_parquet(path: Path):
    "12 short Wikipedia articles in FineWeb's column layout, 4 rows per row group (3 row groups)"
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gptkit.tokenizer.bpe import load_tokenizer
    docs = [d for d in corpus('wikipedia') if len(d['text']) < 8000][:12]
    texts = [d['text'] for d in docs]
    table = pa.table({
        'text': texts,
        'id': [f'<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, "gptkit:wikipedia:" + d["title"])}>' for d in docs],
        'url': ['https://en.wikipedia.org/wiki/' + d['title'].replace(' ', '_') for d in docs],
        'language': ['en'] * len(docs),
        'token_count': pa.array([len(ids) for ids in load_tokenizer('gpt2').encode_batch(texts)], pa.int64()),
    })
    pq.write_table(table, path, row_group_size=4)


def hf_save_to_disk(path: Path):
    "Genesis 1-12 (KJV), written by Hugging Face datasets' save_to_disk in 2 shards"
    import datasets
    docs = corpus('kjv')[:12]
    ds = datasets.Dataset.from_dict({'title': [d['title'] for d in docs], 'text': [d['text'] for d in docs]})
    shutil.rmtree(path, ignore_errors=True)
    ds.save_to_disk(str(path), num_shards=2)


def wikiextractor_output(path: Path):
    "wikiextractor 3.0.6 --json on tests/data/mediawiki/enwiki-sample-pages-articles.xml.bz2 (its AA/wiki_00)"
    from peers import wikiextractor
    with tempfile.TemporaryDirectory() as tmp:
        r = wikiextractor(ROOT / 'tests' / 'data' / 'mediawiki' / 'enwiki-sample-pages-articles.xml.bz2', Path(tmp))
        if isinstance(r, str): raise SystemExit(f'wikiextractor: {r}')
        if r.returncode: raise SystemExit(f'wikiextractor failed: {r.stderr}')
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(tmp, path)


def psalms_jsonl_xz(path: Path):
    "Psalms 1-20 (KJV) as JSON Lines, xz-compressed"
    docs = [d for d in corpus('kjv') if d['title'].startswith('Psalms ')][:20]
    data = ''.join(json.dumps(d, ensure_ascii=False) + '\n' for d in docs).encode('utf-8')
    path.write_bytes(lzma.compress(data, preset=9))


def shakespeare_txt_bz2(path: Path):
    "The first 200 lines of Tiny Shakespeare and the rest of that speech (up to its blank line), bz2-compressed"
    lines = []
    with gzip.open(CORPORA / 'tiny_shakespeare.txt.gz', 'rt', encoding='utf-8') as f:
        for line in f:
            lines.append(line)
            if len(lines) >= 200 and line == '\n': break
    path.write_bytes(bz2.compress(''.join(lines).encode('utf-8'), 9))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    fineweb_parquet(OUT / 'fineweb_layout.parquet')
    hf_save_to_disk(OUT / 'kjv_save_to_disk')
    wikiextractor_output(OUT / 'wikiextractor')
    psalms_jsonl_xz(OUT / 'psalms.jsonl.xz')
    shakespeare_txt_bz2(OUT / 'tiny_shakespeare_head.txt.bz2')
    for p in sorted(OUT.rglob('*')):
        if p.is_file(): print(f'{p.relative_to(OUT)}: {p.stat().st_size:,} bytes')


if __name__ == '__main__':
    main()
