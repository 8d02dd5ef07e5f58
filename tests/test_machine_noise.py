"""Issue 51 item 3: every measured choice is bounded by what the CPU can do (no bf16 without bf16 instructions),
measured again when its figures spread too far or cannot be right, and never cached from a noisy run"""
import json

import pytest
import torch

import gptkit.inference.decode as decoding
from gptkit.errors import ConfigError
from gptkit.inference.generator import Generator
from gptkit.machine.choices import settle_precision
from gptkit.machine import choices
from gptkit.machine.choices import ragged_seconds
from gptkit.machine.cpu import CPU, ISA_ENV, bf16_kind
from gptkit.machine.timings import CACHE_ENV, MEASURE_TRIES, SPREAD_MOST, Timings, fastest_rounds, product_seconds
from gptkit.config.run import resolve
from test_machine import decode_seconds

AVX2 = CPU('Test EPYC', frozenset({'avx2'}))                         # the AVX2-only EPYC: bf16 emulated
AVX512_BF16 = CPU('Test Zen 4', frozenset({'avx2', 'avx512f', 'avx512_bf16'}))
AMX = CPU('Test Xeon', frozenset({'avx2', 'avx512f', 'avx512_bf16', 'amx_bf16'}))
FAST_BF16 = {'fp32': 0.010, 'bf16': 0.004}                         # 2.5x: within what AVX-512-bf16 can do


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / 'cache'))
    for var in ISA_ENV:
        monkeypatch.delenv(var, raising=False)
    return tmp_path / 'cache' / 'machine.json'




def timings(seconds: dict, spread: float = 1.0) -> Timings:
    out = Timings(seconds)
    out.spread = spread
    return out


def measuring(monkeypatch, *figures):
    "product_seconds gives `figures` in turn (the last one again after); returns the list of calls"
    calls = []
    def measure(shapes, rounds=5):
        calls.append(shapes)
        return figures[min(len(calls), len(figures)) - 1]
    monkeypatch.setattr(choices, 'product_seconds', measure)
    return calls


def auto():
    return settle_precision(resolve('tiny', sets=['train.precision=auto', 'train.micro_batch=4']))


def test_which_cpus_have_bf16_instructions(cache, monkeypatch):
    assert [bf16_kind(c) for c in (AVX2, AVX512_BF16, AMX)] == [None, 'AVX-512-bf16', 'AMX']
    assert bf16_kind(CPU('Neoverse V2', frozenset({'asimd', 'bf16'}))) == 'Arm bf16'
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')                # kernels held below bf16: emulated
    assert bf16_kind(AMX) is None
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'avx512_core_bf16')    # AMX's tiles held back, its bf16 dot products not
    assert bf16_kind(AMX) == 'AVX-512-bf16'


def test_without_bf16_instructions_auto_stays_fp32_and_measures_nothing(pin_cpu, cache, monkeypatch):
    pin_cpu(AVX2)
    calls = measuring(monkeypatch, {'fp32': 0.7, 'bf16': 0.01})     # 70x: what a noisy run once said here
    cfg, why = auto()
    assert cfg.train.precision == 'fp32' and calls == [] and not cache.exists()
    assert 'Test EPYC (AVX2) has no bf16 instructions' in why and 'nothing measured' in why


def test_spread_figures_are_measured_again_and_a_steady_try_is_cached(pin_cpu, cache, monkeypatch):
    pin_cpu(AMX)
    calls = measuring(monkeypatch, timings(FAST_BF16, 2.0), timings(FAST_BF16, 1.05))
    cfg, why = auto()
    assert len(calls) == 2 and cfg.train.precision == 'bf16' and 'measured now' in why
    assert 'train' in [e['kind'] for e in json.loads(cache.read_text()).values()]


def test_figures_that_never_steady_decide_fp32_and_are_not_cached(pin_cpu, cache, monkeypatch):
    pin_cpu(AMX)
    calls = measuring(monkeypatch, timings(FAST_BF16, 1.9))
    cfg, why = auto()
    assert len(calls) == MEASURE_TRIES and cfg.train.precision == 'fp32'
    assert f'untrusted after {MEASURE_TRIES} measurements' in why and '1.90x apart' in why and 'nothing cached' in why
    assert not cache.exists() or 'train' not in cache.read_text()
    auto()
    assert len(calls) == 2 * MEASURE_TRIES                            # measured anew, not read back


@pytest.mark.parametrize('cpu, seconds, precision', [(AVX512_BF16, {'fp32': 0.70, 'bf16': 0.01}, 'fp32'),   # 70x
                                                     (AMX, {'fp32': 0.70, 'bf16': 0.01}, 'fp32'),           # 70x
                                                     (AMX, {'fp32': 0.010, 'bf16': 0.0012}, 'bf16')])       # 8.3x
def test_bf16_faster_than_the_cpus_instructions_allow_is_not_believed(pin_cpu, cache, monkeypatch, cpu, seconds, precision):
    pin_cpu(cpu)
    calls = measuring(monkeypatch, seconds)
    cfg, why = auto()
    assert cfg.train.precision == precision
    if precision == 'fp32':
        assert len(calls) == MEASURE_TRIES and '70.00x as fast as fp32, past the' in why and not cache.exists()
    else:
        assert len(calls) == 1 and cache.exists()


def test_an_implausible_cached_entry_is_measured_anew(pin_cpu, cache, monkeypatch):
    "A cache written before the bound (its key this one's) holding 70x is not read back"
    pin_cpu(AVX512_BF16)
    calls = measuring(monkeypatch, FAST_BF16)
    auto()
    entries = json.loads(cache.read_text())
    (key,) = [k for k, e in entries.items() if e['kind'] == 'train']
    entries[key]['seconds'] = {'fp32': 0.7, 'bf16': 0.01}
    cache.write_text(json.dumps(entries))
    cfg, why = auto()
    assert len(calls) == 2 and cfg.train.precision == 'bf16' and 'measured now' in why


def test_a_noisy_attention_measurement_keeps_the_runs_precision(pin_cpu, cache, monkeypatch):
    pin_cpu(AMX)
    monkeypatch.setattr(choices, 'attention_seconds', lambda shapes, rounds=5: timings({'bf16': 0.005, 'fp32': 0.001},
                                                                                        3.0))
    cfg, why = settle_precision(resolve('tiny', sets=['train.precision=bf16']))
    assert cfg.train.attention_precision == 'same' and 'untrusted' in why and not cache.exists()


def test_processes_of_one_run_refuse_figures_that_never_steadied(pin_cpu, cache, monkeypatch):
    pin_cpu(AMX)
    measuring(monkeypatch, timings(FAST_BF16, 1.9))
    with pytest.raises(ConfigError, match=r'train\.precision auto is measured once for all 2 processes.*never steady'):
        settle_precision(resolve('tiny', sets=['train.precision=auto']), world=2)


def test_rounds_go_on_while_the_fastest_two_disagree():
    "A pass whose fastest rounds keep disagreeing is timed up to three times the rounds; a steady one stops at them"
    for rest, rounds_run, spread in (([1.0, 1.0], 5, 1.0), ([1.0, 2.0, 2.0], 15, 2.0), ([1.0, 1.1, 3.0], 5, 1.1)):
        seq = iter([9.0] + rest + [rest[-1]] * 40)                 # a warm-up, then the rounds
        calls = []
        def one_pass():
            calls.append(1)
            return next(seq)
        out = fastest_rounds({'x': one_pass}, rounds=5, budget=1e9)
        assert (len(calls) - 1, out['x'], out.spread) == (rounds_run, 1.0, pytest.approx(spread))


def test_a_real_measurement_says_its_spread():
    shapes = [(64, 64, 64)]
    out = product_seconds(shapes)
    assert set(out) == {'fp32', 'bf16'} and out.spread >= 1.0


# Generation's decode dtype


def test_decoding_without_bf16_instructions_measures_fp32_alone(pin_cpu, tiny_checkpoint, cache, monkeypatch):
    pin_cpu(AVX2)
    asked = []
    monkeypatch.setattr(decoding, 'measure_decode', lambda linears, head, dtypes: asked.append(dtypes)
                        or decode_seconds(bf16=0.01))
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu', dtype='auto')
    assert asked == [('fp32',)] and gen.decode.dtype == 'fp32' and 'bf16' not in gen.decode.why
    assert next(gen.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize('spread, bf16, cpu', [(3.0, 0.5, AMX), (1.0, 1 / 70, AVX512_BF16)])
def test_noisy_or_implausible_decode_figures_decode_in_fp32_uncached(pin_cpu, tiny_checkpoint, cache, monkeypatch, spread,
                                                                     bf16, cpu):
    pin_cpu(cpu)
    calls = []
    monkeypatch.setattr(decoding, 'measure_decode', lambda linears, head, dtypes: calls.append(1)
                        or timings(decode_seconds(bf16=bf16), spread))
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu', dtype='auto')
    assert gen.decode.dtype == 'fp32' and 'untrusted' in gen.decode.why and len(calls) == MEASURE_TRIES
    assert not cache.exists()


def test_steady_decode_figures_still_choose_bf16_where_it_is_faster(pin_cpu, tiny_checkpoint, cache, monkeypatch):
    pin_cpu(AMX)
    monkeypatch.setattr(decoding, 'measure_decode', lambda linears, head, dtypes: timings(decode_seconds(bf16=0.5),
                                                                                           SPREAD_MOST))
    gen = Generator.from_checkpoint(tiny_checkpoint, device='cpu', dtype='auto')
    assert gen.decode.dtype == 'bf16' and 'measured now' in gen.decode.why and cache.exists()


# An MoE model's experts: a new shape at every step


def test_an_moe_run_weighs_its_experts_at_new_token_counts(pin_cpu, cache, monkeypatch):
    "bf16's products alone 8x as fast (AMX), its experts' at new shapes 20x slower: the MoE run stays in fp32"
    pin_cpu(AMX)
    dense = measuring(monkeypatch, {'fp32': 0.010, 'bf16': 0.0012})
    ragged = []
    monkeypatch.setattr(choices, 'ragged_seconds', lambda products: ragged.append(products)
                        or {'fp32': 0.020, 'bf16': 0.400})
    cfg, why = settle_precision(resolve('moe-tiny', sets=['train.precision=auto', 'train.micro_batch=4']))
    assert cfg.train.precision == 'fp32' and "the experts' at new token counts" in why
    assert ragged == [[(256, 256, 128, 8), (256, 128, 128, 8)]] and len(dense) == 1
    cfg, _ = auto()                                                # a dense model: no expert term
    assert cfg.train.precision == 'bf16' and len(ragged) == 1


def test_expert_products_are_timed_at_new_token_counts(monkeypatch):
    "Every forward product of an expert in one measurement has a token count of its own (oneDNN builds a kernel for each)"
    rows, matmul = {torch.float32: [], torch.bfloat16: []}, torch.Tensor.__matmul__
    def spy(a, b):
        if a.shape[1] == 16 and b.shape == (16, 32):                 # the forward product [r, 16] @ [16, 32]
            rows[a.dtype].append(a.shape[0])
        return matmul(a, b)
    monkeypatch.setattr(torch.Tensor, '__matmul__', spy)
    out = ragged_seconds([(64, 32, 16, 4)], rounds=2)
    assert set(out) == {'fp32', 'bf16'} and all(v > 0 for v in out.values())
    for seen in rows.values():
        assert len(seen) >= 4 * 3 and len(set(seen)) == len(seen) and 33 <= min(seen) and max(seen) <= 128
