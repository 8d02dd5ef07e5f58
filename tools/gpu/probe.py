"""Where a GPU step's time goes: one training step (DeepSpeed engine, ZeRO 0 and 1) and greedy decoding (gptkit and
transformers on the same weights), each under torch.profiler: wall time, the device's kernel time, kernel launches and
host waits (synchronizations, copies to the host) per step or token, and the host's busiest operations. First, what
one call costs the host: a one-element op, the same op then a wait for its result, and a Triton kernel's launch.

A step whose wall time far exceeds its kernel time is bound by the host: its launches or its waits. The figures say
which, so the next change can be measured against them. On a CPU it runs too (no device columns), for a quick check.
Run: python tools/gpu/probe.py [--preset 125m] [--batch 8] [--new 32] [--device cuda]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

WAITS = ('cudaStreamSynchronize', 'cudaDeviceSynchronize', 'cudaEventSynchronize', 'aten::_local_scalar_dense')
LAUNCHES = ('cudaLaunchKernel', 'cuLaunchKernel', 'cuLaunchKernelEx', 'cudaLaunchKernelExC')


def summary(name: str, prof, wall: float, per: int, unit: str):
    "One line of totals per `unit` and the host's five busiest operations"
    events = prof.key_averages()
    count = collections.Counter({e.key: e.count for e in events})
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(count[k] for k in LAUNCHES)
    waits = sum(count[k] for k in WAITS)
    operations = sum(count.values())
    print(f'{name}: {wall / per * 1e3:.2f} ms wall per {unit}, {device_us / per / 1e3:.2f} ms of device kernels, '
          f'{launches / per:.0f} launches, {waits / per:.1f} host waits, {operations / per:.0f} host operations')
    top = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    print('   host: ' + ', '.join(f'{e.key} {e.self_cpu_time_total / per / 1e3:.2f} ms' for e in top))


def synchronize(device: str):
    "Wait for the device's queued work (nothing to wait for on a CPU)"
    if device == 'cuda':
        torch.cuda.synchronize()


def profiled(fn, repeat: int):
    "fn run `repeat` times under the profiler: (profile, wall seconds)"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    with profile(activities=activities) as prof:
        synchronize(device)
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        synchronize(device)
        wall = time.perf_counter() - t
    return prof, wall


def host_costs(device: str, n: int = 2000):
    "Microseconds per call of a one-element torch op, of the op then a wait for its result, and of a Triton kernel"
    x = torch.zeros(1, device=device)

    def per_call(fn) -> float:
        for _ in range(50):
            fn()
        synchronize(device)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        synchronize(device)
        return (time.perf_counter() - t) / n * 1e6
    op, waited = per_call(lambda: x.add_(1)), per_call(lambda: x.add_(1).item())
    line = f'host: one-element add {op:.1f} us, add then wait {waited:.1f} us'
    if device == 'cuda':
        from gptkit.kernels import fused as K
        b = torch.zeros(1, device=device)
        line += f', Triton bias + GELU {per_call(lambda: K.bias_gelu(x, b)):.1f} us'
    print(line + ' per call')


def train_steps(preset: str, batch: int, device: str):
    from gptkit.train.engine import build_engine, init_distributed
    from gptkit.model.decoder import GPT
    from gptkit.config.run import resolve
    init_distributed()
    precision = 'bf16' if device == 'cuda' else 'fp32'
    for zero in (0, 1):
        cfg = resolve(preset, sets=['model.dropout=0', f'train.micro_batch={batch}', f'train.global_batch={batch}',
                                    f'train.precision={precision}', f'parallel.zero={zero}'])
        engine, _ = build_engine(cfg, GPT(cfg.model), iters=10**6)
        x = torch.randint(0, cfg.model.vocab, (batch, cfg.model.seq_len + 1), device=device)

        def step():
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
        for _ in range(2):
            step()
        prof, wall = profiled(step, 3)
        summary(f'train {preset} ZeRO {zero} ({type(engine.optimizer).__name__})', prof, wall, 3, 'step')


def decode(preset: str, new: int, device: str):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'benchmarks'))
    from bench_generate import models, prompts, run_hf, run_ours

    from gptkit.inference.decode import DecodeChoice
    from gptkit.inference.generator import Generator
    ours, hf, tok, cfg, _ = models(preset, None)
    dtype = torch.bfloat16 if device == 'cuda' else torch.float32
    ours, hf = ours.to(device=device, dtype=dtype), hf.to(device=device, dtype=dtype)
    gen = Generator(ours, tok, DecodeChoice())
    rows = prompts(tok, 1)
    sides = (('gptkit', lambda: run_ours(gen, rows, new)), ('transformers', lambda: run_hf(hf, rows, new, tok.eod)))
    for name, fn in sides:
        fn()
        prof, wall = profiled(fn, 1)
        summary(f'decode {preset} batch 1, {name}', prof, wall, new, 'token')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--preset', default='125m')
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--new', type=int, default=32)
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    a = ap.parse_args()
    if a.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: this torch sees no CUDA GPU')
    host_costs(a.device)
    decode(a.preset, a.new, a.device)
    train_steps(a.preset, a.batch, a.device)


if __name__ == '__main__':
    main()
