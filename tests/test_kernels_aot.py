"""Every Triton kernel compiled ahead of time for A100 (sm_80) and H100 (sm_90) with Triton's own compiler and ptxas:
no GPU takes part. A kernel that does not compile fails here."""
import subprocess
import sys
import textwrap

import pytest

from gptkit.kernels import fused as K, aot as A, moe as M, qk as Q


def test_the_argument_table_describes_every_kernel():
    "KERNEL_ARGS and the kernels agree: every Triton kernel of both modules is listed, one type per runtime argument"
    jitted = {name for m in (K, Q, M) for name, v in vars(m).items()                  # kernels take pointers; helpers not
              if any(a.endswith('_ptr') for a in getattr(v, 'arg_names', ()))}
    assert {'_rotary', '_qk_norm_rotary_fwd', '_qk_norm_rotary_bwd'} <= jitted and '_qk_tile' not in jitted
    assert jitted == set(A.KERNEL_ARGS)
    for config in A.kernel_configs(('bf16',)):
        names = A.kernel_function(config.kernel).arg_names
        sig, _ = config.signature(names)
        assert list(sig) == names and sum(t == 'constexpr' for t in sig.values()) == len(config.constexprs), config
    assert {c.kernel for c in A.kernel_configs()} == set(A.KERNEL_ARGS)


def test_the_configurations_are_the_ones_the_launchers_pick():
    assert K.norm_launch(48) == (128, 1) and K.norm_launch(768) == (1024, 4) and K.norm_launch(12288) == (16384, 8)
    assert K.rotary_block(32) == 32 and K.rotary_block(3) == 16
    blocks = {dict(c.constexprs)['BLOCK'] for c in A.kernel_configs() if c.kernel == '_layer_norm_fwd'}
    assert blocks == {K.norm_launch(h)[0] for h in range(1, K.NORM_MAX_COLUMNS + 1, 7)} | {K.NORM_MAX_COLUMNS}
    # the fused QK-norm + rotary: each head size up to 256 gets one of the compiled (ROWS, BLOCK) tiles
    tiles = {(dict(c.constexprs)['ROWS'], dict(c.constexprs)['BLOCK']) for c in A.kernel_configs()
             if c.kernel.startswith('_qk_norm_rotary')}
    assert tiles == {(Q.qk_rows(d // 2), K.rotary_block(d // 2)) for d in range(2, 2 * K.ROTARY_MAX_HALF + 1, 2)}
    assert Q.qk_rows(64) == 16 and (Q.qk_rows(64), K.rotary_block(64)) in tiles        # Qwen3's head_dim 128


def check(compiled, configs, stack_slot: int = 0):
    "`stack_slot`: bytes of stack frame allowed elsewhere (fp16 RMSNorm backward at 2,048 columns on sm_80 keeps 8)"
    assert len(compiled) == 2 * len(configs) and {c.arch for c in compiled} == {80, 90}
    for c in compiled:
        assert 0 < c.registers <= 255 and c.spill_bytes >= 0 and c.shared_bytes >= 0, c
        # measured: only the norm backward programs over 16,384-column rows (GPT-3 175B) run out of registers
        wide = c.config.kernel.endswith('_norm_bwd') and dict(c.config.constexprs)['BLOCK'] == 16384
        assert wide or c.spill_bytes <= stack_slot, c


def test_every_configuration_compiles_in_bf16_for_sm80_and_sm90():
    configs = A.kernel_configs(('bf16',))
    check(A.compile_all(configs), configs)


def test_every_configuration_compiles_in_fp32_and_fp16(request):
    "Flagged slow (twice the bf16 test's compilations): pytest --nb-flags slow"
    if 'slow' not in request.config.getoption('--nb-flags').split(): pytest.skip('slow: run with --nb-flags slow')
    configs = A.kernel_configs(('fp32', 'fp16'))
    check(A.compile_all(configs), configs, stack_slot=8)


def test_a_kernel_that_does_not_compile_fails_with_its_name(tmp_path):
    "The control: a kernel whose block is not a power of two (Triton refuses tl.arange over it) fails, saying which"
    (tmp_path / 'broken.py').write_text(textwrap.dedent('''
        import triton, triton.language as tl
        from gptkit.kernels import fused as K, aot as A

        @triton.jit
        def _broken(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

        K._broken, A.KERNEL_ARGS['_broken'] = _broken, ('x', 'i32')
        A.compile_kernel(A.KernelConfig('_broken', 'bf16', (('BLOCK', 128),)), 80)     # compiles
        import io, json, sys
        sys.stdin = io.StringIO(json.dumps([[{'kernel': '_broken', 'dtype': 'bf16', 'constexprs': [['BLOCK', 100]],
                                             'num_warps': 4}, 80]]))
        A._compile_worker()                                                             # does not
    '''))
    env = {k: v for k, v in __import__('os').environ.items() if k != 'TRITON_INTERPRET'}
    r = subprocess.run([sys.executable, str(tmp_path / 'broken.py')], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert '_broken[bf16, BLOCK=100, warps=4] does not compile for sm_80' in r.stderr, r.stderr[-3000:]
    assert 'BLOCK=128' not in r.stderr.replace('BLOCK=100', ''), r.stderr[-3000:]
