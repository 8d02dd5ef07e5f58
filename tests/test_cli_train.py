"""`gptkit train` on the command line: dry runs, launch commands, and errors that name the flag or key."""
import json

import pytest
from typer.testing import CliRunner

from conftest import TINY_SETS
from gptkit_cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def sets(*items):
    return [a for s in items for a in ('--set', s)]


def test_dry_run_prints_config_deepspeed_config_and_launch_command(tiny_data):
    prefix, tok = tiny_data
    r = run('train', '--preset', '125m', '--data', prefix, '--tokenizer', tok, '--iters', '100', '--dry-run', '--nproc', '4',
            *sets('train.micro_batch=8', 'parallel.zero=1', 'train.precision=bf16'))
    assert r.exit_code == 0, r.output
    assert '"gradient_accumulation_steps": 8' in r.output and '"train_batch_size": 256' in r.output
    assert '"stage": 1' in r.output and '"bf16": {' in r.output.replace('\n', '')
    assert '-m torch.distributed.run --nproc_per_node 4' in r.output and '-m gptkit_cli.main train' in r.output
    assert '--dry-run' not in r.output.split('Launch command')[1]
    assert '"vocab": 512' in r.output                              # the tokenizer decides the vocabulary
    r = run('train', '--preset', 'tiny', '--dry-run', '--nproc', '2', '--launcher', 'deepspeed')
    assert r.exit_code == 0 and '-m deepspeed.launcher.runner --num_gpus 2' in r.output and '--module gptkit_cli.main train' in r.output


def test_dry_run_counts_steps_for_the_processes_that_will_train():
    "--tokens without a global batch: two data-parallel processes take steps twice as large, so half as many"
    common = ['train', '--preset', 'tiny', '--tokens', '20480', '--dry-run',
              *sets('train.global_batch=null', 'train.micro_batch=4')]
    one, two = run(*common), run(*common, '--nproc', '2')
    assert one.exit_code == 0 and two.exit_code == 0, one.output + two.output
    one, two = ' '.join(one.output.split()), ' '.join(two.output.split())       # rich wraps long lines
    assert '20 steps of 4 x 256 = 1,024 tokens' in one and 'dp 1' in one
    assert '10 steps of 8 x 256 = 2,048 tokens' in two and 'dp 2' in two
    assert '"train_batch_size": 8' in two and '"gradient_accumulation_steps": 1' in two
    assert '--nproc_per_node 2' in two


def test_the_configured_layout_decides_the_processes_and_the_world_is_checked():
    r = run('train', '--preset', 'tiny', '--dry-run', *sets('parallel.tp=2', 'parallel.dp=2'))
    assert r.exit_code == 0 and '--nproc_per_node 4' in r.output, r.output
    assert 'tp 2 x pp 1 x dp 2' in ' '.join(r.output.split())
    r = run('train', '--preset', 'tiny', '--dry-run', '--tp', '2', '--nproc', '3')
    assert r.exit_code == 2 and '--tp 2 x pp 1 = 2 must divide the 3 processes' in ' '.join(r.output.split()), r.output
    r = run('train', '--preset', 'tiny', '--dry-run', '--nproc', '3')      # tiny's global batch of 16 over 3 replicas
    want = '--set train.global_batch 16 must be a multiple of micro-batch x data-parallel = 1 x 3 = 3'
    assert r.exit_code == 2 and want in ' '.join(r.output.split()), r.output


@pytest.mark.parametrize('bf16_seconds, precision', [(0.19, 'fp32'), (0.0012, 'bf16')])
def test_a_cpu_trains_in_the_precision_it_measured_faster_unless_asked(tmp_path, monkeypatch, pin_cpu, bf16_seconds,
                                                                       precision):
    "The decision on both sides: bf16 emulated (19x slower than fp32) and on AMX tiles (8x faster), as measured there"
    from gptkit.machine import choices
    from gptkit.machine.cpu import CPU, ISA_ENV
    from gptkit.machine.timings import CACHE_ENV
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    pin_cpu(CPU('Test Xeon', frozenset({'avx512_bf16', 'amx_bf16'})))
    for var in ISA_ENV:                            # a CPU with bf16 instructions, whatever this one is
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(choices, 'product_seconds', lambda shapes, rounds=5: {'fp32': 0.01, 'bf16': bf16_seconds})
    r = run('train', '--preset', 'tiny', '--dry-run')
    assert f'"precision": "{precision}"' in r.output and f'train.precision auto -> {precision}' in ' '.join(r.output.split())
    asked = run('train', '--preset', 'tiny', '--dry-run', '--set', 'train.precision=fp32').output
    assert '"precision": "fp32"' in asked and 'auto ->' not in asked


def test_config_file_and_overrides(tmp_path):
    (tmp_path / 'run.yaml').write_text('model:\n  layers: 3\ntrain:\n  iters: 7\noptim:\n  lr: 1.0e-3\n')
    r = run('train', '--config', str(tmp_path / 'run.yaml'), '--dry-run', '--set', 'optim.lr=2e-3')
    assert r.exit_code == 0, r.output
    cfg = json.loads(r.output.split('Run config')[1].split('DeepSpeed config')[0])
    assert (cfg['model']['layers'], cfg['train']['iters'], cfg['optim']['lr']) == (3, 7, 2e-3)


@pytest.mark.parametrize('args,message', [
    (['--set', 'train.iter=5'], '--set train.iter is not a setting; train has'),
    (['--set', 'iters=5'], "--set 'iters=5' must look like section.key=value"),
    (['--set', 'train.micro_batch=0', '--set', 'optim.lr=-1'], '--set train.micro_batch must be a positive whole number, not 0; --set optim.lr must be positive'),
    (['--preset', '7b'], "--preset '7b' is not a preset; choose one of tiny"),
    (['--iters', '0'], '--iters must be a positive whole number, not 0'),
    (['--set', 'parallel.tp=5', '--preset', '125m'], '--tp 5 must divide model.heads 12'),
    (['--launcher', 'mpirun', '--nproc', '2'], "--launcher must be torchrun or deepspeed, not 'mpirun'"),
])
def test_bad_settings_name_the_flag(args, message):
    r = run('train', *args, '--dry-run')
    assert r.exit_code == 2 and message in r.output.replace('\n', ' '), r.output


def test_bad_files_name_the_file_and_line(tmp_path):
    (tmp_path / 'bad.json').write_text('{"model": {"layers": 2,,}}')
    r = run('train', '--config', str(tmp_path / 'bad.json'), '--dry-run')
    assert r.exit_code == 2 and 'bad.json (line 1) is not valid JSON' in r.output.replace('\n', ' ')
    (tmp_path / 'ds.json').write_text('[1, 2]')
    r = run('train', '--deepspeed-config', str(tmp_path / 'ds.json'), '--dry-run')
    assert r.exit_code == 2 and 'ds.json must hold a JSON object' in r.output.replace('\n', ' ')
    r = run('train', '--config', str(tmp_path / 'missing.yaml'), '--dry-run')
    assert r.exit_code == 2 and 'missing.yaml cannot be read' in r.output.replace('\n', ' ')


def test_deepspeed_config_overrides_the_generated_one(tmp_path):
    (tmp_path / 'ds.json').write_text('{"zero_optimization": {"reduce_bucket_size": 1000}, "gradient_clipping": 0.5}')
    r = run('train', '--deepspeed-config', str(tmp_path / 'ds.json'), '--dry-run')
    ds = json.loads(r.output.split('DeepSpeed config')[1].split('\n', 1)[1].split('Launch command')[0])
    assert ds['zero_optimization'] == {'stage': 0, 'reduce_bucket_size': 1000} and ds['gradient_clipping'] == 0.5


def test_missing_data_and_too_big_models_are_one_line_errors(tiny_data, tmp_path):
    r = run('train', '--data', str(tmp_path / 'nothing'), '--tokenizer', tiny_data[1], '--out', str(tmp_path / 'r'))
    assert r.exit_code == 1 and 'nothing.bin: no such file; data.prefix must name the PREFIX' in r.output.replace('\n', ' ')
    r = run('train', '--preset', '175b', '--data', tiny_data[0], '--tokenizer', tiny_data[1], '--out', str(tmp_path / 'r'))
    assert r.exit_code == 1 and 'preset 175b needs about' in r.output and '--force' in r.output


@pytest.fixture
def two_prefixes(tiny_data, tmp_path):
    "The tiny dataset under two prefixes"
    import shutil
    for ext in ('bin', 'idx'): shutil.copy(f'{tiny_data[0]}.{ext}', tmp_path / f'b.{ext}')
    return tiny_data[0], str(tmp_path / 'b')


def test_dry_run_shows_each_datasets_weight_samples_and_epochs(tiny_data, two_prefixes):
    from gptkit.data.samples import plan_split
    a, b = two_prefixes
    common = ['train', '--preset', 'tiny', '--tokenizer', tiny_data[1], '--iters', '10', '--dry-run',
              *sets('train.global_batch=16', 'train.eval_iters=2')]
    r = run(*common, '--data', f'0.3 {a} 0.7 {b}')
    assert r.exit_code == 0, r.output
    text = ' '.join(r.output.split())
    epochs = [p.epochs for p in plan_split([a, b], [0.3, 0.7], 'train', 160, 256, split='949,50,1')]
    assert f'train data: {a} | weight 0.3 | 48 samples | {epochs[0]} epoch' in text
    assert f'train data: {b} | weight 0.7 | 112 samples | {epochs[1]} epoch' in text
    assert f'valid data: {b} | weight 0.7 | 23 samples' in text          # ceil(32 x 0.7)
    r = run(*common, '--train-data', f'1 {a} 3 {b}', '--valid-data', b)
    text = ' '.join(r.output.split())
    assert r.exit_code == 0 and f'train data: {b} | weight 0.75 | 120 samples' in text, r.output
    assert f'valid data: {b} | whole | 32 samples' in text and 'test data' not in text


@pytest.mark.parametrize('args,message', [
    (['--data', '0.3 a 0.7'], "--data must be one PREFIX or weight-prefix pairs like '0.3 A 0.7 B' (positive weights); "
                              "3 items are not pairs"),
    (['--data', '0.3 a x b'], "weight 'x' is not a number"),
    (['--train-data', '1 a 0 b'], "--train-data must be one PREFIX or weight-prefix pairs"),
    (['--data', 'a', '--test-data', 'b'], '--data cannot be combined with data.train_prefix'),
    (['--valid-data', 'b'], '--train-data must be set when data.valid_prefix or data.test_prefix is'),
])
def test_bad_blends_name_the_flag(args, message):
    r = run('train', '--preset', 'tiny', *args, '--dry-run')
    assert r.exit_code == 2 and message in ' '.join(r.output.split()), r.output


def test_a_blend_trains_from_the_command_line(tiny_data, two_prefixes, tmp_path):
    a, b = two_prefixes
    r = run('train', '--data', f'0.5 {a} 0.5 {b}', '--tokenizer', tiny_data[1], '--out', str(tmp_path / 'r'),
            *sets(*TINY_SETS, 'train.iters=2'))
    assert r.exit_code == 0, r.output
    assert f'train data: {b} | weight 0.5 | 4 samples' in ' '.join(r.output.split())
    assert json.loads((tmp_path / 'r' / 'config.json').read_text())['data']['prefix'] == f'0.5 {a} 0.5 {b}'


def test_emit_slurm_prints_an_sbatch_script_that_bash_reads(tiny_data, tmp_path):
    import subprocess
    prefix, tok = tiny_data
    r = run('train', '--preset', 'tiny', '--data', prefix, '--tokenizer', tok, '--out', str(tmp_path / 'My Run'),
            '--nnodes', '2', '--nproc', '2', '--emit', 'slurm', '--max-restarts', '2')
    assert r.exit_code == 0, r.output
    script = tmp_path / 'job.sh'; script.write_text(r.stdout)
    assert subprocess.run(['bash', '-n', str(script)], capture_output=True).returncode == 0
    lines = r.stdout.splitlines()
    assert lines[0] == '#!/bin/bash' and '#SBATCH --nodes=2' in lines and '#SBATCH --gpus-per-node=2' in lines
    assert '#SBATCH --job-name=gptkit-my-run' in lines and '#SBATCH --signal=TERM@120' in lines
    srun = next(line for line in lines if line.startswith('srun torchrun'))
    assert '--nnodes "$SLURM_NNODES" --nproc_per_node 2 --max_restarts 2' in srun and srun.endswith('--resume')
    assert "--out '" + str(tmp_path / 'My Run') + "'" in srun               # quoted for the shell
    assert not any(o in srun for o in ('--emit', '--nproc ', '--node-rank', '--nnodes 2', '--max-restarts'))


def test_emit_k8s_prints_a_pytorchjob_with_the_right_replicas(tiny_data):
    import yaml
    prefix, tok = tiny_data
    common = ['train', '--preset', 'tiny', '--data', prefix, '--tokenizer', tok, '--out', 'runs/a', '--emit', 'k8s']
    r = run(*common, '--nnodes', '4', '--nproc', '1', '--image', 'registry.example/gptkit:1')
    assert r.exit_code == 0, r.output
    job = yaml.safe_load(r.stdout)
    assert (job['apiVersion'], job['kind'], job['metadata']['name']) == ('kubeflow.org/v1', 'PyTorchJob', 'gptkit-a')
    specs = job['spec']['pytorchReplicaSpecs']
    assert (specs['Master']['replicas'], specs['Worker']['replicas'], job['spec']['nprocPerNode']) == (1, 3, '1')
    container = specs['Worker']['template']['spec']['containers'][0]
    assert container['image'] == 'registry.example/gptkit:1' and container['command'][:4] == [
        'torchrun', '-m', 'gptkit_cli.main', 'train'] and container['command'][-1] == '--resume'
    assert container['resources']['limits']['nvidia.com/gpu'] == 1 and '--emit' not in container['command']
    assert 'Worker' not in yaml.safe_load(run(*common, '--image', 'x').stdout)['spec']['pytorchReplicaSpecs']
    r = run(*common)
    assert r.exit_code == 2 and '--image is needed with --emit k8s' in r.output


@pytest.mark.parametrize('args,said', [
    (['--nnodes', '2'], '--master-addr is needed with --nnodes above 1'),
    (['--nnodes', '2', '--node-rank', '2', '--master-addr', 'h'], '--node-rank must be from 0 to 1'),
    (['--nnodes', '0'], '--nnodes must be at least 1'),
    (['--nproc', '0'], '--nproc must be at least 1, not 0'),
    (['--hostfile', 'hosts'], "--hostfile is DeepSpeed's"),
    (['--hostfile', 'no-such-hosts', '--launcher', 'deepspeed'], '--hostfile no-such-hosts: no such file'),
    (['--emit', 'pbs'], '--emit must be slurm or k8s'),
    (['--master-port', '70000'], '--master-port must be a TCP port'),
    (['--max-restarts', '-1'], '--max-restarts must be 0 or more, not -1'),
    (['--max-restarts', '2', '--launcher', 'deepspeed'], "--max-restarts is torchrun's"),
    (['--watchdog-minutes', '0'], '--watchdog-minutes must be a positive number of minutes, not 0'),
])
def test_bad_launch_options_name_the_flag(args, said):
    r = run('train', '--preset', 'tiny', '--dry-run', *args)
    assert r.exit_code == 2 and said in ' '.join(r.output.split()), r.output


def test_multi_node_dry_run_hands_the_nodes_to_the_launcher(tmp_path):
    hosts = tmp_path / 'hosts'; hosts.write_text('node1 slots=2\nnode2 slots=2\n')
    r = run('train', '--preset', 'tiny', '--dry-run', '--nnodes', '2', '--node-rank', '1', '--nproc', '2',
            '--master-addr', '10.0.0.1', '--master-port', '6000')
    assert r.exit_code == 0, r.output
    shown = ' '.join(r.output.split())
    assert ('-m torch.distributed.run --nproc_per_node 2 --master_port 6000 --nnodes 2 --node_rank 1 '
            '--master_addr 10.0.0.1 -m gptkit_cli.main train') in shown and 'for 4 process(es)' in shown
    r = run('train', '--preset', 'tiny', '--dry-run', '--nnodes', '2', '--nproc', '2', '--launcher', 'deepspeed',
            '--hostfile', str(hosts))
    assert r.exit_code == 0 and f'--num_gpus 2 --master_port 29500 --hostfile {hosts} --module' in ' '.join(
        r.output.split()), r.output
    r = run('train', '--preset', 'tiny', '--dry-run', '--max-restarts', '3', '--master-port', '6000')
    assert r.exit_code == 0 and ('-m torch.distributed.run --nproc_per_node 1 --master_port 6000 --max_restarts 3 -m '
                                 'gptkit_cli.main train --preset tiny') in ' '.join(r.output.split()), r.output


@pytest.mark.parametrize('layout', [['--nproc', '2'], ['--tp', '2', '--pp', '2']])
def test_a_launched_run_checks_its_data_once_before_starting_any_process(tiny_data, tmp_path, layout):
    "Found by trying: each of 4 processes printed the same error, then torchrun printed its traceback"
    r = run('train', '--data', str(tmp_path / 'nothing'), '--tokenizer', tiny_data[1], '--out', str(tmp_path / 'r'),
            *sets(*TINY_SETS), *layout)
    said = ' '.join(r.output.split())
    assert r.exit_code == 1 and said.count('nothing.bin: no such file; data.prefix must name the PREFIX') == 1, r.output
    assert 'torch.distributed.run' not in said and not (tmp_path / 'r').exists()    # nothing was launched


RANK_SCRIPT = '''
import os, signal, sys, time
rank, what = int(os.environ['RANK']), sys.argv[1]
if rank == 1:
    if what == 'kill': os.kill(os.getpid(), signal.SIGKILL)
    if what == 'say': print('error: rank 1 cannot go on', file=sys.stderr); sys.exit(1)
    if what == 'quiet': sys.exit(3)
if what == 'say': print('error: rank 1 cannot go on', file=sys.stderr); time.sleep(0.5)  # the same line twice
time.sleep(30)
'''


@pytest.mark.parametrize('what, said', [
    ('kill', 'error: rank 1 was stopped by SIGKILL (the kernel kills with SIGKILL when memory runs out), so torchrun '
             'stopped the other processes'),
    ('say', 'error: rank 1 cannot go on'),
    ('quiet', 'error: rank 1 exited with code 3, so torchrun stopped the other processes')])
def test_a_failed_rank_is_one_line_without_torchruns_report(tmp_path, capfd, what, said):
    "torchrun's log lines, traceback and table of ranks are replaced by one line, or by nothing when a rank said why"
    import sys

    from gptkit.train.launch import run_launcher
    (tmp_path / 'rank.py').write_text(RANK_SCRIPT)
    code = run_launcher([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', '0',
                         str(tmp_path / 'rank.py'), what])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith('*') and 'OMP_NUM_THREADS' not in line]
    assert code != 0 and lines[0].startswith(said) and len(lines) == 1, err


TERM_SCRIPT = '''
import os, signal, sys, time
def save(sig, frame):
    time.sleep(0.5); print(f'rank {os.environ["RANK"]} saved', file=sys.stderr, flush=True); sys.exit(128 + sig)
signal.signal(signal.SIGTERM, save)
print('started', file=sys.stderr, flush=True)
time.sleep(60)
'''


def test_a_scheduler_sigterm_lets_the_processes_save_and_gives_143(tmp_path):
    """SIGTERM to the whole job (a scheduler's preemption): the launching process outlives its processes, which
    write to it while they save, and exits 143 without torchrun's SignalException traceback"""
    import os
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / 'rank.py').write_text(TERM_SCRIPT)
    launch = (f'import sys; from gptkit.train.launch import run_launcher; sys.exit(run_launcher([sys.executable, "-m", '
              f'"torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0", {str(tmp_path / "rank.py")!r}]))')
    p = subprocess.Popen([sys.executable, '-c', launch], stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = 0
    for line in p.stderr:                              # until both ranks are running (their writes to the one
        started += line.count('started')               # pipe may land on one line: 'startedstarted')
        if started == 2: break
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGTERM)
    err = p.stderr.read()
    assert p.wait(timeout=60) == 143 and 'rank 0 saved' in err and 'rank 1 saved' in err, err
    assert 'Traceback' not in err and 'SignalException' not in err, err


def test_the_process_group_is_left_at_exit_once_however_many_runs():
    import subprocess
    import sys
    code = ('from gptkit.train import launch\n'
            'launch.leave_group = lambda: print("left")\n'
            'for _ in range(3): launch.leave_group_at_exit()\n')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ['left'] and not r.stderr, r.stdout + r.stderr
