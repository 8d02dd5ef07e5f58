"""Files are data, never code: a pickle payload in any checkpoint file gptkit reads, through every command that reads
it, runs nothing; the command ends with one sentence naming the file and exit code 1 (issue 29, item 1)."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY_SETS, run_here
from gptkit.store import folders as store

ROOT = Path(__file__).resolve().parents[1]
GPTKIT = str(ROOT / '.venv' / 'bin' / 'gptkit')
SETS = TINY_SETS + ['train.iters=3', 'train.save_interval=3', 'train.eval_iters=0']
STEP = 'iter_0000003'


class Payload:
    "What an attacker puts in a pickle: unpickling it calls exec, which creates `marker`"
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f'open({str(self.marker)!r}, "w").close()',)


def plant(path: Path, marker: Path):
    "Add a payload to the dict torch.save wrote to `path`"
    from gptkit.store.torch_files import read_torch_file
    d = read_torch_file(path)
    d['extra'] = Payload(marker)
    torch.save(d, path)


def reseal(folder: Path, **changes):
    "Seal a checkpoint folder again after its files changed, as anyone can (state.json's checksums are no signature)"
    state = json.loads((folder / 'state.json').read_text())
    state.update(changes, files=store.manifest(folder))
    (folder / 'state.json').write_text(store.state_text(state))


def refused(r, file: Path, marker: Path):
    "The command ran nothing from `file`, and said so in one sentence naming it: exit code 1, no traceback"
    said = ' '.join((r.stdout + r.stderr).split())
    assert not marker.exists(), 'the payload ran'
    assert r.returncode == 1, said[-2000:]
    assert f'{file} was not loaded: it asks for the Python object builtins.exec' in said, said[-2000:]
    assert 'Traceback' not in said and 'UnpicklingError' not in said, said[-2000:]


def _train(tiny_data, out: Path, *sets):
    prefix, tok = tiny_data
    args = [a for s in SETS + list(sets) for a in ('--set', s)]
    r = run_here('train', '--data', prefix, '--tokenizer', tok, *args, '--out', out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


@pytest.fixture(scope='module')
def runs(tiny_data, tmp_path_factory):
    "zero stage -> a 3-step run folder, checkpointed at step 3 (each trained once)"
    made = {}

    def get(zero: int) -> Path:
        if zero not in made: made[zero] = _train(tiny_data, tmp_path_factory.mktemp(f'zero{zero}') / 'run', f'parallel.zero={zero}')
        return made[zero]
    return get


def copy_run(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    "(a copy of the run folder, its step-3 checkpoint folder)"
    run = tmp_path / 'run'
    shutil.copytree(src, run)
    return run, run / 'checkpoints' / STEP


def resume(tiny_data, run: Path, *sets):
    prefix, tok = tiny_data
    args = [a for s in SETS + ['parallel.zero=1', 'train.iters=4', *sets] for a in ('--set', s)]
    return run_here('train', '--data', prefix, '--tokenizer', tok, *args, '--out', run, '--resume')


@pytest.fixture
def text(tmp_path) -> Path:
    f = tmp_path / 'eval.txt'
    f.write_text('In the beginning God created the heaven and the earth. ' * 8)
    return f


def reading(kind: str, run: Path, tmp_path: Path, text: Path) -> list:
    "The arguments of a command that reads the weights of `run`"
    return {'inspect': ['checkpoint', 'inspect', run],
            'generate': ['generate', '--checkpoint', run, '--prompt', 'In the', '--max-new-tokens', '2'],
            'eval': ['eval', '--checkpoint', run, '--text', text, '--batch-size', '2'],
            'export-hf': ['checkpoint', 'export', run, tmp_path / 'hf', '--to', 'hf'],
            'export-megatron': ['checkpoint', 'export', run, tmp_path / 'meg', '--to', 'megatron'],
            'reshard': ['checkpoint', 'reshard', run, tmp_path / 'resharded'],
            'serve': ['serve', '--checkpoint', run, '--port', '5999']}[kind]


@pytest.fixture
def no_server(monkeypatch):
    "serve loads the model exactly as it does for real, but does not start listening"
    import gptkit.serve.server
    monkeypatch.setattr(gptkit.serve.server, 'serve', lambda *a, **k: None)


READERS = ['inspect', 'generate', 'eval', 'export-hf', 'export-megatron', 'reshard', 'serve']


@pytest.mark.parametrize('kind', READERS)
def test_a_payload_in_model_states_runs_in_no_command(kind, runs, tmp_path, text, no_server):
    run, folder = copy_run(runs(1), tmp_path)
    f, marker = folder / 'mp_rank_00_model_states.pt', tmp_path / 'ran'
    plant(f, marker)
    reseal(folder)
    refused(run_here(*reading(kind, run, tmp_path, text)), f, marker)


def test_a_payload_in_model_states_runs_not_on_resume(tiny_data, runs, tmp_path):
    run, folder = copy_run(runs(1), tmp_path)
    f, marker = folder / 'mp_rank_00_model_states.pt', tmp_path / 'ran'
    plant(f, marker)
    reseal(folder)
    refused(resume(tiny_data, run), f, marker)


def test_inspect_reads_a_zero3_checkpoint(runs):
    "ZeRO-3 writes zero_pp_rank_N_mp_rank_00_model_states.pt and no mp_rank_00 file: inspect read only the latter"
    from gptkit.checkpoint.checkpointing import inspect
    info = inspect(runs(3) / 'checkpoints' / STEP)
    assert info['dtypes'] == ['float32'] and info['iteration'] == 3, info


@pytest.mark.parametrize('kind', ['generate', 'export-hf', 'serve'])
def test_a_payload_in_zero3_optimizer_states_runs_in_no_command(kind, runs, tmp_path, text, no_server):
    "ZeRO-3 keeps the weights in the optimizer states: DeepSpeed's zero_to_fp32 reads them (weights_only=False)"
    run, folder = copy_run(runs(3), tmp_path)
    f, marker = folder / 'zero_pp_rank_0_mp_rank_00_optim_states.pt', tmp_path / 'ran'
    plant(f, marker)
    reseal(folder)
    refused(run_here(*reading(kind, run, tmp_path, text)), f, marker)


@pytest.mark.parametrize('name', ['zero_pp_rank_0_mp_rank_00_optim_states.pt', 'rng_rank_000.pt'])
def test_a_payload_in_optimizer_or_random_states_runs_not_on_resume(name, tiny_data, runs, tmp_path):
    "DeepSpeed's engine reads the optimizer states (its checkpoint engine: weights_only=False); gptkit the random states"
    run, folder = copy_run(runs(1), tmp_path)
    f, marker = folder / name, tmp_path / 'ran'
    plant(f, marker)
    reseal(folder)
    refused(resume(tiny_data, run), f, marker)


def test_a_payload_runs_not_in_the_conversion_for_another_data_parallel_size(tiny_data, runs, tmp_path):
    "Resuming on another number of ranks runs DeepSpeed's ds_to_universal (weights_only=False) over the optimizer states"
    run, folder = copy_run(runs(1), tmp_path)
    f, marker = folder / 'zero_pp_rank_0_mp_rank_00_optim_states.pt', tmp_path / 'ran'
    plant(f, marker)
    state = json.loads((folder / 'state.json').read_text())
    reseal(folder, layout={**state['layout'], 'dp': 2}, world_size=2)     # as if saved by two ranks
    refused(resume(tiny_data, run), f, marker)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith('.')] == []


def test_a_payload_in_a_universal_checkpoint_runs_not(tiny_data, runs, tmp_path, monkeypatch):
    "DeepSpeed's universal loaders read the converted files with weights_only=False: one tampered with is refused"
    import gptkit.checkpoint.checkpointing as ck
    run, folder = copy_run(runs(1), tmp_path)
    state = json.loads((folder / 'state.json').read_text())
    reseal(folder, layout={**state['layout'], 'dp': 2}, world_size=2)
    marker, planted = tmp_path / 'ran', []
    convert = ck.to_universal

    def tampered(src, dst):
        out = convert(src, dst)
        f = next(Path(dst).glob('zero/*/fp32.pt'))
        plant(f, marker)
        planted.append(f.relative_to(Path(dst).parent.parent))
        return out
    monkeypatch.setattr(ck, 'to_universal', tampered)
    r = resume(tiny_data, run)
    # the folder was converted under a temporary name and renamed; the sentence names the file where it was read
    said = ' '.join((r.stdout + r.stderr).split())
    assert not marker.exists() and r.returncode == 1, said[-2000:]
    rel = str(planted[0]).split('/', 1)[1]
    assert f'{rel} was not loaded: it asks for the Python object builtins.exec' in said, said[-2000:]
    assert 'Traceback' not in said


def test_a_payload_in_a_resharded_checkpoint_runs_not_on_resume(tiny_data, runs, tmp_path):
    "A weights-only checkpoint (from reshard) is read by gptkit itself on resume"
    assert run_here('checkpoint', 'reshard', runs(1), tmp_path / 'run').returncode == 0
    folder = tmp_path / 'run' / 'checkpoints' / STEP
    f, marker = folder / 'mp_rank_00_model_states.pt', tmp_path / 'ran'
    plant(f, marker)
    reseal(folder)
    refused(resume(tiny_data, tmp_path / 'run'), f, marker)


def test_a_payload_in_a_megatron_checkpoint_runs_not_on_import(tiny_checkpoint, tmp_path):
    "The old import retried with weights_only=False when the safe load failed"
    assert run_here('checkpoint', 'export', tiny_checkpoint, tmp_path / 'meg', '--to', 'megatron').returncode == 0
    f, marker = tmp_path / 'meg' / 'iter_0000000' / 'mp_rank_00' / 'model_optim_rng.pt', tmp_path / 'ran'
    plant(f, marker)
    refused(run_here('checkpoint', 'import', tmp_path / 'meg', tmp_path / 'back', '--from', 'megatron'), f, marker)
    assert not (tmp_path / 'back').exists()


def test_a_payload_in_a_hugging_face_bin_runs_not_on_import(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file
    hf = tmp_path / 'hf'
    assert run_here('checkpoint', 'export', tiny_checkpoint, hf, '--to', 'hf').returncode == 0
    f, marker = hf / 'pytorch_model.bin', tmp_path / 'ran'
    torch.save({**load_file(hf / 'model.safetensors'), 'extra': Payload(marker)}, f)
    (hf / 'model.safetensors').unlink()
    refused(run_here('checkpoint', 'import', hf, tmp_path / 'back', '--from', 'hf'), f, marker)


def test_the_payload_runs_where_nothing_guards(tmp_path):
    "The payload these tests plant is real: plain pickle loading runs it"
    marker = tmp_path / 'ran'
    torch.save({'extra': Payload(marker)}, tmp_path / 'x.pt')
    torch.load(tmp_path / 'x.pt', weights_only=False)
    assert marker.exists()


MEGATRON_WRITER = '''
import argparse, io, pathlib, random, signal, sys, types
import numpy as np, torch
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig
from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
from megatron.core.transformer.enums import AttnBackend
ckpt = torch.load(sys.argv[1], weights_only=False)   # gptkit's own export, written by this test
a = vars(ckpt['args'])
ckpt['args'] = argparse.Namespace(**a, model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
                                  save=pathlib.PosixPath('/ckpt'), data_args_path=None, params_dtype=torch.bfloat16,
                                  exit_signal=signal.Signals.SIGTERM)
ckpt['rng_state'] = [{'random_rng_state': random.getstate(), 'np_rng_state': np.random.get_state(),
                      'torch_rng_state': torch.get_rng_state(), 'rng_tracker_states': {}}]
ckpt['rerun_state_machine'] = {'mode': RerunMode.DISABLED, 'state': RerunState.NOT_RUNNING_YET,
                               'diagnostic': RerunDiagnostic.CORRECT_RESULT, 'data': io.BytesIO(b'rng'),
                               'extra': types.SimpleNamespace(a=1)}
ckpt['optimizer'] = {'config': OptimizerConfig(lr=1e-4), 'optimizer': {'state': {}, 'param_groups': []}}
ckpt['num_floating_point_operations_so_far'] = 0
torch.save(ckpt, sys.argv[1])
'''


def test_a_checkpoint_as_megatron_writes_it_imports_without_megatron(tiny_checkpoint, tmp_path):
    "Every type Megatron-LM declares its checkpoints hold (megatron/core/safe_globals.py) is read, Megatron's own as stand-ins"
    from gptkit.checkpoint.checkpointing import load_weights
    assert run_here('checkpoint', 'export', tiny_checkpoint, tmp_path / 'meg', '--to', 'megatron').returncode == 0
    f = tmp_path / 'meg' / 'iter_0000000' / 'mp_rank_00' / 'model_optim_rng.pt'
    w = subprocess.run([sys.executable, '-c', MEGATRON_WRITER, str(f)], capture_output=True, text=True, timeout=300)
    assert w.returncode == 0, w.stderr[-3000:]
    r = subprocess.run([GPTKIT, 'checkpoint', 'import', str(tmp_path / 'meg'), str(tmp_path / 'back'), '--from', 'megatron'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert 'loading it fully' not in r.stderr
    want, got = load_weights(tiny_checkpoint), load_weights(tmp_path / 'back')
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _killed_export(run: Path, out: Path) -> Path:
    "Run `gptkit checkpoint export` in a process SIGKILLed in the middle of writing the weights; its staging folder"
    code = f'''
import os, signal, sys
import safetensors.torch as st
def dying(tensors, path, metadata=None):
    with open(path, 'wb') as f: f.write(b'0' * 100000)
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = dying
from gptkit_cli.main import app
app(['checkpoint', 'export', {str(run)!r}, {str(out)!r}, '--to', 'hf'])
'''
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    left = list(out.parent.glob(f'.{out.name}.tmp-*'))
    assert len(left) == 1 and (left[0] / 'model.safetensors').is_file() and not out.exists()
    return left[0]


def test_an_export_removes_what_a_killed_export_left(tiny_checkpoint, tmp_path):
    "A SIGKILLed export leaves its hidden staging folder; the next export beside it removes it, not a live one's"
    out = tmp_path / 'exports' / 'hf'
    left = _killed_export(tiny_checkpoint, out)
    sleeper = subprocess.Popen(['sleep', '60'])
    try:
        live = out.parent / f'.other.tmp-{sleeper.pid}'          # another export, still writing
        live.mkdir()
        r = run_here('checkpoint', 'export', tiny_checkpoint, out, '--to', 'hf')
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert not left.exists() and live.is_dir()
        assert sorted(p.name for p in out.parent.iterdir()) == sorted(['hf', live.name])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_payload_in_torchs_old_file_format_runs_not(runs, tmp_path):
    "A file in torch's pre-1.6 format cannot be listed before it is read; torch's safe reader refuses the payload itself"
    from gptkit.store.torch_files import read_torch_file
    run, folder = copy_run(runs(1), tmp_path)
    f, marker = folder / 'mp_rank_00_model_states.pt', tmp_path / 'ran'
    torch.save({**read_torch_file(f), 'extra': Payload(marker)}, f, _use_new_zipfile_serialization=False)
    reseal(folder)
    r = run_here('checkpoint', 'inspect', run)
    said = ' '.join((r.stdout + r.stderr).split())
    assert not marker.exists() and r.returncode == 1, said[-2000:]
    assert f'{f} was not loaded: it asks for the Python object exec,' in said and 'Traceback' not in said


@pytest.mark.parametrize('damage', ['truncated', 'empty', 'not a pickle'])
def test_a_file_that_is_no_torch_file_is_one_sentence(damage, runs, tmp_path):
    run, folder = copy_run(runs(1), tmp_path)
    f = folder / 'mp_rank_00_model_states.pt'
    f.write_bytes({'truncated': f.read_bytes()[:3000], 'empty': b'', 'not a pickle': b'\x80\x02X' + b'\xff' * 64}[damage])
    reseal(folder)
    r = run_here('checkpoint', 'inspect', run)
    said = ' '.join((r.stdout + r.stderr).split())
    assert r.returncode == 1 and 'Traceback' not in said, said[-2000:]
    assert said.startswith(f'error: {f} cannot be read as a torch file: ') or said.startswith(f'error: {f} was not loaded: '), said
