"""Training throughput: gptkit's GPT on its DeepSpeed engine against Hugging Face `GPT2LMHeadModel`, same process.

Target (issue 17): gptkit tokens/s >= 1.3x transformers on CPU, with the same shape, batch, dtype and optimizer. Both models: GPT-2 architecture, exact GELU, SDPA attention, no dropout, fp32, AdamW (lr 1e-4, betas
0.9/0.95, weight decay 0.1 on matrices, gradient clipping 1.0). gptkit runs the way `gptkit train` runs it (DeepSpeed
engine, ZeRO 0, fused AdamW), eager and with `train.compile` (each block compiled by torch.compile, which happens in
the warm-up steps); the bare gptkit model under the same plain PyTorch loop as transformers is also reported.
Rounds alternate between the contenders so that machine noise hits all of them alike; the median per-step time wins.

MFU inputs are printed: model FLOPs per step (Narayanan et al.), step time, and the device's dense peak when known,
so the same script reports MFU on a GPU (--device cuda --dtype bf16).
Run: .venv/bin/python benchmarks/bench_train.py [--preset small] [--vocab 8192] [--batch 8] [--rounds 5] [--steps 5]
     [--zero 0]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def hf_model(cfg, device, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel
    c = GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.seq_len, n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads,
                   n_inner=cfg.ffn, activation_function='gelu', resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                   tie_word_embeddings=True)
    c._attn_implementation = 'sdpa'
    return GPT2LMHeadModel(c).to(device=device, dtype=dtype).train()


def adamw(model, cuda: bool):
    from gptkit.train.optim import param_groups
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                             **({'fused': True} if cuda else {'foreach': True}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--preset', default='small')
    ap.add_argument('--vocab', type=int, default=8192)
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--steps', type=int, default=5, help='steps per round')
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--dtype', default='fp32', choices=['fp32', 'bf16', 'auto'],
                    help="auto: the precision gptkit measures faster on this CPU (transformers runs in the same)")
    ap.add_argument('--attention', default='auto', choices=['auto', 'fp32', 'same'],
                    help="gptkit's train.attention_precision (auto: fp32 where a CPU ran bf16 runs' attention faster so)")
    ap.add_argument('--zero', type=int, default=0, choices=[0, 1],
                    help="gptkit's ZeRO stage (DeepSpeed's bf16 wrapper at ZeRO 0 checks every gradient apart)")
    ap.add_argument('--glibc-defaults', action='store_true',
                    help="leave glibc's malloc as it is (gptkit train has it keep freed memory on a CPU)")
    a = ap.parse_args()
    if a.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: this torch sees no CUDA GPU')
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only

    from gptkit.train.engine import build_engine, init_distributed
    from gptkit.estimate.sizing import flops_per_iteration
    from gptkit.machine.pages import keep_freed_memory
    from gptkit.model.decoder import GPT, set_attention_precision
    from gptkit.config.run import resolve
    from gptkit.train.loop import peak_flops

    cfg = resolve(a.preset, sets=[f'model.vocab={a.vocab}', 'model.dropout=0', f'train.micro_batch={a.batch}',
                                  f'train.global_batch={a.batch}', f'train.precision={a.dtype}', 'optim.lr=1e-4', 'optim.warmup=0',
                                  f'train.attention_precision={a.attention}', f'parallel.zero={a.zero}'])
    from gptkit.machine.choices import settle_precision
    cfg, why = settle_precision(cfg)
    if why:
        print(why)
    a.dtype = cfg.train.precision
    m, dev = cfg.model, torch.device(a.device)
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(a.dtype, torch.float32)
    cuda = dev.type == 'cuda'
    init_distributed()
    if dev.type == 'cpu' and not a.glibc_defaults:   # as `gptkit train` does on a CPU; process-wide: both sides gain
        print(f'glibc keeps freed memory for the next step (both sides): {keep_freed_memory()}')

    def ours(model):            # the attention precision settled above (auto: measured), as `gptkit train` sets it
        set_attention_precision(model, cfg.train.attention_precision)
        return model

    torch.manual_seed(0)
    engine, _ = build_engine(cfg, ours(GPT(m)), iters=10**6)
    torch.manual_seed(0)
    compiled, _ = build_engine(cfg, ours(GPT(m).compile_blocks()), iters=10**6)
    bare = ours(GPT(m).to(device=dev, dtype=dtype).train()); bare_opt = adamw(bare, cuda)
    hf = hf_model(m, dev, dtype); hf_opt = adamw(hf, cuda)
    data = torch.randint(0, m.vocab, (a.batch, m.seq_len + 1), device=dev)
    x, y = data[:, :-1], data[:, 1:]

    def on(e):
        def step():
            loss = e(x, y); e.backward(loss); e.step()
        return step

    def plain(model, opt, fn):
        def step():
            loss = fn(model); loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad(set_to_none=True)
        return step

    contenders = {
        'gptkit (DeepSpeed engine)': on(engine),
        'gptkit (engine, train.compile)': on(compiled),
        'gptkit model, plain loop': plain(bare, bare_opt, lambda mdl: mdl(x, y)),
        'transformers GPT2LMHeadModel': plain(hf, hf_opt, lambda mdl: mdl(input_ids=x, labels=x).loss),
    }
    times = {k: [] for k in contenders}
    for fn in contenders.values():
        for _ in range(2): fn()                      # warm-up
    for _ in range(a.rounds):
        for name, fn in contenders.items():
            if cuda: torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.steps): fn()
            if cuda: torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) / a.steps)

    tokens = a.batch * m.seq_len
    flops = flops_per_iteration(m, a.batch)
    peak = peak_flops(dev.type, a.dtype)
    print(f'{a.preset}: {m.layers} layers, hidden {m.hidden}, heads {m.heads}, context {m.seq_len}, vocab {m.vocab}; '
          f'batch {a.batch}, {a.dtype} (attention {cfg.train.attention_precision}), ZeRO {a.zero}, {a.device}, {torch.get_num_threads()} threads; {a.rounds} rounds x {a.steps} steps')
    print(f'MFU inputs: {flops / 1e9:.1f} GFLOP per step (model FLOPs, Narayanan et al.), {tokens} tokens per step, '
          f'device peak {"unknown (CPU)" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"}')
    ref = statistics.median(times['transformers GPT2LMHeadModel'])
    for name, ts in times.items():
        t = statistics.median(ts)
        mfu = f', MFU {flops / t / peak:.1%}' if peak else ''
        print(f'  {name:31s} {t * 1000:8.1f} ms/step  {tokens / t:10,.0f} tokens/s  {flops / t / 1e12:.3f} TFLOP/s{mfu}  '
              f'ratio vs transformers {ref / t:.2f}x')
    torch.distributed.destroy_process_group()


if __name__ == '__main__':
    main()
