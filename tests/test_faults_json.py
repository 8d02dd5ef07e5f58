"""Small JSON files gptkit reads but may not have written (a checkpoint handed over, a Hugging Face folder, a dataset's
.metadata, an evaluation file), run as a user runs the command: a file nested 100,000 levels deep, a sparse 4 GiB one
and one of the wrong type each end in one sentence naming the file, exit code 1 and no traceback.

The 4 GiB cases run `gptkit` as a real process under a 3 GiB address-space limit and a timeout: read whole, such a
file is a MemoryError (or worse), so a regression fails fast instead of eating the machine."""
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gptkit_cli.main import app

GPTKIT = str(Path(sys.executable).with_name('gptkit'))
MEMORY = 3 * 2**30
HUGE = 4 * 2**30
DEEP = '[' * 100_000


def run(*args):
    "`gptkit ARGS` in this process: (exit code, output on one line)"
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, ' '.join(r.output.split()) + (f' {r.exception!r}' if r.exit_code not in (0, 1, 2) else '')


def gptkit(*args, timeout: float = 120):
    "`gptkit ARGS` as a process under a 3 GiB address-space limit: (exit code, output on one line)"
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    r = subprocess.run([GPTKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout, preexec_fn=limit,
                       env={**os.environ, 'COLUMNS': '300'}, stdin=subprocess.DEVNULL)
    return r.returncode, ' '.join((r.stdout + r.stderr).split())


def one_sentence(code: int, out: str, *wanted: str):
    "Exit code 1, each of `wanted` in the output, and no traceback"
    assert code == 1, (code, out[-3000:])
    assert 'Traceback' not in out and 'Error:' not in out and len(out) < 2000, out[-3000:]
    for w in wanted:
        assert ' '.join(w.split()) in out, (w, out[-3000:])


def huge(path: Path):
    "Make `path` a sparse file of 4 GiB (it takes no disk)"
    with open(path, 'wb') as f:
        f.truncate(HUGE)


@pytest.fixture
def run_copy(tiny_checkpoint, tmp_path) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) of a copy of the tiny checkpoint whose state.json has no manifest or checksum,
    as checkpoints written before gptkit sealed them (accepted), so that its other files can be replaced"""
    run_dir = tmp_path / 'run'
    shutil.copytree(tiny_checkpoint, run_dir)
    folder = run_dir / 'checkpoints' / 'iter_0000000'
    state = json.loads((folder / 'state.json').read_text())
    state.pop('files')
    state.pop('checksum')
    (folder / 'state.json').write_text(json.dumps(state))
    return run_dir, folder


# A checkpoint's state.json, config.json and ds_config.json

def test_a_deeply_nested_state_json_is_refused_in_one_sentence(run_copy, caplog):
    run_dir, folder = run_copy
    (folder / 'state.json').write_text(DEEP)
    one_sentence(*run('checkpoint', 'inspect', run_dir), 'holds no intact checkpoint')
    assert (f'skipping checkpoint iter_0000000: checkpoint state {folder / "state.json"} is nested more than 100 levels '
            'deep') in caplog.text
    one_sentence(*run('checkpoint', 'inspect', folder), f'checkpoint state {folder / "state.json"} is nested more '
                 'than 100 levels deep; the files gptkit reads have a few')


def test_a_state_json_that_is_no_object_or_whose_manifest_is_damaged_is_refused(run_copy):
    _, folder = run_copy
    (folder / 'state.json').write_text('[1]')
    one_sentence(*run('checkpoint', 'inspect', folder), f'checkpoint state {folder / "state.json"} holds an array, '
                 'not an object')
    (folder / 'state.json').write_text('{"iteration": 0, "files": {"config.json": 5}}')
    one_sentence(*run('checkpoint', 'inspect', folder), 'state.json has a damaged manifest')
    (folder / 'state.json').write_text('{"iteration": 0, "layout": [1]}')
    one_sentence(*run('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2'),
                 'state.json has a layout gptkit cannot read: it is list, not an object')


@pytest.mark.parametrize('name,what', [('state.json', 'checkpoint state'), ('config.json', 'checkpoint config')])
def test_a_huge_json_file_in_a_checkpoint_is_refused_before_it_is_read(run_copy, name, what):
    _, folder = run_copy
    huge(folder / name)
    one_sentence(*gptkit('checkpoint', 'inspect', folder),
                 f'{what} {folder / name} holds 4.0 GiB, more than the 16.0 MiB read')


def test_a_checkpoints_config_json_deeply_nested_or_of_the_wrong_type_is_refused(run_copy):
    _, folder = run_copy
    (folder / 'config.json').write_text(DEEP)
    one_sentence(*run('checkpoint', 'inspect', folder),
                 f'checkpoint config {folder / "config.json"} is nested more than 100 levels deep')
    (folder / 'config.json').write_text('"str"')
    one_sentence(*run('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2'),
                 f'checkpoint config {folder / "config.json"} holds a string, not an object')


def test_a_deeply_nested_ds_config_json_is_named_by_inspect_and_refused_by_generate(run_copy):
    _, folder = run_copy
    (folder / 'ds_config.json').write_text(DEEP)
    code, out = run('checkpoint', 'inspect', folder, '--json')
    assert code == 0 and 'Traceback' not in out, out[-3000:]
    code, out = gptkit('checkpoint', 'inspect', folder)
    assert code == 0 and 'Traceback' not in out, out[-3000:]
    assert (f'DeepSpeed config {folder / "ds_config.json"} is nested more than 100 levels deep; the files gptkit reads '
            'have a few; its DeepSpeed settings are not shown') in out, out[-3000:]
    one_sentence(*run('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2'),
                 f'DeepSpeed config {folder / "ds_config.json"} is nested more than 100 levels deep')
    (folder / 'ds_config.json').write_text('{"zero_optimization": 5, "train_batch_size": "x"}')   # read, not used
    code, out = run('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2', '--greedy')
    assert code == 0 and 'In the' in out, out[-3000:]


# A tokenizer's files

def test_a_deeply_nested_or_wrong_tokenizer_config_json_is_refused_by_generate(run_copy):
    _, folder = run_copy
    config = folder / 'tokenizer' / 'tokenizer_config.json'
    config.write_text('{"chat_template": ' + DEEP)
    one_sentence(*run('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2'),
                 f'tokenizer config {config} is nested more than 100 levels deep')
    config.write_text('[1]')
    one_sentence(*run('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2'),
                 f'tokenizer config {config} holds an array, not an object')


def test_a_huge_tokenizer_config_json_is_refused_before_it_is_read(run_copy):
    _, folder = run_copy
    config = folder / 'tokenizer' / 'tokenizer_config.json'
    huge(config)
    one_sentence(*gptkit('generate', '--checkpoint', folder, '--prompt', 'In the', '--max-new-tokens', '2'),
                 f'tokenizer config {config} holds 4.0 GiB, more than the 16.0 MiB read')


def test_a_huge_tokenizer_json_is_refused_before_the_rust_reader_sees_it(run_copy):
    _, folder = run_copy
    huge(folder / 'tokenizer' / 'tokenizer.json')
    one_sentence(*gptkit('checkpoint', 'inspect', folder),
                 f'tokenizer {folder / "tokenizer" / "tokenizer.json"} holds 4.0 GiB, more than the 128.0 MiB read')


def test_a_deeply_nested_vocab_json_is_refused(run_copy):
    _, folder = run_copy
    (folder / 'tokenizer' / 'tokenizer.json').unlink()          # vocab.json and merges.txt are read instead
    (folder / 'tokenizer' / 'vocab.json').write_text(DEEP)
    one_sentence(*run('checkpoint', 'inspect', folder),
                 f'GPT-2 vocabulary {folder / "tokenizer" / "vocab.json"} is nested more than 100 levels deep')
    (folder / 'tokenizer' / 'vocab.json').write_text('{"a": "b"}')
    one_sentence(*run('checkpoint', 'inspect', folder), 'vocab.json: not a GPT-2 vocabulary (each token must map to a '
                 'whole number id)')


# Imports: a Hugging Face config.json, a Megatron checkpoint

@pytest.mark.parametrize('text, why', [
    (DEEP, 'is nested more than 100 levels deep'),
    ('[1]', 'holds an array, not an object'),
    ('"str"', 'holds a string, not an object'),
    ('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": "x", "num_attention_heads": 2, '
     '"intermediate_size": 64, "vocab_size": 512}', "hidden_size must be a whole number, not 'x'"),
    ('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, '
     '"intermediate_size": 64, "vocab_size": 512, "rope_scaling": [1]}', 'rope_scaling must be an object, not [1]'),
    ('{"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 512, "activation_function": ["gelu"]}',
     "activation_function ['gelu'] is not supported"),
])
def test_a_hugging_face_config_json_of_the_wrong_shape_is_refused_on_import(tmp_path, text, why):
    (tmp_path / 'hf').mkdir()
    (tmp_path / 'hf' / 'config.json').write_text(text)
    one_sentence(*run('checkpoint', 'import', '--from', 'hf', tmp_path / 'hf', tmp_path / 'out'),
                 f'{tmp_path / "hf" / "config.json"}', why)
    assert not (tmp_path / 'out').exists()


def test_a_huge_hugging_face_config_json_is_refused_before_it_is_read(tmp_path):
    (tmp_path / 'hf').mkdir()
    huge(tmp_path / 'hf' / 'config.json')
    one_sentence(*gptkit('checkpoint', 'import', '--from', 'hf', tmp_path / 'hf', tmp_path / 'out'),
                 f'Hugging Face config {tmp_path / "hf" / "config.json"} holds 4.0 GiB, more than the 16.0 MiB read')


def _megatron(root: Path, ckpt: dict) -> Path:
    import torch
    shard = root / 'iter_0000001' / 'mp_rank_00'
    shard.mkdir(parents=True)
    torch.save(ckpt, shard / 'model_optim_rng.pt')
    (root / 'latest_checkpointed_iteration.txt').write_text('1')
    return shard / 'model_optim_rng.pt'


@pytest.mark.parametrize('args', [5, 'str', [1]])
def test_megatron_args_that_are_no_namespace_or_dict_are_refused(tmp_path, args):
    shard = _megatron(tmp_path / 'meg', {'args': args, 'model': {}})
    one_sentence(*run('checkpoint', 'import', '--from', 'megatron', tmp_path / 'meg', tmp_path / 'out'),
                 f"{shard}: its 'args' is {args!r}, not Megatron's argparse.Namespace or a dict")


def test_a_huge_megatron_tracker_file_is_refused_before_it_is_read(tmp_path):
    _megatron(tmp_path / 'meg', {'args': {}, 'model': {}})
    tracker = tmp_path / 'meg' / 'latest_checkpointed_iteration.txt'
    huge(tracker)
    one_sentence(*gptkit('checkpoint', 'import', '--from', 'megatron', tmp_path / 'meg', tmp_path / 'out'),
                 f'Megatron tracker {tracker} holds 4.0 GiB, more than the 1.0 KiB read')


# A dataset's .metadata and an evaluation's JSON Lines

@pytest.fixture
def dataset_copy(tiny_data, tmp_path) -> Path:
    "The prefix of a copy of the tiny dataset (.bin, .idx, .metadata)"
    for ext in ('.bin', '.idx', '.metadata'):
        shutil.copy(tiny_data[0] + ext, tmp_path / f'kjv{ext}')
    return tmp_path / 'kjv'


def test_a_deeply_nested_dataset_metadata_is_refused_by_data_merge(dataset_copy, tmp_path):
    meta = Path(f'{dataset_copy}.metadata')
    meta.write_text(DEEP)
    one_sentence(*run('data', 'merge', '-i', dataset_copy, '--output-prefix', tmp_path / 'merged'),
                 f'dataset metadata {meta} is nested more than 100 levels deep',
                 'remove it if its dataset did not come from gptkit')
    assert not list(tmp_path.glob('merged.*'))


def test_a_huge_dataset_metadata_is_refused_before_it_is_read(dataset_copy, tmp_path):
    meta = Path(f'{dataset_copy}.metadata')
    huge(meta)
    one_sentence(*gptkit('data', 'merge', '-i', dataset_copy, '--output-prefix', tmp_path / 'merged'),
                 f'dataset metadata {meta} holds 4.0 GiB, more than the 16.0 MiB read')


def test_a_deeply_nested_jsonl_line_is_refused_by_eval(run_copy, tmp_path):
    run_dir, _ = run_copy
    (tmp_path / 'deep.jsonl').write_text('{"text": "In the beginning"}\n{"text": ' + DEEP + '\n')
    one_sentence(*run('eval', '--checkpoint', run_dir, '--jsonl', tmp_path / 'deep.jsonl'),
                 f'{tmp_path / "deep.jsonl"}:2: not a document: its JSON is nested too deeply to read')


def test_a_huge_jsonl_file_is_refused_by_eval_before_it_is_read(run_copy, tmp_path):
    run_dir, _ = run_copy
    huge(tmp_path / 'huge.jsonl')
    one_sentence(*gptkit('eval', '--checkpoint', run_dir, '--jsonl', tmp_path / 'huge.jsonl'),
                 f'{tmp_path / "huge.jsonl"} holds more than the 1.0 GiB of text an evaluation reads')


# train --resume: the checkpoint's ds_config.json is read to compare the global batch

def test_a_deeply_nested_ds_config_json_does_not_stop_a_resume(tiny_data, tmp_path, caplog):
    "The batch check is a warning: the checkpoint resumes, and the warning names the file it could not read"
    from conftest import TINY_SETS, run_here
    from gptkit.store import folders as store
    prefix, tok = tiny_data
    sets = [a for s in TINY_SETS + ['train.iters=2', 'train.save_interval=2', 'train.eval_iters=0'] for a in ('--set', s)]
    run_dir = tmp_path / 'run'
    r = run_here('train', '--data', prefix, '--tokenizer', tok, *sets, '--out', run_dir)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    folder = run_dir / 'checkpoints' / 'iter_0000002'
    (folder / 'ds_config.json').write_text(DEEP)
    state = json.loads((folder / 'state.json').read_text())
    state['files'] = store.manifest(folder)                     # sealed again, as anyone can
    (folder / 'state.json').write_text(store.state_text(state))
    r = run_here('train', '--data', prefix, '--tokenizer', tok, *sets, '--set', 'train.iters=3', '--out', run_dir,
                 '--resume')
    said = ' '.join((r.stdout + r.stderr).split())
    assert r.returncode == 0 and 'Traceback' not in said and 'RecursionError' not in said, said[-3000:]
    assert (f'DeepSpeed config {folder / "ds_config.json"} is nested more than 100 levels deep; the files gptkit '
            'reads have a few; the global batch the checkpoint was trained with is not compared') in caplog.text
    assert (run_dir / 'checkpoints' / 'iter_0000003').is_dir()


# data prepare: a JSONL line or a Hugging Face save_to_disk state.json nested past Python's stack

def test_a_deeply_nested_jsonl_line_is_a_bad_line_of_data_prepare(tmp_path):
    "The line is counted as invalid JSON and the good ones are prepared (it was a RecursionError traceback)"
    (tmp_path / 'mixed.jsonl').write_text(json.dumps({'text': 'In the beginning God created the heaven.'}) + '\n'
                                          + DEEP + '\n' + json.dumps({'text': 'And the earth was void.'}) + '\n')
    code, out = run('data', 'prepare', '-i', tmp_path / 'mixed.jsonl', '--output-prefix', tmp_path / 'out')
    assert code == 0 and 'bad input: invalid json 1' in out and 'documents written 2' in out, out


def test_a_deeply_nested_hugging_face_dataset_state_is_refused(tmp_path):
    (tmp_path / 'hf').mkdir()
    (tmp_path / 'hf' / 'dataset_info.json').write_text('{}')
    (tmp_path / 'hf' / 'state.json').write_text(DEEP)
    one_sentence(*run('data', 'prepare', '-i', tmp_path / 'hf', '--output-prefix', tmp_path / 'out'),
                 f'Hugging Face dataset state {tmp_path / "hf" / "state.json"} is nested more than 100 levels deep')
