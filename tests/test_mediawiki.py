"MediaWiki XML dumps read as clean article text (gptkit.data.mediawiki), against the shipped enwiki/bgwiki samples"
import bz2
import io
import json
import os
import re
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from gptkit.data.corpus import read_documents
from gptkit.data.document import Tally
from gptkit.data.mediawiki import (
    _scan_streams,
    bz2_streams,
    clean_wikitext,
    index_path,
    read_mediawiki,
    read_mediawiki_parallel,
)
from gptkit.errors import DataError

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


def multistream(raw: bytes, sizes=(2, 3)) -> tuple[bytes, bytes]:
    "A multistream dump of `raw` (header stream, pages in streams of 2 and 3 in turn, footer stream) and its index"
    head, rest = raw.split(b'  <page>', 1)
    body, foot = (b'  <page>' + rest).rsplit(b'  </page>\n', 1)
    pages = [p + b'  </page>\n' for p in body.split(b'  </page>\n')]
    out, index, i, k = [bz2.compress(head)], [], 0, 0
    while i < len(pages):
        group, off = pages[i:i + sizes[k % len(sizes)]], sum(map(len, out))
        for p in group:
            pid, title = re.search(rb'<id>(\d+)</id>', p)[1], re.search(rb'<title>(.*?)</title>', p)[1]
            index.append(b'%d:%s:%s\n' % (off, pid, title))
        out.append(bz2.compress(b''.join(group))); i += len(group); k += 1
    out.append(bz2.compress(foot))
    return b''.join(out), bz2.compress(b''.join(index))


@pytest.fixture(scope='module')
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp('multistream')
    packed, index = multistream(bz2.decompress(EN.read_bytes()))
    path = d / 'enwiki-sample-pages-articles-multistream.xml.bz2'
    path.write_bytes(packed)
    return path, index


def serial_read(path: Path, tally=None):
    tally = tally if tally is not None else Tally()
    return [(d.text, d.source, d.line) for d in read_mediawiki(bz2.BZ2File(path), path, tally)], tally


def parallel_read(path: Path, tally=None, **kw):
    tally = tally if tally is not None else Tally()
    docs = read_mediawiki_parallel(path, tally, 2, task_bytes=1, **kw)
    return [(d.text, d.source, d.line) for d in docs], tally


def test_stream_offsets(dump):
    path, index = dump
    scanned = _scan_streams(path)
    assert len(scanned) == 1 + 4 + 1                     # header, 10 pages in streams of 2, 3, 2, 3, footer
    assert _scan_streams(path, chunk=5) == scanned       # headers across chunk boundaries
    assert bz2_streams(path) == scanned                  # no index beside it: scanned
    raw = path.read_bytes()
    fake = raw[:300] + b'BZh91AY&SY' + raw[300:]         # a chance header inside compressed data is refused
    other = path.with_name('fake.xml.bz2'); other.write_bytes(fake)
    assert _scan_streams(other) == [0] + [s + 10 for s in scanned[1:]]


@pytest.mark.parametrize('with_index', [False, True])
def test_parallel_equals_serial(dump, with_index):
    path, index = dump
    idx = index_path(path)
    idx.unlink(missing_ok=True)
    if with_index: idx.write_bytes(index)
    try:
        assert (bz2_streams(path) == _scan_streams(path)[:-1]) is with_index   # the index names no footer
        raw = bz2.decompress(EN.read_bytes()).replace(b'{{Infobox film', b'{{Infobox film {{unclosed', 1)
        broken, _ = multistream(raw)
        bpath = path.with_name('broken-multistream.xml.bz2'); bpath.write_bytes(broken)
        for p in (path, bpath):
            ours, tally = parallel_read(p)
            theirs, ttally = serial_read(p)
            assert [d[2] for d in ours] == [3, 4, 5, 7, 8, 9, 10] and ours == theirs
            assert (tally.problems, tally.examples) == (ttally.problems, ttally.examples)
        assert tally.problems == {'broken_markup': 1}
        with pytest.raises(DataError, match=r"broken-multistream.xml.bz2:4: broken markup: page 'Actrius'.*--strict"):
            parallel_read(bpath, Tally(strict=True))
    finally:
        idx.unlink(missing_ok=True)


def test_read_documents_workers(dump):
    path, _ = dump
    t1, t2 = Tally(), Tally()
    one = [(d.text, d.line) for d in read_documents([path], t1)]
    two = [(d.text, d.line) for d in read_documents([path], t2, workers=2)]
    assert one == two and len(two) == 7
    assert (t1.documents, t1.bytes, t1.input_bytes, t1.problems) == (t2.documents, t2.bytes, t2.input_bytes,
                                                                     t2.problems)
    assert read_mediawiki_parallel(EN, Tally(), 2) is None      # a single-stream dump: the serial path
    assert read_mediawiki_parallel(path, Tally(), 1) is None
    import multiprocessing.pool
    made, Pool = [], multiprocessing.pool.Pool
    class Counting(Pool):
        def __init__(self, processes=None, *a, **kw): made.append(processes); super().__init__(processes, *a, **kw)
    multiprocessing.pool.Pool = Counting
    try: many = [(d.text, d.line) for d in read_documents([path], Tally(), workers=10**6)]   # a huge --workers
    finally: multiprocessing.pool.Pool = Pool
    assert many == one and len(made) == 1 and 2 <= made[0] <= max(2, len(os.sched_getaffinity(0)))


def test_wrong_index_refused(dump):
    path, index = dump
    idx = index_path(path)
    idx.write_bytes(bz2.compress(b'700:12:Anarchism\n'))
    try:
        with pytest.raises(DataError, match='index of another dump'):
            parallel_read(path)
    finally:
        idx.unlink()


def test_parallel_truncated(dump, tmp_path):
    path, _ = dump
    starts = _scan_streams(path)
    cut = tmp_path / 'cut-multistream.xml.bz2'
    cut.write_bytes(path.read_bytes()[:starts[3] + 100])       # inside the third page stream (pages 6 and 7)
    ours, tally = parallel_read(cut)
    theirs, ttally = serial_read(cut)
    assert ours == theirs and [d[2] for d in ours] == [3, 4, 5]   # pages 1-5 of the intact streams
    assert tally.problems == {'truncated_file': 1} and tally.examples == ttally.examples
    assert 'cut-multistream.xml.bz2:6: truncated file' in tally.examples[0]
    with pytest.raises(DataError, match='cut-multistream.xml.bz2:6: truncated file'):
        parallel_read(cut, Tally(strict=True))
    ends = tmp_path / 'nofooter-multistream.xml.bz2'              # cut at a stream boundary: </mediawiki> missing
    ends.write_bytes(path.read_bytes()[:starts[-1]])
    ours, tally = parallel_read(ends)
    theirs, ttally = serial_read(ends)
    assert ours == theirs and len(ours) == 7
    assert tally.problems == {'truncated_file': 1} and tally.examples == ttally.examples


def test_early_stop_leaves_no_process(dump):
    import multiprocessing as mp
    path, _ = dump
    before = set(mp.active_children())
    docs = read_mediawiki_parallel(path, Tally(), 2, task_bytes=1)
    next(docs)
    assert len(set(mp.active_children()) - before) == 2
    docs.close()
    assert set(mp.active_children()) == before


def test_prepare_workers_read_a_multistream_dump_in_processes(dump, tmp_path, monkeypatch):
    "prepare --workers 2 hands the dump to worker processes (streams in tasks of one) and writes the same bytes"
    import gptkit.data.corpus as corpus
    import gptkit.data.mediawiki as mw
    from gptkit.data.prepare import PrepareConfig, prepare
    path, _ = dump
    calls, real = [], mw.read_mediawiki_parallel
    def small_tasks(path, tally, workers, seen=None, **kw):
        docs = real(path, tally, workers, seen, task_bytes=1)
        calls.append(docs is not None)
        return docs
    monkeypatch.setattr(corpus, 'read_mediawiki_parallel', small_tasks)   # where the corpus reader looks it up
    one = prepare(PrepareConfig(inputs=(str(path),), output_prefix=str(tmp_path / 'one'), workers=1))
    two = prepare(PrepareConfig(inputs=(str(path),), output_prefix=str(tmp_path / 'two'), workers=2))
    assert calls == [True]                                 # workers=1 never asks for processes; workers=2 got them
    assert (one.documents, one.tokens) == (two.documents, two.tokens) and one.documents == 7
    for suffix in ('.bin', '.idx'):
        assert Path(one.prefix + suffix).read_bytes() == Path(two.prefix + suffix).read_bytes()


@pytest.mark.parametrize('encoding', ['utf-16', 'utf-32'])
def test_multistream_dump_in_utf16_or_utf32_reads_as_the_serial_reader(tmp_path, encoding):
    "A multistream .xml.bz2 that is not UTF-8 is read by the serial reader (the parallel one splits bytes at <page>)"
    text = bz2.decompress(BG.read_bytes()).decode('utf-16') if encoding == 'utf-32' else None
    raw = bz2.decompress(BG.read_bytes()) if text is None else text.encode('utf-32')
    unit = 2 if encoding == 'utf-16' else 4
    cut = len(raw) // 2 // unit * unit
    path = tmp_path / 'bg-multistream.xml.bz2'
    path.write_bytes(bz2.compress(raw[:cut]) + bz2.compress(raw[cut:]))      # two bz2 streams
    serial, t1 = Tally(), Tally()
    want = [d.text for d in read_mediawiki(io.BytesIO(raw), path, serial)]
    got = [d.text for d in read_documents([path], t1, workers=2)]
    assert len(want) == 1 and got == want and t1.problems == {}
