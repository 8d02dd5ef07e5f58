"""`gptkit profile` end to end on the tiny preset on CPU, and --steps errors that name the flag."""
import dataclasses
import gzip
import json

import pytest
from conftest import torch_threads
from typer.testing import CliRunner

from gptkit_cli.main import app

runner = CliRunner()


@pytest.fixture
def one_thread():
    with torch_threads(1): yield


@pytest.mark.parametrize('steps,why', [('4-2', "'4-2' has the range 4-2, which ends before it starts"),
                                       ('2-5,4-6', 'overlapping or before 2-5'), ('3-', 'is not a list of step ranges'),
                                       ('', 'is not a list of step ranges'), ('1,,2', 'is not a list of step ranges')])
def test_bad_steps_is_one_line_naming_the_flag(steps, why, tmp_path):
    r = runner.invoke(app, ['profile', '--steps', steps, '--out', str(tmp_path / 'p')])
    assert r.exit_code == 2
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: --steps ') and why in lines[0], r.output
    assert not (tmp_path / 'p').exists()                 # refused before any data or run was made


def test_profile_tiny_on_cpu_end_to_end(tmp_path, one_thread):
    "No --data: the built-in text is tokenized into OUT/data; steps 1-2 recorded, plus one step for DeepSpeed's flops profiler"
    from gptkit.estimate.sizing import flops_per_iteration
    from gptkit.config.run import resolve
    out = tmp_path / 'prof'
    r = runner.invoke(app, ['profile', '--preset', 'tiny', '--steps', '1-2', '--out', str(out), '--deepspeed-flops', '--no-stack',
                            '--set', 'train.global_batch=4', '--set', 'train.micro_batch=2'])
    assert r.exit_code == 0, r.output
    text = ' '.join(r.output.split())
    assert 'Top operators by self CPU time' in text and 'aten::mm' in text and 'Top operators by self CPU memory' in text
    assert 'TFLOP/s per device, MFU n/a (no known peak for this device: a CPU)' in text
    assert 'DeepSpeed flops profiler' in text
    assert (out / 'data' / 'kjv_text_document.bin').exists() and (out / 'data' / 'tokenizer').exists()

    s = json.loads((out / 'summary.json').read_text())
    assert s['profiled_steps'] == [1, 2] and s['device'] == 'cpu' and s['mfu'] is None
    cfg = resolve('tiny', sets=['train.global_batch=4'])
    assert s['flops_per_step'] == flops_per_iteration(dataclasses.replace(cfg.model, vocab=4096), 4)
    seconds = s['step_seconds']['1'] + s['step_seconds']['2']
    assert s['profiled_seconds'] == pytest.approx(seconds)
    assert s['tflops'] == pytest.approx(s['flops_per_step'] * 2 / seconds / 1e12, rel=1e-12)
    assert s['tflops'] > 0 and 0 < s['profiler_flops_per_step'] <= s['flops_per_step']
    assert sorted(s['step_seconds']) == ['0', '1', '2', '3']           # steps 0-2, then DeepSpeed's step 3
    top = s['top_by_time'][0]
    assert top['self_cpu_us'] > 0 and top['calls'] > 0 and s['top_by_memory'][0]['self_cpu_memory'] > 0
    assert s['seconds_by_category']['matmul'] > 0 and s['seconds_by_category']['optimizer'] > 0

    trace = json.loads((out / 'traces' / 'steps_1-2.json').read_text())
    names = {e.get('name') for e in trace['traceEvents']}
    assert {'ProfilerStep#1', 'ProfilerStep#2', '[memory]', 'aten::mm'} <= names and 'ProfilerStep#0' not in names
    assert trace['record_shapes'] == trace['profile_memory'] == trace['with_flops'] == 1
    tb = list((out / 'tensorboard').glob('*.pt.trace.json.gz'))
    assert len(tb) == 1
    with gzip.open(tb[0], 'rt') as f: assert json.load(f)['traceEvents']

    report = (out / 'deepspeed_flops.txt').read_text()
    assert 'Profile Summary at step 4' in report or 'Profile Summary at step' in report
    assert s['deepspeed_fwd_flops'] == pytest.approx(s['flops_per_step'] / 3 / s['micro_batches'], rel=0.1)
