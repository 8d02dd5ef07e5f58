"""The estimator's activation memory against what gptkit's model really saves for backward, on every layout."""
import dataclasses

import pytest
import torch
from conftest import torch_threads

from gptkit.config.sections import LLAMA, ModelConfig, ParallelConfig, TrainConfig
from gptkit.diagnose.memory import PARALLEL_CASES, Saved, measure, measure_parallel, parallel_rows, predict, saved_activation_bytes, single_rows

# not the notebook's shapes: more layers, 6 heads, a vocabulary that TP pads (100 -> 256 rows)
CFG = ModelConfig(layers=4, hidden=48, heads=6, seq_len=32, vocab=100, dropout=0.0)


def _report(rows):
    return '\n'.join(f'{r.layout} {r.recompute} {r.attention} {r.precision}: predicted {r.predicted:,.0f} measured {r.measured:,} '
                     f'({r.error:+.2%})' for r in rows)


def test_one_process_rows_within_10_percent():
    rows = single_rows(CFG, micro_batch=3)
    assert len(rows) == 11
    assert all(abs(r.error) < 0.10 for r in rows), _report(rows)


def test_parallel_rows_within_10_percent():
    measured = measure_parallel(CFG, micro_batch=2)
    rows = parallel_rows(CFG, 2, 3, measured)
    assert len(rows) == len(PARALLEL_CASES) + sum(pp > 1 for _, pp, _, _ in PARALLEL_CASES)   # one row per pipeline stage
    assert all(abs(r.error) < 0.10 for r in rows), _report(rows)
    stage0 = [r for r in rows if 'stage 0' in r.layout and r.recompute == 'none'][0]
    assert '2 in flight' in stage0.layout                                    # min(pp - 0, 3 micro-batches)


def test_the_harness_counts_storages_once_and_leaves_parameters_out():
    w = torch.nn.Parameter(torch.randn(5, 3))
    x = torch.randn(7, 5, requires_grad=True)
    r = saved_activation_bytes(lambda: (x @ w).relu() * x[:, :3], exclude=[w])
    # matmul keeps x; relu keeps its output; mul keeps relu's output and a view of x (x again)
    assert r == Saved(kept=7 * 5 * 4 + 7 * 3 * 4, peak=7 * 5 * 4 + 7 * 3 * 4)


def test_full_recompute_peak_is_the_rebuild():
    train = TrainConfig(micro_batch=2, precision='fp32', recompute='full')
    r = measure(CFG, train)
    assert r.peak > r.kept                                   # the forward keeps block inputs; the backward rebuilds a block
    assert abs(predict(CFG, ParallelConfig(), train) / r.peak - 1) < 0.10


@pytest.mark.parametrize('precision', ['fp32', 'bf16'])
def test_loss_keeps_fp32_softmax(precision):
    from gptkit.model.decoder import GPT
    gpt = GPT(CFG).to({'fp32': torch.float32, 'bf16': torch.bfloat16}[precision]).train()
    h = torch.randn(2, CFG.seq_len, CFG.hidden, dtype=gpt.wte.weight.dtype, requires_grad=True)
    t = torch.randint(0, CFG.vocab, (2, CFG.seq_len))
    r = saved_activation_bytes(lambda: gpt.loss(gpt.logits(h), t), list(gpt.parameters()))
    e = 4 if precision == 'fp32' else 2
    # head input, targets, fp32 log-softmax, weight, and the count of targets the mean divides by
    assert r.peak == 2 * CFG.seq_len * (CFG.hidden * e + 8 + 4 * CFG.vocab) + 4 + 8



# Qwen3's and Mistral's choices (issue 31): per-head QK norms with heads wider than hidden / heads, and a sliding window
# shorter than the sequence (its band mask, which the fused kernel keeps in the activations' dtype, once per layer);
# the notebook measures each alone and on the parallel layouts
MISTRAL = dataclasses.replace(CFG, heads=6, kv_heads=2, sliding_window=8, **LLAMA)
QWEN3_WINDOW = dataclasses.replace(MISTRAL, head_size=16, qk_norm=True)


def test_qk_norm_head_size_and_window_rows_within_10_percent():
    with torch_threads(1):
        rows = single_rows(QWEN3_WINDOW, micro_batch=3)
    assert len(rows) == 11 and all(abs(r.error) < 0.10 for r in rows), _report(rows)
    fused = [r for r in rows if (r.recompute, r.attention, r.precision) == ('none', 'fused', 'fp32')][0]
    assert abs(fused.error) < 0.01, _report([fused])


def test_the_window_mask_is_made_once_and_shared_by_every_layer():
    train = TrainConfig(micro_batch=2, precision='fp32', flash=True)
    plain = dataclasses.replace(MISTRAL, sliding_window=None)
    with torch_threads(1):
        got = measure(MISTRAL, train).peak - measure(plain, train).peak
    assert MISTRAL.layers > 1 and got == MISTRAL.seq_len ** 2 * 4          # one fp32 [s, s] mask, every layer's
    assert predict(MISTRAL, ParallelConfig(), train) - predict(plain, ParallelConfig(), train) == got
    wide = dataclasses.replace(MISTRAL, sliding_window=MISTRAL.seq_len)      # a window that holds it all: the causal kernel
    assert measure(wide, train).peak == measure(plain, train).peak
