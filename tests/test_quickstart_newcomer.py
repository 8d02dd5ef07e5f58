"""The quickstart as a newcomer meets it (issue 51 item 4): a stop signal in any phase ends it with one line and
128 + the signal, the held-out evaluation shows its progress in a log, and the steps are sized to the machine."""
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gptkit_cli.quickstart as q
from gptkit_cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def quick_data(tiny_data, out: Path):
    "What the data phase leaves in `out`, from the tests' KJV dataset (512-entry tokenizer), in seconds"
    prefix, tok = tiny_data
    shutil.copytree(tok, out / 'tokenizer')
    (out / 'data').mkdir(parents=True)
    for ext in ('.bin', '.idx'):
        shutil.copy(prefix + ext, out / 'data' / f'corpus_text_document{ext}')


def invoke(*args):
    r = CliRunner().invoke(app, ['quickstart', *map(str, args)])
    return r, r.stdout, r.stderr


def assert_one_line_stop(r, stderr, code, phase):
    assert r.exit_code == code, (r.exit_code, r.stdout, stderr, r.exception)
    assert 'Traceback' not in r.stdout + stderr and 'Aborted' not in stderr
    lines = [l for l in stderr.splitlines() if l.startswith('stopped by')]
    assert len(lines) == 1 and phase in lines[0] and f'(exit {code})' in lines[0], stderr
    return lines[0]


def raise_interrupt(*a, **k):
    raise KeyboardInterrupt


def test_ctrl_c_while_making_the_tokenizer_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(q, '_data_stage', raise_interrupt)
    r, _, err = invoke('--out', tmp_path / 'qs')
    line = assert_one_line_stop(r, err, 130, '1-2. the tokenizer and the dataset')
    assert line.endswith('kept: nothing (exit 130)')


@pytest.mark.parametrize('stage,phase', [('_estimate_stage', '5-8. sizing real runs'),
                                         ('_sample_stage', '9. the sample')])
def test_ctrl_c_after_training_says_what_was_kept(tmp_path, monkeypatch, stage, phase):
    def trained(out_dir, iters, preset, precision, where, start):
        where.kept['the checkpoint'] = f'{out_dir}/run/checkpoints/iter_0000012 (step 12)'
        return 5.0, 7.0
    monkeypatch.setattr(q, '_data_stage', lambda *a: None)
    monkeypatch.setattr(q, '_train_stage', trained)
    if stage == '_sample_stage':
        monkeypatch.setattr(q, '_estimate_stage', lambda: None)
    monkeypatch.setattr(q, stage, raise_interrupt)
    r, _, err = invoke('--out', tmp_path / 'qs', '--iters', 12)
    line = assert_one_line_stop(r, err, 130, phase)
    assert 'the tokenizer in' in line and 'the dataset in' in line and 'iter_0000012 (step 12)' in line


class SignalAt(q.RichProgress):
    "The progress bar, with `signum` sent to this process after optimizer step `at` (a user's Ctrl-C, a kill)"
    signum, at = signal.SIGINT, 2

    def on_train_step(self, iteration):
        if iteration == self.at:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize('signum,code', [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_the_first_evaluation_saves_and_ends_in_one_line(tiny_data, tmp_path, monkeypatch, signum,
                                                                         code):
    "The issue's case: stopped before any evaluation (valid_loss None), it said TypeError after the held-out text"
    monkeypatch.setattr(q, '_data_stage', lambda out_dir, vocab: quick_data(tiny_data, out_dir))
    monkeypatch.setattr(SignalAt, 'signum', signum)
    monkeypatch.setattr(q, 'RichProgress', SignalAt)
    r, out, err = invoke('--out', tmp_path / 'qs', '--iters', 30, '--precision', 'fp32')
    line = assert_one_line_stop(r, err, code, '3. training')
    step = int(re.search(r'iter_(\d{7}) \(step (\d+)\)', line).group(2))     # the step the signal came in, or the next
    assert step in (2, 3) and (tmp_path / 'qs' / 'run' / 'checkpoints' / f'iter_{step:07d}').is_dir()
    assert 'held-out' not in out                  # nothing after the stop


def test_ctrl_c_in_the_held_out_evaluation(tiny_data, tmp_path, monkeypatch):
    import gptkit.eval.perplexity
    monkeypatch.setattr(q, '_data_stage', lambda out_dir, vocab: quick_data(tiny_data, out_dir))
    monkeypatch.setattr(gptkit.eval.perplexity, 'text_loss', raise_interrupt)
    r, _, err = invoke('--out', tmp_path / 'qs', '--iters', 2, '--precision', 'fp32')
    line = assert_one_line_stop(r, err, 130, '4. the held-out evaluation')
    assert 'iter_0000002 (step 2)' in line


def test_sigterm_outside_training_ends_in_one_line(tmp_path):
    "In a process of its own: before the fix SIGTERM outside training killed the process with no word"
    script = ('import os, signal, sys\n'
              'import gptkit_cli.quickstart as q\n'
              'from gptkit_cli.main import app\n'
              'q._data_stage = lambda *a: os.kill(os.getpid(), signal.SIGTERM)\n'
              f'sys.argv = ["gptkit", "quickstart", "--out", {str(tmp_path / "qs")!r}]\n'
              'app()\n')
    r = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 143, (r.returncode, r.stdout, r.stderr)
    assert 'Traceback' not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith('stopped by SIGTERM during 1-2. the tokenizer and the dataset')


def test_the_held_out_evaluation_shows_progress_in_a_log(tiny_checkpoint, capsys):
    "Not a terminal: whole lines with the count, the rate and the ETA, about every tenth of the way"
    from gptkit.eval.perplexity import text_loss
    from gptkit.inference.generator import load_model
    model = load_model(tiny_checkpoint).model
    tokens = list(range(1, 500)) * 9                        # 4,491 tokens: 70 windows of 64
    loss = q._held_out_loss(model, tokens, 64, q.Where())
    assert loss == pytest.approx(text_loss(model, tokens, 64), rel=1e-6)
    lines = [l for l in capsys.readouterr().out.splitlines() if 'held-out' in l]
    assert 5 <= len(lines) <= 11, lines
    assert lines[-1].startswith('   held-out: 70/70 windows, ') and 'tokens/s' in lines[-1] and 'ETA 0.0 s' in lines[-1]
    assert all(' windows, ' in l and ' tokens/s, ' in l and ' ETA ' in l for l in lines)


def test_the_budget_gives_a_slow_machine_fewer_steps_and_a_fast_one_the_default():
    assert q.fit_iters(0.01, 170.0) == q.DEFAULT_ITERS == 1700       # 17,000 steps would fit: the preset's 1,700
    assert q.fit_iters(0.2, 100.0, warm=5) == 505                      # 5 warm-up steps, then 100 s at 0.2 s
    assert q.fit_iters(5.0, 100.0) == q.MIN_ITERS                      # the margin's floor, however slow
    assert q.fit_iters(0.2, -30.0) == q.MIN_ITERS                      # the data phase took the whole budget
    tokens = [10_000] * 30
    assert q.held_out_articles(0.05, tokens, 1024) == q.HELD_OUT_ARTICLES   # 24 articles: 3.9 s
    assert q.held_out_articles(5.0, tokens, 1024) == 1                 # one article (16 s) where 2 would take 33 s
    assert q.after_training_seconds(3.0, 10.0, 4.0) == pytest.approx(4.0 + 16 + 10.0 + q.AFTER_SECONDS)


@pytest.mark.parametrize('fake_step,iters', [(1000.0, 7), (1e-6, 9)])
def test_the_steps_are_chosen_from_the_measured_step_time(tiny_data, tmp_path, monkeypatch, capsys, fake_step, iters):
    "Without --iters: 5 timed warm-up steps, then as many as fit (a slow machine: the floor, 7 here; a fast: the most)"
    quick_data(tiny_data, tmp_path)
    monkeypatch.setattr(q.StepClock, 'step_seconds', lambda self: fake_step)
    monkeypatch.setattr(q, 'MIN_ITERS', 7)
    monkeypatch.setattr(q, 'DEFAULT_ITERS', 9)
    monkeypatch.setattr(q, 'HELD_OUT_ARTICLES', 2)
    where = q.Where()
    q._train_stage(tmp_path, None, 'tiny', 'fp32', where)
    out = ' '.join(capsys.readouterr().out.split())
    assert where.iters == iters and f'{q.WARMUP_STEPS} warm-up steps took {fake_step:.3f} s a step here' in out
    assert f'{iters:,} steps in all' in out and f'trained {iters:,} steps in' in out
    assert (tmp_path / 'run' / 'checkpoints' / f'iter_{iters:07d}').is_dir()
    assert ('articles' in out) and (('the first 1 articles' in out) == (fake_step > 1))
