"""`gptkit data` and `gptkit tokenizer` from the command line."""
import json

from typer.testing import CliRunner

from gptkit_cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_prepare_then_inspect(tmp_path):
    (tmp_path / 'd.jsonl').write_text('\n'.join(json.dumps({'text': f'Document number {i}. ' * (i + 1)}) for i in range(20)) + '\nbroken\n')
    r = run('data', 'prepare', '-i', tmp_path / 'd.jsonl', '--output-prefix', tmp_path / 'out', '--min-tokens', '10')
    assert r.exit_code == 0, r.output
    assert 'bad input: invalid json' in r.output and 'dropped: too short' in r.output and 'd.jsonl:21' in r.output
    r = run('data', 'inspect', tmp_path / 'out_text_document', '--tokenizer', 'gpt2')
    assert r.exit_code == 0, r.output
    assert 'documents' in r.output and 'uint16' in r.output and 'Document number' in r.output


def test_prepare_strict_and_missing_input(tmp_path):
    (tmp_path / 'd.jsonl').write_text('{"text": "fine"}\n{"oops": 1}\n')
    r = run('data', 'prepare', '-i', tmp_path / 'd.jsonl', '--output-prefix', tmp_path / 'out', '--strict')
    assert r.exit_code == 1 and 'd.jsonl:2: missing text key' in r.output
    assert not list(tmp_path.glob('out*'))
    r = run('data', 'prepare', '-i', tmp_path / 'nope.jsonl', '--output-prefix', tmp_path / 'out')
    assert r.exit_code == 1 and 'nope.jsonl: no such file' in r.output


def test_inspect_a_foreign_file(tmp_path):
    (tmp_path / 'x.idx').write_bytes(b'hello'); (tmp_path / 'x.bin').write_bytes(b'')
    r = run('data', 'inspect', tmp_path / 'x')
    assert r.exit_code == 1 and 'not a Megatron indexed dataset index' in r.output and 'Traceback' not in r.output


def test_tokenizer_commands(tmp_path):
    assert '[15496, 995]' in run('tokenizer', 'encode', 'Hello world').output
    assert '50,257 entries' in run('tokenizer', 'info').output
    r = run('tokenizer', 'train', '-i', 'builtin:tiny_shakespeare', '--vocab-size', '600', '--output', tmp_path / 'tok')
    assert r.exit_code == 0, r.output
    assert 'bytes per token on builtin:wikipedia' in r.output
    assert run('tokenizer', 'info', '--tokenizer', tmp_path / 'tok').output.startswith('tok: 600 entries')
    r = run('tokenizer', 'train', '-i', 'builtin:tiny_shakespeare', '--vocab-size', '100', '--output', tmp_path / 'bad')
    assert r.exit_code == 2 and '--vocab-size must be from 257' in r.output


def test_tokenizer_train_reads_names_that_do_not_say_with_format(tmp_path):
    (tmp_path / 'notes.md').write_text('To be, or not to be, that is the question.\n' * 200)
    r = run('tokenizer', 'train', '-i', tmp_path / 'notes.md', '--vocab-size', '300', '--output', tmp_path / 'tok')
    assert r.exit_code == 1 and 'notes.md' in r.output and '--format' in r.output and 'Traceback' not in r.output
    r = run('tokenizer', 'train', '-i', tmp_path / 'notes.md', '--format', 'txt', '--vocab-size', '300',
            '--output', tmp_path / 'tok')
    assert r.exit_code == 0, r.output
    assert 'trained on 1 documents' in r.output


def test_prepare_fix_unicode(tmp_path):
    (tmp_path / 'm.jsonl').write_text(json.dumps({'text': 'cafÃ© doesnÃ¢â‚¬â„¢t'}) + '\n')
    assert run('data', 'prepare', '-i', tmp_path / 'm.jsonl', '--output-prefix', tmp_path / 'o', '--fix-unicode').exit_code == 0
    from gptkit.data.indexed import IndexedDataset
    from gptkit.tokenizer.bpe import gpt2
    assert gpt2().decode(IndexedDataset(tmp_path / 'o_text_document').document(0)[:-1]) == 'café doesn’t'


def test_list_builtin_corpora():
    r = run('data', 'corpora')
    assert r.exit_code == 0 and 'builtin:shakespeare' in r.output and 'builtin:wikipedia' in r.output and 'held out' in r.output


def test_prepare_that_writes_nothing_exits_1_with_every_inputs_counts(tmp_path):
    (tmp_path / 'a.jsonl').write_text('{"body": "x"}\nnot json\n')
    (tmp_path / 'b.jsonl').write_text('\n')
    r = run('data', 'prepare', '-i', tmp_path / 'a.jsonl', '-i', tmp_path / 'b.jsonl', '--output-prefix', tmp_path / 'out')
    text = ' '.join(r.output.split())
    assert r.exit_code == 1, r.output
    assert 'no document written' in text and 'a.jsonl: 0 documents read, 1 invalid json, 1 missing text key' in text
    assert 'b.jsonl: 0 documents read, 1 empty file' in text and 'Traceback' not in r.output
    assert not list(tmp_path.glob('out*'))


def test_prepare_refuses_binary_input_before_tokenizing(tmp_path):
    (tmp_path / 'ok.jsonl').write_text('{"text": "fine"}\n')
    (tmp_path / 'model.bin').write_bytes(bytes(range(256)))
    r = run('data', 'prepare', '-i', tmp_path / 'ok.jsonl', '-i', tmp_path / 'model.bin', '--output-prefix', tmp_path / 'out')
    text = ' '.join(r.output.split())
    assert r.exit_code == 1 and 'model.bin: its content is binary data' in text and '.parquet' in text
    assert not list(tmp_path.glob('out*'))


def test_prepare_format_for_a_wikiextractor_folder_and_parquet_text_key(tmp_path):
    pa, pq = __import__('pyarrow'), __import__('pyarrow.parquet').parquet
    (tmp_path / 'text' / 'AA').mkdir(parents=True)
    for i in range(3):
        (tmp_path / 'text' / 'AA' / f'wiki_0{i}').write_text(json.dumps({'id': str(i), 'text': f'Article number {i}.'}) + '\n')
    r = run('data', 'prepare', '-i', tmp_path / 'text', '--output-prefix', tmp_path / 'w')
    assert r.exit_code == 1 and 'wiki_00' in r.output and '--format' in r.output
    r = run('data', 'prepare', '-i', tmp_path / 'text', '--format', 'jsonl', '--output-prefix', tmp_path / 'w')
    assert r.exit_code == 0, r.output
    from gptkit.data.indexed import IndexedDataset
    assert IndexedDataset(tmp_path / 'w_text_document').num_documents == 3
    pq.write_table(pa.table({'content': ['one', 'two'], 'id': [1, 2]}), tmp_path / 'p.parquet')
    r = run('data', 'prepare', '-i', tmp_path / 'p.parquet', '--text-key', 'content', '--output-prefix', tmp_path / 'p')
    assert r.exit_code == 0, r.output
    assert IndexedDataset(tmp_path / 'p_content_document').num_documents == 2
    r = run('data', 'prepare', '-i', tmp_path / 'p.parquet', '--output-prefix', tmp_path / 'q')
    assert r.exit_code == 1 and "no column 'text'; its columns are content, id" in ' '.join(r.output.split())


def test_prepare_shards_and_bad_shard(tmp_path):
    for k in range(4): (tmp_path / f'{k}.jsonl').write_text(json.dumps({'text': f'shard file {k}'}) + '\n')
    for i in (1, 2):
        r = run('data', 'prepare', '-i', tmp_path, '--shard', f'{i}/2', '--output-prefix', tmp_path / f's{i}')
        assert r.exit_code == 0, r.output
    from gptkit.data.indexed import IndexedDataset
    assert [IndexedDataset(tmp_path / f's{i}_text_document').num_documents for i in (1, 2)] == [2, 2]
    r = run('data', 'prepare', '-i', tmp_path, '--shard', '3/2', '--output-prefix', tmp_path / 'x')
    assert r.exit_code in (1, 2) and '--shard must be I/N' in r.output
