"""Hostile and careless input to the CLI, run as a user runs it: each case ends in one sentence naming the file, flag,
key or value (long values shortened), exit code 1 (2 for a setting), no traceback and no runaway memory.

Cases that could eat the machine on a regression (an alias bomb, /dev/zero, a FIFO, a huge size) run `gptkit` as a
real process under a 3 GiB address-space limit and a timeout, so they fail fast instead."""
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import TINY_SETS
from gptkit_cli.main import app

GPTKIT = str(Path(sys.executable).with_name('gptkit'))
MEMORY = 3 * 2**30          # a dry run needs well under 2 GiB of address space
LAUGHS = ''.join(f'{c}: &{c} [{", ".join([f"*{p}" if p else "lol"] * 9)}]\n'
                 for p, c in zip(['', *'abcdefgh'], 'abcdefghi'))   # 9^9 values in nine lines


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, ' '.join(r.output.split()), r


def gptkit(*args, timeout: float = 60, cwd=None):
    "`gptkit ARGS` as a process under a memory limit: (exit code, output on one line)"
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    r = subprocess.run([GPTKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout, preexec_fn=limit,
                       cwd=cwd, env={**os.environ, 'COLUMNS': '200'}, stdin=subprocess.DEVNULL)
    return r.returncode, ' '.join((r.stdout + r.stderr).split())


def one_sentence(output: str):
    assert 'Traceback' not in output and 'Error:' not in output and len(output) < 2000, output[:3000]


# Configs: bounded reads, bounded aliases, bounded sizes, values shortened and attributed to where they came from

def test_a_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path):
    (tmp_path / 'bomb.yaml').write_text(LAUGHS + 'model: {layers: *i}\n')
    code, out = gptkit('train', '--config', tmp_path / 'bomb.yaml', '--dry-run')
    assert code == 2 and (f'error: --config file {tmp_path / "bomb.yaml"} stands for more than 10,000 values or 32 '
                          'levels, counting each value its aliases repeat') in out, out
    one_sentence(out)


def test_a_yaml_alias_bomb_in_a_set_value_is_refused():
    bomb = '{' + LAUGHS.replace('\n', ', ') + '}'
    code, out = gptkit('train', '--set', f'model.layers={bomb}', '--dry-run')
    assert code == 2 and "error: --set 'model.layers={a: &a [lol, lol, lol" in out, out
    assert 'characters) stands for more than 10,000 values' in out
    one_sentence(out)


def test_a_config_of_half_a_million_values_is_refused_while_it_is_read(tmp_path):
    (tmp_path / 'many.yaml').write_text('model: {layers: [' + ','.join(['1'] * 500_000) + ']}\n')   # under a MiB
    code, out = gptkit('train', '--config', tmp_path / 'many.yaml', '--dry-run', timeout=30)
    assert code == 2 and 'many.yaml stands for more than 10,000 values' in out, out[:3000]
    one_sentence(out)


def test_a_recursive_alias_is_refused(tmp_path):
    (tmp_path / 'loop.yaml').write_text('model: &m\n  layers: 2\n  more: *m\n')
    code, out, _ = run('train', '--config', tmp_path / 'loop.yaml', '--dry-run')
    assert code == 2 and 'counting each value its aliases repeat' in out, out


def test_a_few_aliases_still_work(tmp_path):
    (tmp_path / 'ok.yaml').write_text('model: &m {layers: 2, hidden: 64, heads: 2, seq_len: 32}\n'
                                      'optim: {lr: &lr 0.002, min_lr: *lr}\n')
    code, out, r = run('train', '--config', tmp_path / 'ok.yaml', '--dry-run')
    assert code == 0 and '"min_lr": 0.002' in out, out


@pytest.mark.parametrize('target', ['/dev/zero', 'fifo', 'folder'])
def test_a_config_that_is_not_a_regular_file_is_refused_unread(tmp_path, target):
    path = {'/dev/zero': Path('/dev/zero'), 'fifo': tmp_path / 'run.yaml', 'folder': tmp_path}[target]
    if target == 'fifo':
        os.mkfifo(path)                 # reading it would wait for a writer forever
    code, out = gptkit('train', '--config', path, '--dry-run', timeout=30)
    why = 'is a folder, not a file' if target == 'folder' else 'is not a regular file (a device, pipe or socket'
    assert code == 2 and f'error: --config {path} {why}' in out, out
    one_sentence(out)


def test_a_config_over_a_mebibyte_is_refused_before_reading(tmp_path):
    (tmp_path / 'big.yaml').write_text('model:\n  activation: ' + 'x' * (3 * 2**20) + '\n')
    code, out = gptkit('train', '--config', tmp_path / 'big.yaml', '--dry-run')
    assert code == 2 and f'--config {tmp_path / "big.yaml"} holds 3.0 MiB, more than the 1.0 MiB read' in out, out
    one_sentence(out)


def test_a_long_value_is_shortened_and_named_with_its_file_and_line(tmp_path):
    (tmp_path / 'long.yaml').write_text('model:\n  layers: 2\n  activation: ' + 'x' * 500_000 + '\n')
    code, out, _ = run('train', '--config', tmp_path / 'long.yaml', '--dry-run')
    assert code == 2 and (f"error: model.activation ({tmp_path / 'long.yaml'}, line 3) must be one of gelu, gelu_tanh, "
                          f"swiglu, not '{'x' * 59}... (500,002 characters)") in out, out
    assert '--set' not in out          # it came from the file, not from an override
    one_sentence(out)


def test_a_set_value_wins_over_the_file_and_is_named_as_set(tmp_path):
    (tmp_path / 'run.yaml').write_text('model:\n  layers: 5\n')
    code, out, _ = run('train', '--config', tmp_path / 'run.yaml', '--set', 'model.layers=0', '--dry-run')
    assert code == 2 and 'error: --set model.layers must be a positive whole number, not 0' in out, out


@pytest.mark.parametrize('args,message', [
    (['train', '--set', 'model.layers=99999999999999999999999', '--dry-run'],
     'error: --set model.layers must be at most 10,000, not 99999999999999999999999'),
    (['train', '--set', 'model.layers=1000000', '--dry-run'], 'error: --set model.layers must be at most 10,000'),
    (['train', '--set', 'model.hidden=10000000000', '--set', 'model.heads=2', '--dry-run'],
     'error: --set model.hidden must be at most 1,000,000'),
    (['train', '--iters', '10000000000000', '--dry-run'], 'error: --iters must be at most 1,000,000,000'),
    (['train', '--set', 'model.layers=' + '9' * 5000, '--dry-run'],
     "error: --set model.layers must be a positive whole number, not '" + '9' * 59 + '... (5,002 characters)'),
    (['estimate', '--preset', '125m', '--layers', '99999999999999999999999'], 'error: --layers must be at most 10,000'),
])
def test_sizes_are_bounded_before_anything_is_sized(args, message):
    code, out = gptkit(*args, timeout=30)
    assert code == 2 and message in out, out
    one_sentence(out)


def test_a_value_with_braces_is_quoted_not_formatted():
    code, out, _ = run('train', '--set', 'model.layers={a: 1}', '--set', 'model.activation={x}', '--dry-run')
    assert code == 2 and ("--set model.layers must be a positive whole number, not {'a': 1}; --set model.activation "
                          "must be one of gelu, gelu_tanh, swiglu, not {'x': None}") in out, out


def test_deepspeed_config_reads_are_bounded():
    code, out = gptkit('train', '--deepspeed-config', '/dev/zero', '--dry-run', timeout=30)
    assert code == 2 and 'error: --deepspeed-config /dev/zero is not a regular file' in out, out


def test_a_prompt_file_that_is_not_a_regular_file_is_refused_unread(tmp_path):
    code, out = gptkit('generate', '--checkpoint', tmp_path, '--prompt-file', '/dev/zero', timeout=30)
    assert code == 2 and 'error: --prompt-file /dev/zero is not a regular file' in out, out
    os.mkfifo(tmp_path / 'prompts.txt')
    code, out = gptkit('generate', '--checkpoint', tmp_path, '--prompt-file', tmp_path / 'prompts.txt', timeout=30)
    assert code == 2 and f'error: --prompt-file {tmp_path / "prompts.txt"} is not a regular file' in out, out


# User text inside rich markup is shown as it is

@pytest.mark.parametrize('args,shown', [
    (['generate', '--checkpoint', 'nope[/]', '--prompt', 'x'], 'checkpoint path nope[/] does not exist'),
    (['generate', '--checkpoint', 'nope[bold]x', '--prompt', 'x'], 'checkpoint path nope[bold]x does not exist'),
    (['eval', '--checkpoint', 'nope[/]'], 'checkpoint path nope[/] does not exist'),
    (['checkpoint', 'inspect', 'nope[/]'], 'nope[/] does not exist'),
    (['data', 'prepare', '--input', 'in[/x].txt', '--output-prefix', 'o'], 'in[/x].txt'),
    (['tokenizer', 'info', '--tokenizer', 'tok[/]'], 'tok[/]'),
])
def test_markup_in_a_path_is_shown_literally(args, shown):
    code, out, r = run(*args)
    assert code in (1, 2) and 'error:' in out and shown in out, out
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), repr(r.exception)


def test_markup_in_the_run_folder_is_shown_literally_in_the_summary(tmp_path):
    for name in ('r[/]', 'r[bold]x'):
        code, out, r = run('train', *[a for s in TINY_SETS for a in ('--set', s)], '--out', tmp_path / name,
                           '--dry-run')
        assert code == 0 and f'| out {tmp_path / name}' in out, (out, r.exception)
        assert 'train --set model.layers=2' in out


def test_markup_in_a_prompt_and_a_text_path_is_shown_literally(tiny_checkpoint, tmp_path):
    code, out, r = run('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'The [/] and [bold]king',
                       '--max-new-tokens', '2', '--greedy')
    assert code == 0 and 'The [/] and [bold]king' in out, (out, r.exception)
    text = tmp_path / 'held[bold]out.txt'
    text.write_text('In the beginning God created the heaven and the earth. ' * 20)
    code, out = gptkit('eval', '--checkpoint', tiny_checkpoint, '--text', text, '--device', 'cpu')   # a wide table
    assert code == 0 and str(text) in out, out


def test_control_characters_in_names_reach_no_terminal(tiny_checkpoint, tmp_path):
    "A name holding ESC ] 0 ; (retitle) or ESC [ 2 J (clear screen) is shown as \\x1b..., in errors and in tables"
    import shutil
    hostile = 'nope\x1b]0;PWN\x07\x1b[2J'
    code, out = gptkit('checkpoint', 'inspect', tmp_path / hostile)
    assert code == 1 and '\x1b' not in out and '\x07' not in out, repr(out)
    assert 'nope\\x1b]0;PWN\\x07\\x1b[2J does not exist' in out, out
    run_dir = tmp_path / f'run{hostile}'
    shutil.copytree(tiny_checkpoint, run_dir)
    code, out = gptkit('checkpoint', 'inspect', run_dir)
    assert code == 0 and '\x1b' not in out and 'run' + 'nope\\x1b]0;PWN' in out.replace(' ', ''), repr(out)


def test_markup_in_checkpoint_paths_is_shown_literally(tiny_checkpoint, tmp_path):
    "inspect, export, import and reshard print the folders they read and write as they are named"
    import shutil
    run_dir = tmp_path / 'run[/]a'
    shutil.copytree(tiny_checkpoint, run_dir)
    code, out, r = run('checkpoint', 'inspect', run_dir)
    assert code == 0 and str(run_dir) in out, (out, r.exception)
    hf = tmp_path / 'hf[bold]b'
    code, out, r = run('checkpoint', 'export', run_dir, hf, '--to', 'hf')
    assert code == 0 and f'exported {run_dir} to {hf}' in out, (out, r.exception)
    back = tmp_path / 'back[/]c'
    code, out, r = run('checkpoint', 'import', hf, back, '--from', 'hf')
    assert code == 0 and f'imported {hf} into {back}' in out, (out, r.exception)
    split = tmp_path / 'tp[/x]d'
    code, out, r = run('checkpoint', 'reshard', run_dir, split, '--tp', '2')
    assert code == 0 and f'resharded {run_dir} into {split}' in out, (out, r.exception)


# Outputs that cannot be written: one sentence naming the option and the path. The tests run as root, whom file
# permissions do not stop, so these use what stops root too: sysfs refuses new entries (EPERM), a file in the way
# (ENOTDIR), and an output file name taken by a folder (EISDIR).

SYS = Path('/sys/gptkit-cannot-write-here')
needs_sysfs = pytest.mark.skipif(not Path('/sys/kernel').is_dir(), reason='needs Linux sysfs, which refuses mkdir')


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / 'corpus.txt'
    f.write_text('the king said unto the people, and the people said unto the king\n' * 200)
    return f


@needs_sysfs
def test_tokenizer_train_into_an_unwritable_folder(corpus):
    code, out = gptkit('tokenizer', 'train', '--input', corpus, '--output', SYS, '--vocab-size', '300',
                       '--held-out', corpus)
    assert code == 1 and f'error: --output {SYS}: Operation not permitted' in out, out
    one_sentence(out)


def test_tokenizer_train_onto_a_folder_where_a_file_goes(corpus, tmp_path):
    (tmp_path / 'tok' / 'vocab.json').mkdir(parents=True)
    code, out, r = run('tokenizer', 'train', '--input', corpus, '--output', tmp_path / 'tok', '--vocab-size', '300',
                       '--held-out', corpus)
    tok = tmp_path / 'tok'
    assert code == 1 and f'error: --output {tok}: {tok / "vocab.json"}: Is a directory' in out, (out, r.exception)


@needs_sysfs
def test_data_prepare_into_an_unwritable_folder(corpus, tiny_data):
    code, out, r = run('data', 'prepare', '--input', corpus, '--output-prefix', SYS / 'corpus', '--tokenizer',
                       tiny_data[1])
    # the dataset's lock is taken before any work (exit 2), or the CLI's handler names it (exit 1): one sentence
    assert code in (1, 2) and f'error: --output-prefix {SYS / "corpus"}' in out and 'Operation not permitted' in out, \
        (out, r.exception)
    one_sentence(out)


@needs_sysfs
def test_train_into_an_unwritable_run_folder(tiny_data):
    code, out, r = run('train', *[a for s in TINY_SETS for a in ('--set', s)], '--data', tiny_data[0], '--tokenizer',
                       tiny_data[1], '--out', SYS / 'run')
    # train checks --out itself before any work (exit 2), or the CLI's handler names it (exit 1): one sentence either way
    assert code in (1, 2) and f'error: --out {SYS / "run"}' in out and 'Operation not permitted' in out, \
        (out, r.exception)
    one_sentence(out)


@needs_sysfs
def test_checkpoint_export_into_an_unwritable_folder(tiny_checkpoint):
    code, out, r = run('checkpoint', 'export', tiny_checkpoint, SYS / 'hf', '--to', 'hf')
    assert code in (1, 2) and f'{SYS / "hf"}' in out and 'Operation not permitted' in out, (out, r.exception)
    one_sentence(out)       # today: 'error: OUT /sys/...-here/hf: /sys/...-here: Operation not permitted'
