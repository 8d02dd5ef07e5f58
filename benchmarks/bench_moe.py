"""Mixture of experts on CPU: `moe-tiny` against transformers' Mixtral of the same shapes (issue 32, item 7).

Targets: a training step >= 1.3x transformers' (same shapes, batch, dtype and optimizer, same process), and greedy
generation at batch 1 and 8 >= 1.3x `generate` with the same tokens (the same weights: gptkit's model exported with
`gptkit.interop.hf.to_hf` into MixtralForCausalLM, logits checked equal first; bench_generate.py's prompts and timing).
Both models: moe-tiny's shapes as Mixtral has them (RMSNorm, rotary, SwiGLU experts, grouped-query attention, untied
output), 8 experts, 2 per token, softmax over all experts then the top 2 renormalised, the load-balancing loss at
coefficient 0.01 in the loss on both sides (Mixtral's `output_router_logits=True`), no dropout, fp32, AdamW (lr 1e-4,
betas 0.9/0.95, weight decay 0.1 on matrices, gradient clipping 1.0). gptkit runs as `gptkit train` runs it (DeepSpeed
engine, ZeRO 0) and as a bare model in the same plain PyTorch loop as transformers. Rounds alternate between the
contenders so that machine noise hits all of them alike; the median per-step time wins.
moe-tiny's shapes are the preset's own, vocabulary 50,257 (GPT-2's tokenizer) included; `--vocab 8192` gives the
smaller vocabulary this benchmark used before (a quickstart tokenizer is 4,096), where the output layer is a smaller
share of the step.
Run: .venv/bin/python benchmarks/bench_moe.py [--vocab 8192] [--batch 8] [--rounds 5] [--steps 5] [--new 64]
[--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def mixtral(m, device, dtype, aux_loss: bool = True):
    "transformers' Mixtral with the shapes of gptkit's ModelConfig `m` (and its load-balancing loss in training)"
    from transformers import MixtralConfig, MixtralForCausalLM
    c = MixtralConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.expert_ffn,
                      num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv,
                      max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                      num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, tie_word_embeddings=False,
                      output_router_logits=aux_loss, router_aux_loss_coef=m.moe_aux_loss_coef, attention_dropout=0.0,
                      sliding_window=None)
    c._attn_implementation = 'sdpa'
    return MixtralForCausalLM(c).to(device=device, dtype=dtype).train()


def adamw(model):
    from gptkit.train.optim import param_groups
    return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def plain(model, opt, loss_of):
    "One step of the plain PyTorch loop: forward, backward, clipping, AdamW"
    def step():
        loss = loss_of(model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed(contenders: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    "Seconds per step of each contender, per round, the rounds alternating between them"
    times = {k: [] for k in contenders}
    for fn in contenders.values():
        for _ in range(2):
            fn()                                        # warm-up
    for _ in range(rounds):
        for name, fn in contenders.items():
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t) / steps)
    return times


def generation(m, new: int, rounds: int):
    "Greedy generation at batch 1 and 8: gptkit's generator against `generate` on the same weights"
    from bench_generate import bench_batch
    from safetensors.torch import save_file
    from transformers import MixtralForCausalLM

    from gptkit.inference.generator import Generator
    from gptkit.interop.hf import to_hf
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import gpt2
    tok = gpt2()
    tok.encode = (lambda enc: lambda text: [i % m.vocab for i in enc(text)])(tok.encode)   # GPT-2's ids folded in
    tok.eod = m.vocab - 1
    torch.manual_seed(0)
    ours = GPT(m).eval()
    with tempfile.TemporaryDirectory() as d:     # transformers reads the per-expert tensors of a Hub file
        mixtral(m, torch.device('cpu'), torch.float32, aux_loss=False).save_pretrained(d)
        for f in Path(d).glob('model*.safetensors*'):
            f.unlink()
        save_file({k: v.contiguous() for k, v in to_hf(ours.state_dict(), m).items()}, f'{d}/model.safetensors',
                  metadata={'format': 'pt'})
        hf = MixtralForCausalLM.from_pretrained(d, attn_implementation='sdpa').eval()
    ids = torch.randint(0, m.vocab, (2, 40))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
    assert err < 1e-4, f'the two models disagree: max |logit difference| {err}'
    print(f'generation: the same weights in both (max |logit difference| {err:.1e})')
    gen = Generator(ours, tok)
    return [bench_batch(gen, hf, tok, batch, new, rounds) for batch in (1, 8)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--vocab', type=int, help="the vocabulary (default: the preset's own, 50,257)")
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--steps', type=int, default=5, help='steps per round')
    ap.add_argument('--new', type=int, default=64, help='greedy tokens generated per sequence')
    ap.add_argument('--skip-generation', action='store_true')
    ap.add_argument('--threads', type=int, help="torch's CPU threads (default: torch's own, one per core)")
    a = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    if a.threads:
        torch.set_num_threads(a.threads)      # one thread: steadier ratios on a machine other jobs share

    from gptkit.train.engine import build_engine, init_distributed
    from gptkit.model.decoder import GPT
    from gptkit.config.run import resolve

    vocab = [f'model.vocab={a.vocab}'] if a.vocab else []
    cfg = resolve('moe-tiny', sets=[*vocab, 'model.dropout=0', f'train.micro_batch={a.batch}',
                                    f'train.global_batch={a.batch}', 'train.precision=fp32', 'optim.lr=1e-4',
                                    'optim.warmup=0'])
    m = cfg.model
    init_distributed()
    torch.manual_seed(0)
    engine, _ = build_engine(cfg, GPT(m), iters=10**6)
    bare = GPT(m).train()
    bare_opt = adamw(bare)
    hf = mixtral(m, torch.device('cpu'), torch.float32)
    hf_opt = adamw(hf)
    data = torch.randint(0, m.vocab, (a.batch, m.seq_len + 1))
    x, y = data[:, :-1], data[:, 1:]

    def on_engine():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    contenders = {'gptkit (DeepSpeed engine)': on_engine,
                  'gptkit model, plain loop': plain(bare, bare_opt, lambda mdl: mdl(x, y)),
                  'transformers MixtralForCausalLM': plain(hf, hf_opt, lambda mdl: mdl(input_ids=x, labels=x).loss)}
    times = timed(contenders, a.rounds, a.steps)
    tokens = a.batch * m.seq_len
    print(f'moe-tiny: {m.layers} layers, hidden {m.hidden}, {m.moe_experts} experts of {m.expert_ffn}, '
          f'top {m.moe_top_k}, '
          f'context {m.seq_len}, vocab {m.vocab}; batch {a.batch}, fp32, cpu, {torch.get_num_threads()} threads; '
          f'{a.rounds} rounds x {a.steps} steps')
    ref = statistics.median(times['transformers MixtralForCausalLM'])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f'  {name:32s} {t * 1000:8.1f} ms/step  {tokens / t:10,.0f} tokens/s  '
              f'ratio vs transformers {ref / t:.2f}x')
    if not a.skip_generation:
        generation(m, a.new, a.rounds)


if __name__ == '__main__':
    main()
