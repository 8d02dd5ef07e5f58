"""Checkpoints written by earlier gptkit versions keep loading and resuming (fixture: tests/data/legacy_run)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / 'data' / 'legacy_run'


@pytest.fixture
def legacy_run(tmp_path) -> Path:
    run = tmp_path / 'run'
    shutil.copytree(FIXTURE / 'run', run)
    return run


def test_an_old_checkpoint_loads_with_the_same_logits(legacy_run):
    from gptkit.checkpoint.checkpointing import load_model
    expected = torch.load(legacy_run / 'expected_logits.pt')
    loaded = load_model(legacy_run)
    with torch.no_grad(): logits = loaded.model.eval()(expected['ids'])
    torch.testing.assert_close(logits, expected['logits'], rtol=0, atol=1e-6)


def test_an_old_checkpoint_resumes_to_the_losses_of_the_uninterrupted_run(legacy_run):
    from gptkit.config.run import resolve
    from gptkit.train.loop import train
    expected = json.loads((legacy_run / 'expected.json').read_text())
    data = {'prefix': str(FIXTURE / 'data' / 'kjv_text_document'), 'tokenizer': str(legacy_run / 'tokenizer')}
    cfg = resolve(file=legacy_run / 'config.json', overrides={'data': data}, out=str(legacy_run))
    result = train(cfg, resume=True)
    assert result.iteration == 6
    assert result.losses == pytest.approx(expected['losses_1_to_6'][expected['iteration']:], rel=1e-6)
    assert result.valid_loss == pytest.approx(expected['valid_loss'], rel=1e-6)


def test_an_old_checkpoint_is_inspected_and_exported(legacy_run, tmp_path):
    from gptkit.checkpoint.checkpointing import inspect
    info = inspect(legacy_run)
    assert info['iteration'] == 3
    from typer.testing import CliRunner

    from gptkit_cli.main import app
    r = CliRunner().invoke(app, ['checkpoint', 'export', str(legacy_run), str(tmp_path / 'hf'), '--to', 'hf'])
    assert r.exit_code == 0, r.output
    assert (tmp_path / 'hf' / 'model.safetensors').exists()
