"""`gptkit doctor`: on this CPU it runs what applies and says what it skipped; its kernel checks catch a wrong kernel."""
import json
import os
import subprocess
import sys
import textwrap

from conftest import run_here


def test_doctor_on_a_cpu_trains_and_says_what_it_skipped():
    r = run_here('doctor', '--json', '--steps', '2')
    assert r.returncode == 0, r.stdout + r.stderr
    checks = {c['name']: c for c in json.loads(r.stdout)['checks']}
    assert checks['torch']['status'] == 'ok' and checks['deepspeed']['status'] == 'ok'
    assert checks['train']['status'] == 'ok' and checks['train TFLOP/s']['value'] > 0
    for name in ('cuda', 'nccl', 'kernels', 'all-reduce', 'train MFU'):
        assert checks[name]['status'] == 'skipped' and checks[name]['detail'], checks[name]


def test_kernel_checks_pass_in_the_interpreter_and_fail_a_wrong_kernel(tmp_path):
    script = tmp_path / 'kernels.py'
    script.write_text(textwrap.dedent('''
        from gptkit.kernels import fused as K
        from gptkit.diagnose.doctor import kernel_checks
        checks = kernel_checks('cpu', tokens=32, hidden=64)
        assert len(checks) == 6 and all(c.status == 'ok' for c in checks), checks
        right = K.rms_norm
        K.rms_norm = lambda x, w, eps=1e-5: right(x, w, eps) * 1.01        # a kernel 1% off
        bad = {c.name: c.status for c in kernel_checks('cpu', tokens=32, hidden=64)}
        assert bad['kernel RMSNorm'] == 'failed' and bad['kernel LayerNorm'] == 'ok', bad
        print('checked')
    '''))
    env = {**os.environ, 'TRITON_INTERPRET': '1'}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and 'checked' in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
