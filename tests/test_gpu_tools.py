"""tools/gpu: the scripts a session with a lent GPU runs (../shared/GPU.md) are right before they spend device time."""
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / 'tools' / 'gpu'))
from nb_cells import script  # noqa: E402


def test_notebook_cells_become_one_script_with_the_gpu_cells_and_without_nbdev():
    text = script(str(ROOT / 'nbs' / '09_kernels.fused.ipynb'))
    compile(text, '09_kernels.fused.py', 'exec')
    assert "device='cuda'" in text and 'print("cell 56c09800"' in text       # the gpu-flagged cell runs
    assert 'nbdev' not in text and text.startswith('from __future__ import annotations')


def test_the_check_script_parses_and_the_probe_runs_on_a_cpu():
    assert subprocess.run(['bash', '-n', str(ROOT / 'tools' / 'gpu' / 'check.sh')]).returncode == 0
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gpu' / 'probe.py'), '--preset', 'tiny', '--batch', '2',
                        '--new', '4', '--device', 'cpu'], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    sides = ('host: one-element add', 'decode tiny batch 1, gptkit:', 'decode tiny batch 1, transformers:',
             'train tiny ZeRO 0', 'train tiny ZeRO 1')
    for side in sides:
        assert side in r.stdout, r.stdout
