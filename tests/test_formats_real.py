"""Every input format on a real sample (tests/data/formats, made by tools/make_format_samples.py), and what the
Hugging Face `datasets` library itself writes: the documents and tokens equal those of the same texts as JSON Lines."""
import bz2
import json
import lzma
from pathlib import Path

import datasets  # a dev requirement (settings.ini); the tests must not skip in the dev venv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from gptkit.data.corpus import read_documents
from gptkit.data.prepare import PrepareConfig, prepare
from gptkit.errors import DataError
from gptkit_cli.main import app

FORMATS = Path(__file__).parent / 'data' / 'formats'
WIKI = FORMATS / 'wikiextractor'


def _wikiextractor_texts() -> list[str]:
    return [json.loads(l)['text'] for f in sorted(WIKI.rglob('wiki_*')) for l in f.read_text().splitlines()]


def _blank_line_blocks(text: str) -> list[str]:
    "Tiny Shakespeare's speeches: blocks of lines between empty lines, each line keeping its newline"
    assert '\n \n' not in text and text.endswith('\n\n')
    return [b + '\n' for b in text.strip('\n').split('\n\n')]


# sample -> (options, the texts read without gptkit, documents prepare writes: empty texts are dropped)
def _xz_jsonl_texts() -> list[str]:
    lines = lzma.decompress((FORMATS / 'psalms.jsonl.xz').read_bytes()).decode().splitlines()
    return [json.loads(l)['text'] for l in lines]


def _bz2_text() -> str:
    return bz2.decompress((FORMATS / 'tiny_shakespeare_head.txt.bz2').read_bytes()).decode()


SAMPLES = {
    'fineweb_layout.parquet': ({}, lambda: pq.read_table(FORMATS / 'fineweb_layout.parquet')['text'].to_pylist(), 12),
    'kjv_save_to_disk': ({}, lambda: list(datasets.load_from_disk(str(FORMATS / 'kjv_save_to_disk'))['text']), 12),
    'wikiextractor': ({'format': 'jsonl'}, _wikiextractor_texts, 6),
    'psalms.jsonl.xz': ({}, _xz_jsonl_texts, 20),
    'tiny_shakespeare_head.txt.bz2': ({}, lambda: [_bz2_text()], 1),
    'tiny_shakespeare_head.txt.bz2 blank-line': ({'txt_split': 'blank-line'},
                                                 lambda: _blank_line_blocks(_bz2_text()), 41),
}


def _same_dataset(a: str, b: str):
    for suffix in ('.bin', '.idx'):
        assert Path(a + suffix).read_bytes() == Path(b + suffix).read_bytes(), suffix


def _as_jsonl(texts: list[str], path: Path) -> Path:
    path.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts), encoding='utf-8')
    return path


def test_samples_are_small_and_documented():
    files = [p for p in FORMATS.rglob('*') if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 300_000
    readme = (FORMATS / 'README.md').read_text()
    for p in files:
        if p.name != 'README.md':
            assert p.parent.name in readme if p.parent != FORMATS else p.name in readme, p


@pytest.mark.parametrize('sample', SAMPLES)
def test_sample_reads_and_prepares_as_its_texts_in_json_lines(sample, tmp_path):
    opts, texts, written = SAMPLES[sample]
    name = sample.split()[0]
    expected = texts()
    got = [d.text for d in read_documents([FORMATS / name], fmt=opts.get('format', 'auto'),
                                          txt_split=opts.get('txt_split', 'file'))]
    assert got == expected
    res = prepare(PrepareConfig(inputs=(str(FORMATS / name),), output_prefix=str(tmp_path / 'sample'), **opts))
    ref = prepare(PrepareConfig(inputs=(str(_as_jsonl(expected, tmp_path / 'ref.jsonl')),),
                                output_prefix=str(tmp_path / 'ref')))
    assert (res.tally.documents, res.documents) == (len(expected), written)
    assert res.dropped == ref.dropped and res.tokens == ref.tokens
    _same_dataset(res.prefix, ref.prefix)


def test_cli_prepares_every_sample_at_once(tmp_path):
    "gptkit data prepare on the samples (one folder with several formats) writes what the library writes"
    runner = CliRunner()
    inputs = [FORMATS / 'fineweb_layout.parquet', FORMATS / 'kjv_save_to_disk', FORMATS / 'psalms.jsonl.xz']
    args = ['data', 'prepare', '--output-prefix', str(tmp_path / 'cli')] + [a for p in inputs for a in ('-i', str(p))]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lib = prepare(PrepareConfig(inputs=tuple(map(str, inputs)), output_prefix=str(tmp_path / 'lib')))
    assert lib.documents == 12 + 12 + 20
    _same_dataset(str(tmp_path / 'cli_text_document'), lib.prefix)
    r = runner.invoke(app, ['data', 'prepare', '-i', str(WIKI), '--format', 'jsonl',
                            '--output-prefix', str(tmp_path / 'w')])
    assert r.exit_code == 0, r.output
    wiki = prepare(PrepareConfig(inputs=(str(WIKI),), output_prefix=str(tmp_path / 'wlib'), format='jsonl'))
    counts = {l.split()[0] + ' ' + l.split()[1]: l.split()[-1] for l in r.output.splitlines() if len(l.split()) >= 3}
    assert (counts['documents read'], counts['dropped: empty'], counts['documents written']) == ('8', '2', '6')
    assert counts['tokens written'] == f'{wiki.tokens:,}'
    _same_dataset(str(tmp_path / 'w_text_document'), wiki.prefix)


def test_wikiextractor_output_needs_format_jsonl(tmp_path):
    "wiki_00 has no suffix: without --format the folder (and the file) is refused with a sentence naming --format"
    for where in (WIKI, WIKI / 'AA' / 'wiki_00'):
        with pytest.raises(DataError, match='--format') as e: list(read_documents([where]))
        assert str(where) in str(e.value)
    r = CliRunner().invoke(app, ['data', 'prepare', '-i', str(WIKI), '--output-prefix', str(tmp_path / 'w')])
    assert r.exit_code == 1 and '--format' in r.output and 'wiki_00' in r.output and 'Traceback' not in r.output
    assert not list(tmp_path.iterdir())


# What `datasets` writes at test time: save_to_disk in one or several shards, after a shuffle (its indices mapping
# is written out in the shuffled order), a DatasetDict, and the Arrow cache file of a map.
TEXTS = [f'Document {i}: ' + 'The quick brown fox jumps over the lazy dog. ' * (i % 7 + 1) for i in range(50)]


def _dataset():
    return datasets.Dataset.from_dict({'text': TEXTS, 'n': list(range(len(TEXTS)))})


@pytest.mark.parametrize('shards', [1, 3])
@pytest.mark.parametrize('shuffled', [False, True])
def test_save_to_disk_folder_reads_as_load_from_disk(shards, shuffled, tmp_path):
    ds = _dataset().shuffle(seed=0) if shuffled else _dataset()
    ds.save_to_disk(str(tmp_path / 'hf'), num_shards=shards)
    theirs = list(datasets.load_from_disk(str(tmp_path / 'hf'))['text'])   # a datasets Column: make it a list
    assert len(list((tmp_path / 'hf').glob('data-*.arrow'))) == shards
    assert [d.text for d in read_documents([tmp_path / 'hf'])] == theirs
    assert (theirs != TEXTS) == shuffled
    res = prepare(PrepareConfig(inputs=(str(tmp_path / 'hf'),), output_prefix=str(tmp_path / 'out')))
    ref = prepare(PrepareConfig(inputs=(str(_as_jsonl(theirs, tmp_path / 'ref.jsonl')),),
                                output_prefix=str(tmp_path / 'ref')))
    assert res.documents == len(TEXTS)
    _same_dataset(res.prefix, ref.prefix)


def test_single_arrow_files_written_by_datasets(tmp_path):
    "One shard of save_to_disk, and the cache file of Dataset.map: both Arrow IPC streams, read alone"
    ds = _dataset()
    ds.save_to_disk(str(tmp_path / 'hf'), num_shards=2)
    shard = tmp_path / 'hf' / 'data-00001-of-00002.arrow'
    assert shard.read_bytes()[:4] == b'\xff\xff\xff\xff'   # the Arrow IPC stream format, not the file format
    loaded = list(datasets.load_from_disk(str(tmp_path / 'hf'))['text'])
    assert [d.text for d in read_documents([shard])] == loaded[len(loaded) - 25:]
    cache = tmp_path / 'upper.arrow'
    upper = ds.map(lambda r: {'text': r['text'].upper()}, cache_file_name=str(cache))
    assert cache.is_file()
    assert [d.text for d in read_documents([cache])] == list(upper['text'])
    res = prepare(PrepareConfig(inputs=(str(cache),), output_prefix=str(tmp_path / 'out')))
    assert res.documents == 50


def test_dataset_dict_folder_reads_each_split(tmp_path):
    "A DatasetDict folder: each split's data, splits in name order (test before train)"
    ds = _dataset()
    dd = datasets.DatasetDict(train=ds.select(range(40)), test=ds.select(range(40, 50)))
    dd.save_to_disk(str(tmp_path / 'dd'))
    loaded = datasets.load_from_disk(str(tmp_path / 'dd'))
    got = [d.text for d in read_documents([tmp_path / 'dd'])]
    assert got == list(loaded['test']['text']) + list(loaded['train']['text'])
