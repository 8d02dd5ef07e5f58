"""The run plan: made once, read once per process, handed to the processes a launcher starts."""
import dataclasses
import json

from typer.testing import CliRunner

from conftest import TINY_SETS
from gptkit.train.plan import PLAN_ENV, RunPlan, hand_over, handed_plan, plan_run, run_config
from gptkit_cli.main import app

runner = CliRunner()


def config(tiny_data, out, *sets):
    prefix, tok = tiny_data
    return run_config(sets=[*TINY_SETS, *sets], overrides={'data': {'prefix': prefix, 'tokenizer': tok}},
                      vocab=False, out=str(out))


def test_a_plan_settles_the_run_and_survives_json(tiny_data, tmp_path):
    plan = plan_run(config(tiny_data, tmp_path / 'run'), world=2)
    assert (plan.vocab, plan.layout.dp, plan.batch.accumulation, plan.resume_from) == (512, 2, 1, None)
    assert [p.samples for p in plan.data['train']] == [24]
    again = RunPlan.from_json(plan.to_json())
    assert again == plan and again.tokenizer is None          # a rank that needs the tokenizer reads it itself


def test_a_restarted_process_resumes_from_the_newest_checkpoint(tiny_data, tmp_path, monkeypatch):
    from gptkit.train.loop import train
    cfg = config(tiny_data, tmp_path / 'run', 'train.save_interval=2')
    train(cfg, stop_after=2)
    plan = plan_run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, iters=6)), resume=True)
    assert plan.resume_from.name == 'iter_0000002'
    stale = dataclasses.replace(plan, resume_from=None)
    monkeypatch.setenv(PLAN_ENV, hand_over(stale))
    assert handed_plan().resume_from is None                  # as the launch planned it
    assert handed_plan(restarted=True).resume_from.name == 'iter_0000002'


def test_the_tokenizer_is_read_once_per_process(tiny_data, tmp_path, monkeypatch):
    "`gptkit train` used to read it twice in the process that trains (its config, then setup)"
    import gptkit.train.plan
    import gptkit.train.loop
    reads = []
    def counted(real):
        return lambda *a, **kw: reads.append(a) or real(*a, **kw)
    monkeypatch.setattr(gptkit.train.plan, 'load_tokenizer', counted(gptkit.train.plan.load_tokenizer))
    monkeypatch.setattr(gptkit.train.loop, 'load_tokenizer', counted(gptkit.train.loop.load_tokenizer))
    prefix, tok = tiny_data
    args = ['train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'run')]
    r = runner.invoke(app, [*args, *[a for s in [*TINY_SETS, 'train.iters=2'] for a in ('--set', s)]])
    assert r.exit_code == 0, r.output
    assert len(reads) == 1, reads


def test_a_launched_process_trains_the_plan_it_was_handed(tiny_data, tmp_path, monkeypatch):
    "Under a launcher the process takes the plan from its environment, not from its command line"
    import gptkit.train.plan
    from gptkit.train.engine import free_port
    handed = plan_run(config(tiny_data, tmp_path / 'run', 'train.iters=2'))
    monkeypatch.setattr(gptkit.train.plan, 'plan_run', lambda *a, **kw: (_ for _ in ()).throw(AssertionError('re-planned')))
    for k, v in {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1',
                 'MASTER_PORT': str(free_port()), PLAN_ENV: hand_over(handed)}.items():
        monkeypatch.setenv(k, v)
    prefix, tok = tiny_data
    sets = [a for s in [*TINY_SETS, 'train.iters=5'] for a in ('--set', s)]   # what the plan says wins
    r = runner.invoke(app, ['train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'run'), *sets])
    assert r.exit_code == 0, r.output
    assert 'done' in r.output and '2 steps' in ' '.join(r.output.split()), r.output
    assert json.loads((tmp_path / 'run' / 'config.json').read_text())['train']['iters'] == 2


def test_a_plan_for_other_processes_is_refused(tiny_data, tmp_path):
    from gptkit.errors import ConfigError
    from gptkit.train.loop import train
    plan = plan_run(config(tiny_data, tmp_path / 'run'), world=2)
    try:
        train(plan)
    except ConfigError as e:
        assert 'plans the run for 2 processes, but 1 run it' in e.render(lambda k: k)
    else:
        raise AssertionError('a plan for 2 processes trained in 1')
    assert not (tmp_path / 'run').exists()                   # refused before the run folder is written


def test_a_plan_changed_after_its_launch_is_refused_not_trained(tiny_data, tmp_path, monkeypatch):
    "A launched process checks the saved plan against the digest it was handed: another launch may have rewritten it"
    from gptkit.train.engine import free_port
    handle = hand_over(plan_run(config(tiny_data, tmp_path / 'run', 'train.iters=2')))
    saved = tmp_path / 'run' / 'plan.json'
    assert handle.rpartition('#')[0] == str(saved)
    saved.write_text(saved.read_text().replace('"iters": 2', '"iters": 3'))
    for k, v in {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1',
                 'MASTER_PORT': str(free_port()), PLAN_ENV: handle}.items():
        monkeypatch.setenv(k, v)
    prefix, tok = tiny_data
    sets = [a for s in [*TINY_SETS, 'train.iters=2'] for a in ('--set', s)]
    r = runner.invoke(app, ['train', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'run'), *sets])
    assert r.exit_code == 1, r.output
    assert 'plan.json changed after gptkit train saved it for these processes' in ' '.join(r.output.split())
    assert 'Traceback' not in r.output and not (tmp_path / 'run' / 'checkpoints').exists()


def test_a_launch_into_a_run_in_use_is_refused_before_its_processes_start(tiny_data, tmp_path):
    "The plan is saved under the run's lock: a training running there keeps its plan, and nothing is launched"
    import subprocess
    import sys
    run = tmp_path / 'run'
    holder = subprocess.Popen([sys.executable, '-c', 'import sys, time; from gptkit.store.folders import lock_run; '
                               f'lock_run({str(run)!r}); print("held", flush=True); time.sleep(120)'],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        (run / 'plan.json').write_text('{"the running training": "its plan"}')
        prefix, tok = tiny_data
        sets = [a for s in [*TINY_SETS, 'train.iters=2'] for a in ('--set', s)]
        r = runner.invoke(app, ['train', '--nproc', '2', '--data', prefix, '--tokenizer', tok, '--out', str(run), *sets])
    finally:
        holder.kill()
        holder.wait()
    assert r.exit_code != 0 and 'is in use by' in ' '.join(r.output.split()), r.output
    assert (run / 'plan.json').read_text() == '{"the running training": "its plan"}'
    assert 'torch.distributed.run' not in r.output and 'Traceback' not in r.output   # no launcher started
