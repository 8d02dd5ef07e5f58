"Issue 35: the CPU's precision and decode layout chosen by measuring, on both sides of each decision"
import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_SETS, run_here
from gptkit.config.sections import ModelConfig
from gptkit.inference.decode import (DECODE_FORMS, HUGE_CREDIT, MKL_ROWS, DecodeChoice, decode_choice, decode_layout,
                                     measure_decode, mkl_packed, packed_weight)
from gptkit.inference.generator import Generator
from gptkit.machine import choices, pages
from gptkit.machine.choices import (ATTENTION_GAIN, BF16_GAIN, choose_attention, choose_precision, precision_reason,
                                    settle_precision)
from gptkit.machine.cpu import CPU, ISA_ENV, parse_cpuinfo, this_cpu
from gptkit.machine.pages import HUGE_PAGE, huge_copies, huge_pages_allowed, keep_freed_memory
from gptkit.machine.timings import CACHE_ENV, Measured
from gptkit.model.decoder import GPT
from gptkit.train.plan import RunPlan, plan_run, run_config
from gptkit.config.run import resolve

# seconds of the same products, as the two machine classes measured them (bf16 emulated; AMX tiles)
NO_BF16 = {'fp32': 0.010, 'bf16': 0.190}
AMX = {'fp32': 0.010, 'bf16': 0.0012}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    "gptkit's measurement cache in a folder of this test's own"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / 'cache'))
    return tmp_path / 'cache' / 'machine.json'


AMX_CPU = CPU('Test Xeon', frozenset({'avx2', 'avx512f', 'avx512_bf16', 'amx_bf16'}))


@pytest.fixture(autouse=True)
def bf16_cpu(monkeypatch, pin_cpu):
    """These tests decide on a CPU with bf16 instructions (an AMX Xeon), whatever this machine's: without them bf16 is
    never chosen and nothing is measured (tests/test_machine_noise.py)"""
    pin_cpu(AMX_CPU)
    for var in ISA_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def unlimited(monkeypatch):
    "No setting that limits the kernels (a suite run with ONEDNN_MAX_CPU_ISA set, to stand for another class, has one)"
    for var in ISA_ENV:
        monkeypatch.delenv(var, raising=False)


# seconds of a bf16 run's attention, forward and backward, computed in bf16 and in fp32 (as on the AMX Xeon; as where
# bf16 attention kernels are fast)
ATTENTION_SLOW_BF16 = {'bf16': 0.0050, 'fp32': 0.0036}
ATTENTION_FAST_BF16 = {'bf16': 0.0030, 'fp32': 0.0032}


def as_measured(monkeypatch, seconds, attention=ATTENTION_SLOW_BF16):
    "Make every training measurement report `seconds` (products) and `attention`, as a machine of that class would"
    monkeypatch.setattr(choices, 'product_seconds', lambda shapes, rounds=5: dict(seconds))
    monkeypatch.setattr(choices, 'attention_seconds', lambda shapes, rounds=5: dict(attention))


def test_the_cpu_features_and_class_come_from_cpuinfo(unlimited):
    xeon = parse_cpuinfo('model name\t: Intel Xeon\nflags\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n')
    old = parse_cpuinfo('model name\t: Old\nflags\t: sse2 avx avx2\n')
    assert (xeon.machine_class, old.machine_class) == ('AMX', 'AVX2')
    assert xeon.summary() == ('CPU Intel Xeon: AVX2 yes, AVX-512 yes, AVX-512-bf16 yes, AMX yes '
                              '(machine class AMX)')
    assert 'AVX-512-bf16 no' in old.summary()
    assert this_cpu().name and this_cpu().summary().startswith('CPU ')


@pytest.mark.parametrize('seconds, precision', [(NO_BF16, 'fp32'), (AMX, 'bf16')])
def test_auto_takes_bf16_only_where_it_measured_clearly_faster(cache, monkeypatch, seconds, precision):
    as_measured(monkeypatch, seconds)
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=auto', 'train.micro_batch=4']))
    assert cfg.train.precision == precision
    assert f'-> {precision}' in why and 'measured now' in why and this_cpu().name in why
    assert choose_precision(BF16_GAIN) == 'bf16' and choose_precision(BF16_GAIN - 0.01) == 'fp32'


def test_an_explicit_precision_always_wins(cache, monkeypatch):
    as_measured(monkeypatch, AMX)
    for p in ('fp32', 'bf16'):
        for a in ('fp32', 'same'):
            cfg = resolve('tiny', sets=[f'train.precision={p}', f'train.attention_precision={a}'])
            assert settle_precision(cfg) == (cfg, None)
    assert not cache.exists()                       # nothing was measured


@pytest.mark.parametrize('seconds, chosen', [(ATTENTION_SLOW_BF16, 'fp32'), (ATTENTION_FAST_BF16, 'same')])
def test_a_bf16_runs_attention_is_computed_in_fp32_only_where_measured_faster(cache, monkeypatch, seconds, chosen):
    as_measured(monkeypatch, AMX, seconds)
    for sets in (['train.precision=auto'], ['train.precision=bf16']):
        cfg, why = settle_precision(resolve('tiny', sets=sets + ['train.micro_batch=4']))
        assert (cfg.train.precision, cfg.train.attention_precision) == ('bf16', chosen)
        assert f'attention_precision auto -> {chosen}' in why
        assert f"{seconds['bf16'] / seconds['fp32']:.2f}x as fast in fp32" in why
    assert choose_attention(ATTENTION_GAIN) == 'fp32'
    assert choose_attention(ATTENTION_GAIN - 0.01) == 'same'


def test_an_fp32_run_measures_no_attention(cache, monkeypatch):
    as_measured(monkeypatch, NO_BF16)
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=auto']))
    assert (cfg.train.precision, cfg.train.attention_precision) == ('fp32', 'same')
    assert 'attention' not in why
    assert [e['kind'] for e in json.loads(cache.read_text()).values()] == ['train']


def test_the_attention_measurement_is_real_and_decides_consistently(cache):
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=bf16', 'train.micro_batch=4']))
    if 'untrusted' in why:                          # this machine was too busy: bf16 kept, and nothing cached
        assert cfg.train.attention_precision == 'same' and not cache.exists()
        return
    (m,) = [e['seconds'] for e in json.loads(cache.read_text()).values() if e['kind'] == 'attention']
    assert set(m) == {'bf16', 'fp32'} and all(v > 0 for v in m.values())
    assert cfg.train.attention_precision == choose_attention(m['bf16'] / m['fp32'])
    assert f"{m['bf16'] / m['fp32']:.2f}x" in why


@pytest.mark.parametrize('saved, kept', [({'precision': 'bf16', 'attention_precision': 'fp32'}, 'fp32'),
                                         ({'precision': 'bf16'}, 'same')])      # saved before the key existed
def test_a_resume_keeps_the_attention_precision_the_run_saved(tmp_path, cache, monkeypatch, saved, kept):
    from gptkit.train.plan import resumed_precision
    as_measured(monkeypatch, NO_BF16, ATTENTION_FAST_BF16 if kept == 'fp32' else ATTENTION_SLOW_BF16)
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'config.json').write_text(json.dumps({'train': saved}))
    cfg, why = resumed_precision(resolve('tiny', sets=['train.precision=auto'], out=str(run)))
    assert (cfg.train.precision, cfg.train.attention_precision) == ('bf16', kept)
    assert f'attention_precision auto -> {kept}: as the run it resumes' in why
    assert settle_precision(cfg) == (cfg, None) and not cache.exists()


def test_a_measurement_is_made_once_and_read_from_the_cache(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(choices, 'product_seconds', lambda shapes, rounds=5: calls.append(shapes) or dict(AMX))
    monkeypatch.setattr(choices, 'attention_seconds', lambda shapes, rounds=5: calls.append(shapes)
                        or dict(ATTENTION_SLOW_BF16))
    cfg = resolve('tiny', sets=['train.precision=auto'])
    _, first = settle_precision(cfg)
    _, again = settle_precision(cfg)
    assert len(calls) == 2 and 'measured now' in first and 'cached' in again and 'measured now' not in again
    train, attention = json.loads(cache.read_text()).values()
    assert train['kind'] == 'train' and train['seconds'] == AMX and train['cpu'] == this_cpu().name
    assert attention['kind'] == 'attention' and attention['seconds'] == ATTENTION_SLOW_BF16


@pytest.mark.parametrize('text', ['{broken', '[1, 2]', '{"k": {"seconds": {"fp32": "x"}}}', '{"a": ' * 200])
def test_a_damaged_cache_is_measured_over_and_replaced(cache, monkeypatch, caplog, text):
    as_measured(monkeypatch, NO_BF16)
    cache.parent.mkdir(parents=True)
    cache.write_text(text)
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=auto']))
    assert cfg.train.precision == 'fp32' and 'measured now' in why
    assert json.loads(cache.read_text())           # valid JSON again
    assert not list(cache.parent.glob('.*.tmp'))


def test_an_unwritable_cache_folder_only_loses_the_cache(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')
    monkeypatch.setenv(CACHE_ENV, str(blocker / 'cache'))
    as_measured(monkeypatch, AMX)
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=auto']))
    assert cfg.train.precision == 'bf16' and 'cannot keep measurements' in caplog.text


def test_processes_that_start_together_measure_once_and_agree(cache, tmp_path):
    "Two processes (the ranks of one launch) ask at once: the lock makes one measure and the other read its figures"
    log = tmp_path / 'calls'
    code = ('import sys, time, gptkit.machine.timings as m\n'
            'def slow(shapes, rounds=5):\n'
            f'    open({str(log)!r}, "a").write("x")\n'
            '    time.sleep(1.0)\n'
            '    return {"fp32": 0.01, "bf16": 0.001}\n'
            'm.product_seconds = slow\n'
            'print(m.measured("train", [(64, 64, 64)]).cached)\n')
    env = {'GPTKIT_CACHE': str(cache.parent), 'PATH': '/usr/bin:/bin'}
    procs = [subprocess.Popen([sys.executable, '-c', code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    said = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert said == ['False', 'True'] and log.read_text() == 'x'


def test_a_real_measurement_on_this_machine_decides_consistently(cache):
    "Measured for real here: the figures are positive, and the choice is the rule applied to them"
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=auto', 'train.micro_batch=4']))
    if 'untrusted' in why:                          # this machine was too busy: fp32, and nothing kept
        assert cfg.train.precision == 'fp32' and not cache.exists()
        return
    (m,) = [Measured(e['seconds'], 1.0) for e in json.loads(cache.read_text()).values() if e['kind'] == 'train']
    assert all(v > 0 for v in m.seconds.values())
    assert cfg.train.precision == choose_precision(m.speedup)
    assert f'{m.speedup:.2f}x' in why


def test_the_cpu_default_is_auto_and_the_plan_says_what_it_became(tiny_data, cache, monkeypatch, tmp_path):
    as_measured(monkeypatch, AMX)
    data = {'prefix': tiny_data[0], 'tokenizer': tiny_data[1]}
    sets = [s for s in TINY_SETS if not s.startswith('train.precision')]
    cfg = run_config(sets=sets, overrides={'data': data}, out=str(tmp_path / 'run'))
    assert cfg.train.precision == ('bf16' if torch.cuda.is_available() else 'auto')
    plan = plan_run(cfg)
    assert plan.cfg.train.precision == 'bf16' and 'auto -> bf16' in plan.precision_why
    assert RunPlan.from_json(plan.to_json()).precision_why == plan.precision_why   # handed to the ranks as it is
    fixed = plan_run(run_config(sets=TINY_SETS, overrides={'data': data}, out=str(tmp_path / 'run2')))
    assert (fixed.cfg.train.precision, fixed.precision_why) == ('fp32', None)


@pytest.mark.parametrize('seconds, precision', [(NO_BF16, 'fp32'), (AMX, 'bf16')])
def test_gptkit_train_prints_the_choice_and_trains_in_it(tiny_data, cache, monkeypatch, tmp_path, seconds, precision):
    import gptkit.model.decoder
    as_measured(monkeypatch, seconds)
    cores, core = [], gptkit.model.decoder.core_attention_in
    monkeypatch.setattr(gptkit.model.decoder, 'core_attention_in',
                        lambda dtype, q, *a, **k: cores.append((dtype, q.dtype)) or core(dtype, q, *a, **k))
    sets = [s for s in TINY_SETS if not s.startswith('train.precision')]
    r = run_here('train', '--data', tiny_data[0], '--tokenizer', tiny_data[1], '--out', tmp_path / 'run',
                 '--iters', 2, *[a for s in sets for a in ('--set', s)])
    assert r.returncode == 0, r.stdout + r.stderr
    text = ' '.join(r.stdout.split())
    assert f'train.precision auto -> {precision}' in text
    saved = json.loads((tmp_path / 'run' / 'config.json').read_text())
    assert saved['train']['precision'] == precision                 # a resume trains on in the same precision
    attention = 'fp32' if precision == 'bf16' else 'same'           # ATTENTION_SLOW_BF16 was measured
    assert saved['train']['attention_precision'] == attention
    assert ('attention_precision auto -> fp32' in text) == (attention == 'fp32')
    half = torch.bfloat16 if precision == 'bf16' else torch.float32
    assert cores and set(cores) == {(torch.float32 if attention == 'fp32' else None, half)}


def test_the_reason_names_the_figures(monkeypatch, unlimited):
    m = Measured({'fp32': 2.0, 'bf16': 0.5}, 1e9)
    why = precision_reason(m, 'bf16', CPU('Test CPU', frozenset({'avx512_bf16'})))
    assert '4.00x' in why and '2.0 vs 0.5 GFLOP/s' in why and 'Test CPU (AVX-512-bf16)' in why
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')          # the CPU has bf16 instructions; its kernels may not
    assert 'kernels limited by ONEDNN_MAX_CPU_ISA=AVX2' in precision_reason(m, 'fp32', CPU('Test CPU'))


# Generation: the decode layout and dtype

SIDES = {
    'fp32 wins': ({}, 'fp32'),
    'bf16 wins': ({'bf16': 0.2}, 'bf16'),
}


def decode_seconds(bf16: float = 1.0, packed: float | None = None, mkl8: float | None = None,
                   huge: float | None = None) -> dict:
    """Decode forms measured: bf16 at `bf16` x fp32's time; the packed forms at `packed`, `mkl8` x, the forms in huge
    pages at `huge` x their own form's (None: no kernel, or no huge pages)"""
    out, optional = {}, {'packed': packed, 'mkl8': mkl8}
    for d in ('fp32', 'bf16'):
        for part, forms in DECODE_FORMS.items():
            for f in forms:
                kind, pages = f.split()[0], f.endswith(' huge')
                if (kind in optional and optional[kind] is None) or (pages and huge is None):
                    continue
                for n in (1, 8):
                    scale = (0.5 if kind == 'rows' and n == 8 else 1) * optional.get(kind, 1) * (huge if pages else 1)
                    out[f'{d} {part} {f} {n}'] = (bf16 if d == 'bf16' else 1.0) * scale
    return out


@pytest.mark.parametrize('side', SIDES)
def test_generation_picks_its_dtype_by_measuring_and_tokens_stay_the_models(tiny_checkpoint, cache, monkeypatch, side):
    over, dtype = SIDES[side]
    import gptkit.inference.decode as decoding
    monkeypatch.setattr(decoding, 'measure_decode', lambda linears, head, dtypes: decode_seconds(**over))
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu', dtype='auto')
    assert gen.decode.dtype == dtype and gen.decode.head == ('plain', 'rows')
    assert next(gen.model.parameters()).dtype == (torch.bfloat16 if dtype == 'bf16' else torch.float32)
    assert f'decoding in {dtype}' in gen.decode.why
    from gptkit.inference.sampling import Sampling
    out = gen.complete(['In the beginning'], Sampling(max_new_tokens=5, greedy=True, stop_at_eod=False))
    assert len(out[0].tokens) == 5


def test_an_explicit_decode_dtype_is_kept(tiny_checkpoint, cache, monkeypatch):
    import gptkit.inference.decode as decoding
    monkeypatch.setattr(decoding, 'measure_decode', lambda linears, head, dtypes: decode_seconds(bf16=0.1))
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu')           # the library's default: fp32
    assert gen.decode.dtype == 'fp32' and next(gen.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize('choice', [DecodeChoice(), DecodeChoice('fp32', 'plain', ('plain', 'plain')),
                                    DecodeChoice('fp32', 'plain', ('rows', 'transposed'))])
def test_every_decode_layout_gives_the_models_logits(choice):
    torch.manual_seed(0)
    m = GPT(ModelConfig(layers=2, hidden=32, heads=2, seq_len=32, vocab=300, dropout=0.0)).eval()
    net = decode_layout(m, choice)
    for rows in (1, 3):
        ids = torch.randint(0, 300, (rows, 9))
        with torch.no_grad():
            torch.testing.assert_close(net(ids), m(ids), rtol=1e-5, atol=1e-5)
    assert (net.head.weight_t is not None) == ('transposed' in choice.head)


BF16_PACKS = packed_weight(torch.ones(1, 1, dtype=torch.bfloat16)) is not None     # oneDNN's bf16 kernels run here


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_the_packed_layout_gives_the_models_logits_and_greedy_tokens(dtype):
    if dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip('no oneDNN bf16 kernels on this CPU (AVX-512 or AVX-NE-CONVERT): the choice is tested with figures')
    torch.manual_seed(0)
    m = GPT(ModelConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab=300, dropout=0.0)).eval().to(dtype)
    net = decode_layout(m, DecodeChoice('bf16' if dtype == torch.bfloat16 else 'fp32', 'packed', ('packed', 'packed')))
    assert not any(type(x) is torch.nn.Linear for x in net.modules()) and net.head.packed is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 3):
        ids = torch.randint(0, 300, (rows, 9))
        with torch.no_grad():
            torch.testing.assert_close(net(ids).float(), m(ids).float(), rtol=tol, atol=tol)
    tok = type('Tok', (), {'eod': 299, 'encode': lambda self, t: [1, 2, 3],
                           'decode': lambda self, ids: 'x' * len(ids)})()
    from gptkit.inference.generator import reference_greedy
    from gptkit.inference.sampling import Sampling
    gen = Generator(m, tok, DecodeChoice('fp32', 'packed', ('packed', 'packed')))
    got = gen.complete(['p'], Sampling(max_new_tokens=8, greedy=True, stop_at_eod=False))[0].tokens
    assert got == reference_greedy(gen.model, [1, 2, 3], 8)


def test_a_cpu_without_packed_kernels_measures_and_chooses_among_the_other_forms(monkeypatch):
    import gptkit.inference.decode as decoding
    monkeypatch.setattr(decoding, 'packed_weight', lambda w: None)       # bf16 on an AVX2 CPU: oneDNN refuses
    seconds = measure_decode([(16, 8)], (32, 8))
    assert seconds and not any(' packed ' in k for k in seconds)
    assert decode_choice(seconds).linear in ('plain', 'transposed')
    assert decode_choice(decode_seconds()).linear != 'packed'
    assert decode_choice(decode_seconds(packed=0.4)).linear == 'packed'
    assert decode_choice(decode_seconds(packed=0.4)).head == ('packed', 'packed')
    assert decode_choice(decode_seconds(packed=1.5)).linear != 'packed'


def test_a_cached_packed_choice_on_a_pytorch_that_cannot_pack_still_decodes(tiny_checkpoint, cache, monkeypatch):
    "A cache written where oneDNN packed (say, a machine.json carried to another build): the layout falls back"
    import gptkit.inference.decode as decoding
    monkeypatch.setattr(decoding, 'measure_decode', lambda linears, head, dtypes: decode_seconds(packed=0.1))
    monkeypatch.setattr(decoding, 'packed_weight', lambda w: None)
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu')
    assert gen.decode.linear == 'packed' and gen.model.head.forms == ('plain', 'plain')
    linears = [m for m in gen.model.modules() if type(m).__name__ == 'DecodeLinear']
    assert linears and all(m.weight_t is not None and m.packed is None for m in linears)
    from gptkit.inference.generator import reference_greedy
    from gptkit.inference.sampling import Sampling
    got = gen.complete(['In the beginning'], Sampling(max_new_tokens=5, greedy=True, stop_at_eod=False))[0]
    assert got.tokens == reference_greedy(gen.model, got.prompt_tokens, 5)


MKL_PACKS = mkl_packed(torch.ones(1, 1)) is not None


@pytest.mark.skipif(not MKL_PACKS, reason='this PyTorch has no MKL: the choice is tested with figures')
def test_the_mkl_output_layer_gives_the_models_logits_at_any_rows():
    torch.manual_seed(0)
    m = GPT(ModelConfig(layers=2, hidden=32, heads=2, seq_len=32, vocab=300, dropout=0.0)).eval()
    net = decode_layout(m, DecodeChoice('fp32', 'transposed', ('mkl8', 'mkl8')))
    assert net.head.mkl is not None
    for rows in (1, 5, MKL_ROWS, MKL_ROWS + 3):              # padded to MKL_ROWS; more rows by F.linear
        h = torch.randn(rows, 32)
        with torch.no_grad():
            y = net.head(h)
        assert y.shape == (rows, 300) and y.is_contiguous()
        torch.testing.assert_close(y, m.logits(h), rtol=1e-5, atol=1e-5)


def test_the_mkl_form_is_chosen_by_its_figures_and_falls_back_where_it_cannot_be_made(monkeypatch):
    assert decode_choice(decode_seconds(mkl8=0.2)).head == ('mkl8', 'mkl8')
    assert decode_choice(decode_seconds(mkl8=1.5)).head == ('plain', 'rows')        # slower: not taken
    import gptkit.inference.decode as decoding
    monkeypatch.setattr(decoding, 'mkl_packed', lambda w: None)
    seconds = measure_decode([(16, 8)], (32, 8))
    assert not any(' mkl8 ' in k for k in seconds)
    m = GPT(ModelConfig(layers=1, hidden=32, heads=2, seq_len=32, vocab=300, dropout=0.0)).eval()
    assert decode_layout(m, DecodeChoice('fp32', 'plain', ('mkl8', 'mkl8'))).head.forms == ('plain', 'plain')


def test_the_packed_forms_are_measured_where_they_have_kernels():
    seconds = measure_decode([(16, 8)], (32, 8))
    for dtype in ('fp32', 'bf16'):
        packs = packed_weight(torch.ones(1, 1, dtype=torch.float32 if dtype == 'fp32' else torch.bfloat16)) is not None
        assert (f'{dtype} linear packed 1' in seconds) == packs and (f'{dtype} head packed 8' in seconds) == packs
    assert ('fp32 head mkl8 8' in seconds) == MKL_PACKS and 'bf16 head mkl8 1' not in seconds      # MKL packs fp32


def test_the_decode_decision_on_both_sides():
    assert decode_choice(decode_seconds()).dtype == 'fp32'
    assert decode_choice(decode_seconds(bf16=1 / BF16_GAIN)).dtype == 'bf16'
    assert decode_choice(decode_seconds(bf16=1 / (BF16_GAIN - 0.05))).dtype == 'fp32'
    assert decode_choice(decode_seconds(bf16=0.1), ('fp32',)).dtype == 'fp32'


# Huge pages: the decode matrices in memory advised for transparent huge pages, where the OS gives them

HUGE = huge_pages_allowed()          # Linux with THP 'always' or 'madvise'; the other side by a THP setting of 'never'


def huge_kib(address: int) -> int:
    "KiB of transparent huge pages backing the mapping of this process that holds `address` (/proc/self/smaps)"
    mapping = None
    for line in Path('/proc/self/smaps').read_text().splitlines():
        head = line.split()[0]
        if '-' in head and ':' not in head:
            low, high = (int(v, 16) for v in head.split('-'))
            mapping = low <= address < high
        elif mapping and line.startswith('AnonHugePages:'):
            return int(line.split()[1])
    return 0


@pytest.fixture
def thp_never(tmp_path, monkeypatch):
    "This process on an OS whose transparent huge pages are off"
    setting = tmp_path / 'enabled'
    setting.write_text('always madvise [never]\n')
    monkeypatch.setattr(pages, 'THP_SETTING', setting)


def huge_model():
    "A model whose decode matrices fill more than a huge page (the head 4 MiB, the linears 3 MiB in fp32)"
    torch.manual_seed(0)
    return GPT(ModelConfig(layers=4, hidden=128, heads=4, seq_len=32, vocab=8192, dropout=0.0)).eval()


@pytest.mark.skipif(not HUGE, reason='this OS gives no transparent huge pages: the other side is tested with a setting')
def test_huge_copies_are_one_aligned_region_the_kernel_backs_with_huge_pages():
    ts = [torch.randn(1000, 384), torch.randn(7, 3), torch.randn(1024, 300).to(torch.bfloat16).t()]
    copies = huge_copies(ts)
    assert all(torch.equal(c, t) and c.is_contiguous() and c.dtype == t.dtype for c, t in zip(copies, ts))
    ptrs = [c.data_ptr() for c in copies]
    assert ptrs[0] % HUGE_PAGE == 0                                # one region, each matrix on the next 4 KiB
    assert [p - ptrs[0] for p in ptrs] == [0, 1000 * 384 * 4, 1000 * 384 * 4 + 4096]
    assert huge_kib(ptrs[0]) >= HUGE_PAGE // 1024
    assert huge_copies([torch.randn(8, 8)]) is None              # less than a huge page: ordinary memory


def test_without_huge_pages_nothing_is_copied_measured_or_chosen(thp_never, tmp_path, monkeypatch):
    assert not huge_pages_allowed() and huge_copies([torch.randn(1024, 1024)]) is None
    seconds = measure_decode([(512, 1024)], (1024, 512))                     # 2 MiB each in fp32
    assert seconds and not any(k.endswith(' huge 1') for k in seconds)
    assert 'fp32 head transposed 1' in seconds
    assert 'huge' not in decode_choice(seconds).linear + ' '.join(decode_choice(seconds).head)
    monkeypatch.setattr(pages, 'THP_SETTING', tmp_path / 'missing')      # a kernel without THP: no such file
    assert not huge_pages_allowed()
    m = huge_model()                                      # a cached huge choice here: the layout in ordinary memory
    net = decode_layout(m, DecodeChoice('fp32', 'transposed huge', ('transposed huge', 'rows huge')))
    ids = torch.randint(0, 8192, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), m(ids), rtol=1e-5, atol=1e-5)


def test_a_refused_mapping_keeps_the_matrices_in_ordinary_memory(monkeypatch):
    "mmap refused (a limit on mappings, no memory to map): the layout is made in ordinary pages, no error"
    import errno
    def refuse(*args, **kw):
        raise OSError(errno.ENOMEM, 'Cannot allocate memory')
    monkeypatch.setattr(mmap, 'mmap', refuse)
    assert huge_copies([torch.randn(1024, 1024)]) is None
    m = huge_model()
    net = decode_layout(m, DecodeChoice('fp32', 'plain huge', ('transposed huge', 'rows huge')))
    ids = torch.randint(0, 8192, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), m(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HUGE, reason='this OS gives no transparent huge pages: the other side is tested with a setting')
def test_the_huge_forms_are_measured_beside_their_own_form():
    seconds = measure_decode([(1024, 1024)], (2048, 512))                    # 2 MiB each in bf16
    for d in ('fp32', 'bf16'):
        for part, form in (('linear', 'plain'), ('linear', 'transposed'), ('head', 'transposed'), ('head', 'rows')):
            assert f'{d} {part} {form} huge 1' in seconds and f'{d} {part} {form} huge 8' in seconds
    tiny = measure_decode([(16, 8)], (32, 8))                                  # under one huge page: not measured
    assert tiny and not any(' huge ' in k for k in tiny)


def test_the_huge_forms_are_chosen_by_their_figures():
    c = decode_choice(decode_seconds(huge=0.8))
    assert (c.linear, c.head) == ('plain huge', ('plain huge', 'rows huge'))
    assert 'linears plain in huge pages' in c.why
    assert decode_choice(decode_seconds(huge=1.2)).head == ('plain', 'rows')
    assert decode_choice(decode_seconds(huge=0.8, mkl8=0.1)).head == ('mkl8', 'mkl8')


@pytest.mark.parametrize('huge, taken', [(1.0, True), (HUGE_CREDIT - 0.01, True), (HUGE_CREDIT + 0.01, False)])
def test_a_form_in_huge_pages_is_credited_what_a_decode_step_gains(huge, taken):
    "Measured alone a form gains less from huge pages than in a decode step (the oneDNN-AVX2 Xeon: 0-2% alone, 5.6% in a step)"
    c = decode_choice(decode_seconds(huge=huge))
    assert (c.linear, c.head) == (('plain huge', ('plain huge', 'rows huge')) if taken else ('plain', ('plain', 'rows')))


@pytest.mark.skipif(not HUGE, reason='this OS gives no transparent huge pages: the other side is tested with a setting')
@pytest.mark.parametrize('choice', [DecodeChoice('fp32', 'transposed huge', ('transposed huge', 'rows huge')),
                                    DecodeChoice('fp32', 'plain huge', ('plain huge', 'mkl8')),
                                    DecodeChoice('fp32', 'transposed', ('rows huge', 'transposed'))])
def test_a_layout_in_huge_pages_gives_the_models_logits_and_greedy_tokens(choice):
    m = huge_model()
    net = decode_layout(m, choice)
    ids = torch.randint(0, 8192, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(net(ids), m(ids), rtol=1e-5, atol=1e-5)
        for rows in (1, 3, 8, 11):
            h = torch.randn(rows, 128)
            torch.testing.assert_close(net.head(h), m.logits(h), rtol=1e-5, atol=1e-5)
    linears = [x.weight if x.weight is not None else x.weight_t for x in net.modules() if type(x).__name__ == 'DecodeLinear']
    head = [t for t, form in ((net.head.weight_t, 'transposed'), (net.head.rows, 'rows')) if f'{form} huge' in choice.head]
    head += [net.head.rows] * ('plain huge' in choice.head)
    placed = (linears if choice.linear.endswith(' huge') else []) + head
    ptrs = sorted(t.data_ptr() for t in placed)
    span = sum(t.numel() * t.element_size() + 4096 for t in placed)
    assert ptrs and ptrs[0] % HUGE_PAGE == 0 and huge_kib(ptrs[0]) > 0             # one region, in huge pages
    assert ptrs[-1] - ptrs[0] < span
    others = [t for t in linears + [net.head.rows, net.head.weight_t] if t is not None and all(t is not p for p in placed)]
    assert not any(ptrs[0] <= t.data_ptr() < ptrs[0] + span for t in others)       # the rest: where they were
    assert net.wte.weight is m.wte.weight                                            # the embeddings: not copied
    tok = type('Tok', (), {'eod': 8191, 'encode': lambda self, t: [1, 2, 3],
                           'decode': lambda self, ids: 'x' * len(ids)})()
    from gptkit.inference.generator import reference_greedy
    from gptkit.inference.sampling import Sampling
    gen = Generator(m, tok, choice)
    got = gen.complete(['p'], Sampling(max_new_tokens=8, greedy=True, stop_at_eod=False))[0].tokens
    assert got == reference_greedy(m, [1, 2, 3], 8)


def test_the_linears_form_weighs_one_row_and_eight_alike():
    "As the full-AVX2 Xeon measured: oneDNN's packed fp32 linears 40% slower at one row, 3% faster at eight"
    seconds = {**decode_seconds(packed=1.0), 'fp32 linear plain 1': 1.0e-3, 'fp32 linear plain 8': 3.4e-3,
               'fp32 linear packed 1': 1.4e-3, 'fp32 linear packed 8': 2.9e-3}
    seconds.update({k: 1.0 for k in seconds if k.startswith('fp32 linear transposed')})
    assert sum(seconds[f'fp32 linear packed {n}'] for n in (1, 8)) < sum(seconds[f'fp32 linear plain {n}'] for n in (1, 8))
    assert decode_choice(seconds, ('fp32',)).linear == 'plain'        # seconds summed would have taken packed
    seconds['fp32 linear packed 1'] = 0.9e-3
    assert decode_choice(seconds, ('fp32',)).linear == 'packed'       # faster at both


def test_generate_refuses_an_unknown_dtype_in_one_sentence(tiny_checkpoint):
    r = run_here('generate', '--checkpoint', tiny_checkpoint, '--prompt', 'x', '--dtype', 'fp8')
    assert r.returncode != 0 and 'Traceback' not in r.stdout + r.stderr
    assert '--dtype must be one of fp32, bf16, auto' in ' '.join((r.stdout + r.stderr).split())


def test_every_benchmark_prints_the_cpu_and_its_features():
    for f in sorted((ROOT / 'benchmarks').glob('*.py')):
        assert 'this_cpu().summary()' in f.read_text(), f'{f.name} does not print the CPU and its features'


def test_the_quickstart_refuses_an_unknown_precision_before_any_work(tmp_path):
    r = run_here('quickstart', '--out', tmp_path / 'qs', '--precision', 'fp8')
    assert r.returncode != 0 and 'Traceback' not in r.stdout + r.stderr
    assert '--precision must be one of fp32, fp16, bf16, auto' in ' '.join((r.stdout + r.stderr).split())
    assert not (tmp_path / 'qs').exists()


def test_auto_is_refused_for_a_cpu_run_over_several_machines(tmp_path, monkeypatch):
    "Each node would measure its own CPU: nodes that decided differently would train in different precisions"
    if torch.cuda.is_available():
        pytest.skip('on a GPU auto is the GPU\'s 16-bit type, the same on every node')
    r = run_here('train', '--preset', 'tiny', '--nnodes', 2, '--nproc', 1, '--master-addr', '127.0.0.1',
                 '--out', tmp_path / 'run')
    said = ' '.join((r.stdout + r.stderr).split())
    assert r.returncode != 0 and 'auto is measured on each machine' in said and 'Traceback' not in said
    assert not (tmp_path / 'run').exists()
    shown = run_here('train', '--preset', 'tiny', '--nnodes', 2, '--nproc', 1, '--master-addr', '127.0.0.1',
                     '--dry-run')                    # a job shown or written for a cluster is not refused here
    assert shown.returncode == 0, shown.stdout + shown.stderr
    monkeypatch.setenv('WORLD_SIZE', '4')                # a rank of someone's own torchrun over two nodes
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2')
    with pytest.raises(Exception, match='auto is measured on each machine'):
        settle_precision(resolve('tiny', sets=['train.precision=auto']))


def test_an_arm_cpuinfo_gives_its_features():
    arm = parse_cpuinfo('processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n')
    assert arm.flags >= {'sve', 'bf16'} and arm.name == 'CPU implementer 0x41 CPU part 0xd40'


def test_a_big_models_products_are_scaled_to_a_budget_and_the_rounds_to_a_time():
    from gptkit.config.sections import PRESETS
    from gptkit.machine.choices import training_products
    from gptkit.machine.timings import MAX_FLOPS, capped, product_flops, product_seconds
    big = capped(training_products(PRESETS['llama-3.1-8b'].model, 1))
    assert product_flops(big) <= MAX_FLOPS * 1.01 and all(n <= 4096 and k <= 4096 for _, n, k in big)
    import time
    start = time.perf_counter()
    seconds = product_seconds([(256, 256, 256)], rounds=10**6, budget=0.2)
    assert time.perf_counter() - start < 5 and set(seconds) == {'fp32', 'bf16'}


def test_a_lock_that_is_not_a_file_is_refused_not_waited_on(cache, monkeypatch, caplog):
    import os
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache.parent / 'machine.json.lock')
    as_measured(monkeypatch, AMX)
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=auto']))
    assert cfg.train.precision == 'bf16' and 'not a regular file' in caplog.text


def test_processes_of_one_run_refuse_auto_when_the_cache_cannot_be_kept(tmp_path, monkeypatch):
    blocker = tmp_path / 'file'
    blocker.write_text('')
    monkeypatch.setenv(CACHE_ENV, str(blocker / 'cache'))
    as_measured(monkeypatch, AMX)
    with pytest.raises(Exception, match='could not be kept'):
        settle_precision(resolve('tiny', sets=['train.precision=auto']), world=2)


def test_a_run_of_several_processes_is_measured_on_the_threads_each_has(cache, monkeypatch):
    seen = []
    monkeypatch.setattr(choices, 'product_seconds', lambda shapes, rounds=5: seen.append(torch.get_num_threads())
                        or dict(AMX))
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    before = torch.get_num_threads()
    settle_precision(resolve('tiny', sets=['train.precision=auto']), world=2)
    settle_precision(resolve('tiny', sets=['train.precision=auto']), world=1)
    assert seen == [1, before] and torch.get_num_threads() == before


def test_a_resume_trains_on_in_the_precision_the_run_saved(tmp_path, cache, monkeypatch):
    from gptkit.train.plan import resumed_precision
    as_measured(monkeypatch, NO_BF16)                     # today's measurement would say fp32
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'config.json').write_text(json.dumps({'train': {'precision': 'bf16'}}))
    cfg, why = resumed_precision(resolve('tiny', sets=['train.precision=auto'], out=str(run)))
    assert cfg.train.precision == 'bf16' and 'the precision of the run it resumes' in why
    (run / 'config.json').write_text(json.dumps({'train': ['bf16']}))          # not a config: measured as usual
    assert resumed_precision(resolve('tiny', sets=['train.precision=auto'], out=str(run)))[1] is None


def test_measuring_the_decode_layout_leaves_the_global_random_numbers_alone():
    from gptkit.inference.decode import measure_decode
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    measure_decode([(16, 8)], (32, 8))
    assert torch.equal(torch.rand(3), want)


def test_an_estimate_names_its_precision(tmp_path):
    r = run_here('estimate', '--preset', '125m', '--precision', 'auto')
    assert r.returncode != 0 and '--precision must be fp32, fp16 or bf16 for an estimate' in ' '.join(r.stdout.split() + r.stderr.split())


def test_a_hostfile_counts_its_hosts_as_nodes(tmp_path):
    from gptkit.train.launch import Launch
    hosts = tmp_path / 'hosts'
    hosts.write_text('# the cluster\nworker-1 slots=2\n\nworker-2 slots=2\n')
    assert Launch(launcher='deepspeed', nproc=2, hostfile=hosts).nodes == 2 and Launch(nproc=2).nodes == 1


@pytest.mark.parametrize('bad', [['fp32'], 'fp64', None, 7])
def test_a_resume_whose_saved_attention_precision_is_not_one_measures_it_anew(tmp_path, cache, monkeypatch, bad):
    from gptkit.train.plan import resumed_precision
    as_measured(monkeypatch, NO_BF16)
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'config.json').write_text(json.dumps({'train': {'precision': 'bf16', 'attention_precision': bad}}))
    cfg, why = resumed_precision(resolve('tiny', sets=['train.precision=auto'], out=str(run)))
    assert (cfg.train.precision, cfg.train.attention_precision) == ('bf16', 'auto') and 'attention' not in why
    cfg, why = settle_precision(cfg)
    assert cfg.train.attention_precision == 'fp32' and 'measured now' in why      # ATTENTION_SLOW_BF16


def test_keeping_freed_memory_changes_nothing_where_the_c_library_has_no_mallopt(monkeypatch):
    import ctypes

    class NoMallopt:                                # a C library without glibc's mallopt (musl, macOS)
        def __init__(self, name):
            pass
    monkeypatch.setattr(ctypes, 'CDLL', NoMallopt)
    assert keep_freed_memory() is False
    monkeypatch.setattr(ctypes, 'CDLL', lambda name: (_ for _ in ()).throw(OSError('no C library')))
    assert keep_freed_memory() is False
