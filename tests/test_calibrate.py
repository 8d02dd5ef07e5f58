"""Calibration on the user's machine (issue 33, items 4 and 5): hardware profile files and their faults, run folders
and theirs, the fit on a real tiny run, `gptkit estimate --calibrate/--hardware` and `gptkit train`'s predicted step."""
import dataclasses
import json

import pytest
from conftest import TINY_SETS
from typer.testing import CliRunner

from gptkit.estimate.calibrate import (
    calibrate,
    load_hardware,
    machine_profile,
    predicted_step,
    read_run,
    save_hardware,
)
from gptkit.errors import ConfigError
from gptkit.estimate.perf import GPUS
from gptkit_cli.main import app

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def sets(*items):
    return [a for s in items for a in ('--set', s)]


def one_sentence(r, code=2):
    "The CLI failed with `code`, one line, no traceback"
    text = ' '.join(r.output.split())
    assert r.exit_code == code, r.output
    assert 'Traceback' not in r.output and r.exception is None or isinstance(r.exception, SystemExit), r.output
    return text


BAD_FILES = [
    ('{"h100-lab": {"base": "h100-80gb", "hbm": -1}}',
     "profile 'h100-lab', key 'hbm': must be a positive number, not -1"),
    ('{"x": {"base": "cpu", "hbm": 0}}', "key 'hbm': must be a positive number, not 0"),
    ('{"x": {"base": "cpu", "gemm_efficiency": 1.5}}', "key 'gemm_efficiency': is a fraction of a peak, at most 1"),
    ('{"x": {"base": "cpu", "launch": "fast"}}', "key 'launch': must be a positive number, not \"fast\""),
    ('{"x": {"base": "cpu", "launch": true}}', "key 'launch': must be a positive number, not true"),
    ('{"x": {"base": "cpu", "hbm": NaN}}', "key 'hbm': must be a positive number, not NaN"),
    ('{"x": {"base": "cpu", "hbm": 1e999}}', "key 'hbm': must be a positive number"),
    ('{"x": {"base": "cpu", "hbm": [1]}}', "key 'hbm': must be a positive number"),
    ('{"x": {"base": "cpu", "hmb": 1e12}}', "key 'hmb': is not a profile field"),
    ('{"x": {"base": "cpu", "shared": 1}}', "key 'shared': must be true or false, not 1"),
    ('{"x": {"base": "cpu", "overhead": -0.001}}', "key 'overhead': must be zero or more seconds, not -0.001"),
    ('{"x": {"base": "cpu", "name": "y"}}', "key 'name': is not a profile field"),
    ('{"x": {"memory": 1}}', "key 'peak_16bit': is missing"),
    ('{"x": {"base": "b200"}}', "key 'base': \"b200\" is not a known profile"),
    ('{"x": {"base": 3}}', "key 'base': 3 is not a known profile"),
    ('{"x": 3}', "profile 'x' must be an object of fields, not int"),
    ('{"": {"base": "cpu"}}', "profile name '' must be 1-64 characters"),
    ('{"A": {"base": "cpu"}, "a": {"base": "cpu"}}', "profile name 'a' must be 1-64 characters and differ"),
    ('[1, 2]', 'holds an array, not an object'),
    ('import os', 'is not valid JSON'),
    ('', 'is not valid JSON'),
    ('{"x": ' * 2000 + '1' + '}' * 2000, 'nested more than'),
]


@pytest.mark.parametrize('text,message', BAD_FILES)
def test_a_bad_profile_file_is_one_sentence_naming_file_profile_and_key(tmp_path, text, message):
    (tmp_path / 'lab.json').write_text(text)
    with pytest.raises(ConfigError) as e:
        load_hardware(tmp_path / 'lab.json')
    said = str(e.value)
    assert message in said and 'lab.json' in said and '\n' not in said, said


def test_profiles_from_a_base_or_whole_and_saved_merged_atomically(tmp_path):
    f = tmp_path / 'lab.json'
    f.write_text(json.dumps({'h100-lab': {'base': 'h100-80gb', 'network': 12.5e9},
                             'box': {'memory': 2**33, 'peak_16bit': 1e12, 'peak_tf32': 5e11},
                             'box-slow': {'base': 'box', 'launch': 1e-4}}))
    got = load_hardware(f)
    assert got['h100-lab'] == dataclasses.replace(GPUS['h100-80gb'], name='h100-lab', network=12.5e9)
    assert got['box-slow'].peak_16bit == 1e12 and got['box-slow'].launch == 1e-4   # a base from the same file
    mine = dataclasses.replace(GPUS['cpu'], name='cpu (calibrated)', launch=3e-5)
    save_hardware(f, {mine.name: mine})
    again = load_hardware(f)
    assert sorted(again) == ['box', 'box-slow', 'cpu (calibrated)', 'h100-lab'] and again['cpu (calibrated)'] == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ['lab.json']              # no temporary left
    (tmp_path / 'broken.json').write_text('{"x": {"hbm": -1}}')
    with pytest.raises(ConfigError, match='broken.json'):
        save_hardware(tmp_path / 'broken.json', {mine.name: mine})
    assert (tmp_path / 'broken.json').read_text() == '{"x": {"hbm": -1}}'        # not overwritten


def write_run(folder, rows, config=True):
    from gptkit.config.sections import ModelConfig, TrainConfig
    from gptkit.config.run import RunConfig, save_config
    folder.mkdir()
    if config:
        save_config(RunConfig(model=ModelConfig(layers=2, hidden=64, heads=2, seq_len=32, vocab=512, dropout=0.0),
                              train=TrainConfig(micro_batch=2, global_batch=2, precision='fp32', iters=4)),
                    folder / 'config.json')
    if rows is not None:
        (folder / 'metrics.jsonl').write_text(rows)
    return folder


@pytest.mark.parametrize('case,message', [
    ('missing', 'is not a folder'),
    ('file', 'is not a folder'),
    ('no config', 'is not a run folder: it has no config.json'),
    ('bad config', 'config.json'),
    ('no metrics', 'has no metrics.jsonl'),
    ('one report', 'has no usable train report after the first (1 train rows'),
    ('no step', 'has no usable train report after the first'),
    ('garbage', 'has no usable train report after the first (0 train rows'),
])
def test_run_folder_faults_are_one_sentence_naming_the_folder_or_file(tmp_path, case, message):
    folder = tmp_path / 'r'
    good = '{"kind": "train", "step_seconds": 0.5}\n'
    if case == 'file':
        folder.write_text('x')
    elif case == 'no config':
        write_run(folder, good * 3, config=False)
    elif case == 'bad config':
        write_run(folder, good * 3)
        (folder / 'config.json').write_text('{"model": {"layers": -2}}')
    elif case != 'missing':
        rows = {'no metrics': None, 'one report': good, 'garbage': '\x00\xff{[\n' * 3,
                'no step': good + '{"kind": "train", "step_seconds": null}\n{"kind": "train", "step_seconds": -1}\n'
                                  '{"kind": "train", "step_seconds": "1"}\n{"kind": "valid", "loss": 1}\n'}[case]
        write_run(folder, rows)
    with pytest.raises(ConfigError) as e:
        read_run(folder)
    said = str(e.value)
    assert message in said and 'r' in said and '\n' not in said, said
    r = run('estimate', '--calibrate', folder)
    assert message in one_sentence(r)


@pytest.fixture(scope='module')
def tiny_run(tiny_data, tmp_path_factory):
    "(run folder, train's output): `gptkit train` for 4 steps, a report each"
    prefix, tok = tiny_data
    out = tmp_path_factory.mktemp('cal') / 'run'
    r = run('train', '--data', prefix, '--tokenizer', tok, '--out', out,
            *sets(*TINY_SETS, 'train.iters=4', 'train.eval_interval=100'))
    assert r.exit_code == 0, r.output
    return out, ' '.join(r.output.split())


def test_train_prints_the_predicted_step_beside_the_measured_one(tiny_run):
    out, said = tiny_run
    first = json.loads((out / 'metrics.jsonl').read_text().splitlines()[0])
    predicted = predicted_step(read_run(out).cfg, 1, GPUS['cpu']).total
    assert (f"step time: {first['step_seconds'] * 1e3:,.1f} ms measured (the first report holds the warm-up), "
            f'{predicted * 1e3:,.1f} ms predicted on cpu') in said, said


def test_calibrate_round_trip_on_a_real_run(tiny_run, tmp_path):
    out, _ = tiny_run
    measured = read_run(out)
    steps = [json.loads(x)['step_seconds'] for x in (out / 'metrics.jsonl').read_text().splitlines()
             if '"train"' in x]
    assert measured.reports == 3 and measured.world == 1 and measured.step_seconds == sorted(steps[1:])[1]
    fitted = calibrate(measured, GPUS['cpu'])
    assert fitted.name == 'cpu (calibrated)'
    assert predicted_step(measured.cfg, 1, fitted).total == pytest.approx(measured.step_seconds, rel=1e-9)
    for k in ('gemm_efficiency', 'attention_efficiency', 'memory_efficiency'):
        assert 0 < getattr(fitted, k) <= 1
    # the command line: the table, the file, then the profile used by name
    f = tmp_path / 'hw.json'
    r = run('estimate', '--calibrate', out, '--save-hardware', f, '--name', 'Lab CPU')
    said = ' '.join(r.output.split())
    assert r.exit_code == 0, r.output
    assert f'measured step {measured.step_seconds * 1e3:.1f} ms' in said and '1.00 x measured' in said
    assert load_hardware(f)['lab cpu'] == dataclasses.replace(fitted, name='lab cpu')
    r = run('estimate', '--calibrate', out, '--json')
    d = json.loads(r.output)
    assert d['measured_s'] == measured.step_seconds and d['after']['total'] == pytest.approx(d['measured_s'])
    cfg = measured.cfg
    common = ['estimate', '--layers', 2, '--hidden', 64, '--heads', 2, '--seq-len', 32, '--vocab', cfg.model.vocab,
              '--precision', 'fp32', '--micro-batch', 2, '--global-batch', 4, '--gpus', 1, '--json']
    mine = json.loads(run(*common, '--hardware', f, '--gpu', 'LAB CPU').output)
    base = json.loads(run(*common, '--gpu', 'cpu').output)
    factor = fitted.launch / GPUS['cpu'].launch             # one process: every part is the device's own work
    assert mine['gpu']['name'] == 'lab cpu'
    assert mine['time']['step_seconds'] == pytest.approx(factor * base['time']['step_seconds'], rel=1e-9)
    ranked = json.loads(run(*common[:-3], '--search', '--hardware', f, '--gpu', 'lab cpu', '--json').output)
    assert ranked and 'lab cpu' in json.dumps(ranked)


def test_estimate_flags_fail_in_one_sentence(tmp_path):
    (tmp_path / 'bad.json').write_text('{"lab": {"base": "cpu", "link_efficiency": 2}}')
    said = one_sentence(run('estimate', '--preset', 'tiny', '--hardware', tmp_path / 'bad.json'))
    assert "bad.json: profile 'lab', key 'link_efficiency': is a fraction of a peak, at most 1, not 2" in said
    said = one_sentence(run('estimate', '--preset', 'tiny', '--hardware', tmp_path / 'none.json'))
    assert 'none.json' in said
    (tmp_path / 'ok.json').write_text('{"lab": {"base": "cpu"}}')
    said = one_sentence(run('estimate', '--preset', 'tiny', '--hardware', tmp_path / 'ok.json', '--gpu', 'lap'))
    assert "'lap' is not known; choose one of" in said and 'lab' in said
    assert '--save-hardware goes with --calibrate RUN' in one_sentence(
        run('estimate', '--preset', 'tiny', '--save-hardware', tmp_path / 'x.json'))
    assert '--name goes with --calibrate RUN' in one_sentence(run('estimate', '--preset', 'tiny', '--name', 'x'))


def test_train_profile_from_the_environment(tiny_run, tmp_path):
    f = tmp_path / 'hw.json'
    save_hardware(f, {'mine': dataclasses.replace(GPUS['cpu'], name='mine', launch=1e-3)})
    assert machine_profile('cpu', {'GPTKIT_HARDWARE': str(f), 'GPTKIT_GPU': 'Mine'}).launch == 1e-3
    assert machine_profile('NVIDIA A100-SXM4-40GB', {}).name == 'a100-40gb'
    assert machine_profile('Tesla T4', {}) is None
    with pytest.raises(ConfigError, match="GPTKIT_GPU='nope' is not a known profile"):
        machine_profile('cpu', {'GPTKIT_HARDWARE': str(f), 'GPTKIT_GPU': 'nope'})
    from gptkit.train.callbacks import RunInfo
    from gptkit_cli.train import predicted_line
    cfg = read_run(tiny_run[0]).cfg
    info = RunInfo(cfg=cfg, iters=4, start=0, params=1, world_size=1, grad_accum=1, device='cpu', flops_per_step=1.0,
                   peak_flops=None, out=tiny_run[0])
    import os
    old = {k: os.environ.get(k) for k in ('GPTKIT_HARDWARE', 'GPTKIT_GPU')}
    try:
        os.environ.update(GPTKIT_HARDWARE=str(f), GPTKIT_GPU='mine')
        assert 'predicted on mine' in predicted_line(info, 0.1)
        (tmp_path / 'hw.json').write_text('{"mine": {"hbm": 1}}')
        line = predicted_line(info, 0.1)            # a broken file: the training goes on, the sentence says why
        assert 'no prediction' in line and "hw.json: profile 'mine', key 'memory': is missing" in line
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})


def test_every_known_profile_survives_a_save_and_load(tmp_path):
    "GPU profiles have no host overhead (0 s) and a CPU's is shared: both are written and read back as they were"
    from gptkit.estimate.calibrate import load_hardware, save_hardware
    from gptkit.estimate.perf import GPUS
    save_hardware(tmp_path / 'all.json', dict(GPUS))
    assert load_hardware(tmp_path / 'all.json') == dict(GPUS)
