"MediaWiki XML dumps read as clean article text (gptkit.data.mediawiki), against the shipped enwiki/bgwiki samples"
import bz2
import io
import json
import re
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from gptkit.config import DataError
from gptkit.data.corpus import Tally
from gptkit.data.mediawiki import clean_wikitext, read_mediawiki

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tools'))
from peers import wikiextractor  # noqa: E402

DATA = Path(__file__).parent / 'data' / 'mediawiki'
EN = DATA / 'enwiki-sample-pages-articles.xml.bz2'
BG = DATA / 'bgwiki-latest-pages-articles-shortened.xml.bz2'


def read(raw: bytes, name='x.xml', tally=None):
    tally = tally if tally is not None else Tally()
    return list(read_mediawiki(io.BytesIO(raw), Path(name), tally)), tally


def test_articles_clean_and_skips():
    docs, tally = read(bz2.decompress(EN.read_bytes()))
    assert [d.line for d in docs] == [3, 4, 5, 7, 8, 9, 10]   # redirects (1, 2) and Wikipedia: page (6) skipped
    assert tally.problems == {}
    for d in docs:
        assert not re.search(r"\{\{|\}\}|\[\[|\]\]|''|<ref|&nbsp;|&quot;|Category:|File:|thumb\|", d.text), d.text
    assert docs[1].text.startswith('Actresses (Catalan: Actrius) is a 1997 Catalan language Spanish drama film')
    assert 'Carlos Albiac' not in docs[0].text        # infobox of Albedo (template) gone
    bg, _ = read(bz2.decompress(BG.read_bytes()))     # UTF-16 encoded dump, Cyrillic kept, ns 4 pages skipped
    assert len(bg) == 1 and bg[0].text.startswith('Григорианският календар')


def test_export_namespace_versions():
    page = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-%s/"><page><title>T</title><ns>0</ns><id>1</id>'
            '<revision><text>[[a|b]] c</text></revision></page></mediawiki>')
    for v in ('0.10', '0.11'):
        docs, _ = read((page % v).encode())
        assert [d.text for d in docs] == ['b c']


def test_broken_markup_counted_and_strict():
    raw = bz2.decompress(EN.read_bytes()).replace(b'{{Infobox film', b'{{Infobox film {{unclosed', 1)
    docs, tally = read(raw, 'broken.xml')
    assert len(docs) == 7 and tally.problems == {'broken_markup': 1}
    assert "broken.xml:4: broken markup: page 'Actrius'" in tally.examples[0]
    with pytest.raises(DataError, match=r"broken.xml:4: broken markup: page 'Actrius'.*--strict"):
        read(raw, 'broken.xml', Tally(strict=True))
    text, broken = clean_wikitext("a [[b c\n'''d''' {{e")
    assert text == 'a b c\nd e' and sorted(broken) == ['[[', '{{']


def test_truncated_bz2_keeps_earlier_pages():
    raw = bz2.decompress(EN.read_bytes())
    chunks = raw.split(b'  <page>')
    multi = b''.join(bz2.compress((b'  <page>' if i else b'') + c) for i, c in enumerate(chunks))
    tally = Tally()
    docs = list(read_mediawiki(bz2.BZ2File(io.BytesIO(multi[:-3000])), Path('cut.xml.bz2'), tally))
    full, _ = read(raw)
    assert 0 < len(docs) < 7 and [d.text for d in docs] == [d.text for d in full[:len(docs)]]
    assert tally.problems == {'truncated_file': 1} and 'cut.xml.bz2:' in tally.examples[0]
    docs, tally = read(raw[:-2000], 'cut.xml')   # XML cut in the middle of a page
    assert 0 < len(docs) < 7 and tally.problems == {'truncated_file': 1}
    with pytest.raises(DataError, match='cut.xml:.*truncated file'):
        read(raw[:-2000], 'cut.xml', Tally(strict=True))


def test_bounded_memory():
    body = '[[Link|label]] text {{cite|x}} ' * 400                 # ~12 KB of wikitext per page
    page = f'<page><title>P</title><ns>0</ns><revision><text>{body}</text></revision></page>'
    raw = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/">' + page * 200 + '</mediawiki>').encode()
    stream = io.BytesIO(raw)
    del raw
    tracemalloc.start()
    n = sum(1 for _ in read_mediawiki(stream, Path('big.xml'), Tally()))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 200
    assert peak < 2_000_000, peak          # ~2.5 MB of XML read holding about one page at a time


def test_against_wikiextractor(tmp_path):
    r = wikiextractor(EN, tmp_path)
    if isinstance(r, str): pytest.skip(r)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = {}
    for f in tmp_path.rglob('wiki_*'):
        for line in f.read_text().splitlines():
            d = json.loads(line); theirs[d['title']] = d['text']
    words = lambda t: Counter(re.findall(r'\w+', t.lower()))
    docs, _ = read(bz2.decompress(EN.read_bytes()))
    titles = re.findall(r'<title>(.*?)</title>', bz2.decompress(EN.read_bytes()).decode())
    for d in docs:
        if titles[d.line - 1] not in theirs: continue   # wikiextractor leaves out disambiguation pages
        ours, ref = words(d.text), words(theirs[titles[d.line - 1]])
        recall = sum((ours & ref).values()) / max(1, sum(ref.values()))
        assert recall > 0.95, (titles[d.line - 1], recall)   # every word wikiextractor keeps, we keep
    # prose pages (not lists, which wikiextractor drops and we keep) agree both ways
    ours, ref = words(docs[3].text), words(theirs['International Atomic Time'])
    assert sum((ours & ref).values()) / sum(ours.values()) > 0.9
