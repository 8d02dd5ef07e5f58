"""Hostile cases, round two, for data and imports: a --workers count that would hang, a full disk while a dataset is
replaced (the old .bin, .idx and .metadata all kept, the message naming the file), NaN weights refused at import, and
two messages that named the wrong thing (--world for --gpus, pydantic's traceback for a --deepspeed-config value)."""
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import TINY_SETS
from gptkit_cli.main import app

GPTKIT = str(Path(sys.executable).with_name('gptkit'))


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, ' '.join(r.output.split()), r


def one_sentence(output: str):
    assert 'Traceback' not in output and 'Error:' not in output and len(output) < 2000, output[:3000]


def full_disk(*_, **__):
    raise OSError(errno.ENOSPC, 'No space left on device')


@pytest.fixture
def old(tiny_data, tmp_path):
    "A copy of the tiny dataset (.bin, .idx, .metadata) at tmp/old, and the bytes of each file"
    prefix = tmp_path / 'old'
    for ext in ('.bin', '.idx', '.metadata'):
        shutil.copy(f'{tiny_data[0]}{ext}', f'{prefix}{ext}')
    return prefix, {p.name: p.read_bytes() for p in tmp_path.iterdir()}


def assert_intact(folder: Path, before: dict):
    "Every file of the old dataset as it was, and nothing else left (no temporary, no lock)"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# --workers: a typo of 100,000 threads is refused at once, naming the flag (it hung before)

def test_prepare_refuses_more_workers_than_the_cpus_can_use(tmp_path):
    (tmp_path / 'a.jsonl').write_text('{"text": "hello world"}\n')
    r = subprocess.run([GPTKIT, 'data', 'prepare', '-i', tmp_path / 'a.jsonl', '--output-prefix', tmp_path / 'o',
                        '--workers', '100000'], capture_output=True, text=True, timeout=60,
                       env={**os.environ, 'COLUMNS': '200'}, stdin=subprocess.DEVNULL)
    out = ' '.join((r.stdout + r.stderr).split())
    most = 4 * len(os.sched_getaffinity(0))
    assert r.returncode == 2 and f'--workers 100,000 is more than {most}, 4 per CPU this process may use' in out, out
    one_sentence(out)
    assert list(tmp_path.iterdir()) == [tmp_path / 'a.jsonl']


# A full disk while merge --overwrite or prepare --overwrite replaces a dataset: nothing of the old one lost

@pytest.mark.parametrize('step', ['copy', 'fsync'])
def test_merge_overwrite_on_a_full_disk_keeps_the_old_dataset(tiny_data, old, monkeypatch, step):
    import gptkit.data.indexed as indexed
    prefix, before = old
    if step == 'copy':
        monkeypatch.setattr(indexed, '_copy_bytes', full_disk)     # the .bin's bytes do not fit
    else:
        monkeypatch.setattr(indexed.os, 'fsync', full_disk)        # the writes fit, the flush to disk does not
    code, out, _ = run('data', 'merge', '-i', tiny_data[0], '--output-prefix', prefix, '--overwrite')
    assert_intact(prefix.parent, before)
    assert code == 1 and f'{prefix}.bin: the disk is full' in out, out
    assert 'the existing old.bin/.idx/.metadata are as they were' in out, out
    one_sentence(out)


@pytest.mark.parametrize('step', ['index', 'fsync'])
def test_prepare_overwrite_on_a_full_disk_keeps_the_old_dataset(tiny_data, tmp_path, monkeypatch, step):
    import gptkit.data.indexed as indexed
    (tmp_path / 'a.jsonl').write_text(''.join(json.dumps({'text': f'doc {i} ' * 9}) + '\n' for i in range(5)))
    prefix = tmp_path / 'out_text_document'
    for ext in ('.bin', '.idx', '.metadata'):
        shutil.copy(f'{tiny_data[0]}{ext}', f'{prefix}{ext}')
    for ext in ('.bin', '.idx'):                                   # an old chat dataset's loss mask
        Path(f'{prefix}_loss_mask{ext}').write_bytes(b'mask')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    if step == 'index':
        monkeypatch.setattr(indexed.IndexedWriter, '_index_bytes', full_disk)
    else:
        monkeypatch.setattr(indexed.os, 'fsync', full_disk)
    args = ('data', 'prepare', '-i', tmp_path / 'a.jsonl', '--output-prefix', tmp_path / 'out', '--tokenizer',
            tiny_data[1], '--workers', '1', '--overwrite')
    code, out, _ = run(*args)
    assert_intact(tmp_path, before)
    assert code == 1 and f'{prefix}.bin: the disk is full' in out, out
    assert 'the existing out_text_document.bin/.idx/.metadata are as they were' in out, out
    one_sentence(out)
    monkeypatch.undo()                                             # space again: the new dataset replaces all of it
    code, out, _ = run(*args)
    assert code == 0, out
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ['a.jsonl', 'out_text_document.bin', 'out_text_document.idx', 'out_text_document.metadata']
    assert json.loads(Path(f'{prefix}.metadata').read_text())['tokenizer'] == tiny_data[1]


# Import: a NaN weight refused while it is read, naming the file and the tensor

def test_checkpoint_import_refuses_a_nan_weight(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    hf = tmp_path / 'hf'
    code, out, _ = run('checkpoint', 'export', tiny_checkpoint, hf, '--to', 'hf')
    assert code == 0, out
    weights = load_file(hf / 'model.safetensors')
    name = 'transformer.h.1.mlp.c_fc.weight' if 'transformer.h.1.mlp.c_fc.weight' in weights else sorted(weights)[-1]
    weights[name].view(-1)[3] = float('nan')
    save_file(weights, hf / 'model.safetensors', metadata={'format': 'pt'})
    code, out, _ = run('checkpoint', 'import', hf, tmp_path / 'run', '--from', 'hf')
    assert code == 1 and f'{hf / "model.safetensors"}: tensor {name} holds 1 NaN or infinite value (of' in out, out
    one_sentence(out)
    assert not (tmp_path / 'run').exists()


# Messages that named the wrong thing

def test_estimate_with_no_gpus_names_the_gpus_flag():
    code, out, _ = run('estimate', '--preset', '13b', '--gpus', '0')
    assert code == 2 and '--gpus must be a positive whole number, not 0' in out and '--world' not in out, out
    one_sentence(out)


def test_a_deepspeed_config_value_deepspeed_refuses_is_one_sentence(tiny_data, tmp_path):
    ds = tmp_path / 'ds.json'
    ds.write_text(json.dumps({'zero_optimization': {'offload_optimizer': {'device': 'gpu'}}}))
    sets = [a for s in (*TINY_SETS, 'train.iters=1') for a in ('--set', s)]
    code, out, _ = run('train', '--data', tiny_data[0], '--tokenizer', tiny_data[1], '--out', tmp_path / 'r',
                       '--deepspeed-config', ds, *sets)
    assert code == 2 and (f"--deepspeed-config file {ds} sets zero_optimization.offload_optimizer.device to 'gpu', "
                          "which DeepSpeed refuses: input should be 'none', 'cpu' or 'nvme'") in out, out
    one_sentence(out)
    assert not (tmp_path / 'r').exists()


@pytest.mark.parametrize('step', ['index', 'fsync'])
def test_prepare_chat_overwrite_on_a_full_disk_keeps_the_old_dataset_and_its_mask(tmp_path, monkeypatch, step):
    "The tokens, their metadata and the loss mask are replaced together: the old .idx and metadata were removed first"
    import gptkit.data.indexed as indexed
    chats = tmp_path / 'c.jsonl'
    chats.write_text(''.join(json.dumps({'messages': [{'role': 'user', 'content': f'question {i}'},
                                                      {'role': 'assistant', 'content': f'answer {i} ' * 5}]}) + '\n'
                             for i in range(6)))
    args = ('data', 'prepare', '--chat', '-i', chats, '--output-prefix', tmp_path / 'sft', '--workers', '1',
            '--overwrite')
    code, out, _ = run(*args)
    assert code == 0, out
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(before) == 6                         # the conversations, .bin, .idx, .metadata, the mask's .bin/.idx
    if step == 'index':
        monkeypatch.setattr(indexed.IndexedWriter, '_index_bytes', full_disk)
    else:
        monkeypatch.setattr(indexed.os, 'fsync', full_disk)
    code, out, _ = run(*args)
    assert_intact(tmp_path, before)
    assert code == 1 and f'{tmp_path}/sft_text_document.bin: the disk is full' in out, out
    assert 'the existing sft_text_document.bin/.idx/.metadata and loss mask are as they were' in out, out
    one_sentence(out)
    monkeypatch.undo()
    code, out, _ = run(*args)
    assert code == 0 and {p.name for p in tmp_path.iterdir()} == set(before), out
