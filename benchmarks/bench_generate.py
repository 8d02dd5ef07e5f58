"""Generation speed: gptkit's KV-cache generator against Hugging Face `generate` on the same weights, and the server under 16 clients.

Target (issues 5, 35): gptkit tokens/s >= 1.5x transformers `generate` on CPU at batch 1 and >= 1.2x at batch 8, on
every machine class (the CPU and its features are printed first).
Both sides: the same GPT-2-architecture weights (gptkit's model exported with `gptkit.interop.hf.to_hf`, logits
checked equal first), in one dtype: the one gptkit's measurement picks (issue 35: fp32 or bf16, `--dtype` to force
one), with the layout it measured for it; greedy decoding of exactly --new tokens per sequence (end of document ignored), and
the batch-8 prompts of different lengths (left-padded with an attention mask on both sides). The greedy tokens are
compared too: a faster generator that produced other tokens would not count. Rounds alternate between the two so
that machine noise hits both alike; the median round wins.

Server (issue 18): `gptkit.serve.server.Server` over real HTTP on 127.0.0.1; 16 clients each ask /v1/completions for new/8 to
--new greedy tokens, sent one after another, all at once, and arriving at twice the rate one at a time serves them;
continuous batching against the batching gptkit had before (`Limits(continuous=False)`), both in the same run:
throughput and p50/p99 latency.
Run: .venv/bin/python benchmarks/bench_generate.py [--preset small] [--new 128] [--rounds 3] [--dtype auto]
     [--device cpu] (--device cuda: both sides on the GPU, bf16 unless --dtype says otherwise)
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def models(preset: str, vocab: int | None):
    from transformers import GPT2Config, GPT2LMHeadModel
    from gptkit.interop.hf_config import config_to_hf
    from gptkit.interop.hf import to_hf
    from gptkit.config.sections import PRESETS
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import gpt2
    tok = gpt2()
    cfg = PRESETS[preset].model.__class__(**{**PRESETS[preset].model.to_dict(), 'vocab': vocab or tok.vocab_size, 'dropout': 0.0, 'seq_len': 1024})
    if vocab:                         # a smaller BPE (like the quickstart's): GPT-2's ids above it are folded in
        tok.encode = (lambda enc: lambda text: [i % vocab for i in enc(text)])(tok.encode)
        tok.eod = vocab - 1
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    c = GPT2Config(**{k: v for k, v in config_to_hf(cfg, tok.eod).items() if k not in ('architectures', 'model_type', 'dtype')})
    c._attn_implementation = 'sdpa'
    hf = GPT2LMHeadModel(c).eval()
    missing, unexpected = hf.load_state_dict(to_hf(ours.state_dict(), cfg), strict=False)
    assert not unexpected and all('lm_head' in m or 'attn.bias' in m for m in missing), (missing, unexpected)
    hf.tie_weights()
    ids = torch.randint(0, cfg.vocab, (2, 40))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
    assert err < 1e-4, f'the two models disagree: max |logit difference| {err}'
    return ours, hf, tok, cfg, err


def prompts(tok, batch: int) -> list[list[int]]:
    text = ('In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness '
            'was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there be light.')
    ids = tok.encode(text)
    return [ids[:32]] if batch == 1 else [ids[:16 + 4 * i] for i in range(batch)]


def run_ours(gen, rows, new):
    from gptkit.inference.sampling import Sampling
    out = [[] for _ in rows]
    for c in gen.stream(rows, Sampling(max_new_tokens=new, greedy=True, stop_at_eod=False)):
        if c.token is not None: out[c.index].append(c.token)
    return out


def run_hf(hf, rows, new, pad):
    n = max(map(len, rows))
    ids = torch.tensor([[pad] * (n - len(r)) + r for r in rows], device=hf.device)
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows], device=hf.device)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                          pad_token_id=pad, eos_token_id=None)
    return out[:, n:].tolist()


def bench_batch(gen, hf, tok, batch, new, rounds):
    rows = prompts(tok, batch)
    ours_t, hf_t = [], []
    a, b = run_ours(gen, rows, 4), run_hf(hf, rows, 4, tok.eod)          # warm up both
    for _ in range(rounds):
        t0 = time.perf_counter(); a = run_ours(gen, rows, new); ours_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); b = run_hf(hf, rows, new, tok.eod); hf_t.append(time.perf_counter() - t0)
    same = sum(x == y for x, y in zip(a, b))
    tokens = batch * new
    o, h = tokens / statistics.median(ours_t), tokens / statistics.median(hf_t)
    print(f'batch {batch}: gptkit {o:,.0f} tokens/s, transformers generate {h:,.0f} tokens/s -> {o / h:.2f}x '
          f'(greedy sequences identical: {same}/{batch}; medians of {rounds} rounds of {new} new tokens)')
    return o / h


def bench_server(gen, new):
    """16 clients, each asking for a different number of greedy tokens (new/8 to new), against a server with the
    batching gptkit had before (`Limits(continuous=False)`: the requests waiting together, if they sample alike, run
    to their end before the next) and with continuous batching, in the same run: the 16 sent one after another, all
    at once, and arriving one every `gap` seconds. Throughput, and each client's latency (p50, p99, max)"""
    import httpx
    from gptkit.inference.batching import Limits
    from gptkit.serve.server import Server
    words = ('God', 'the', 'it', 'he', 'they', 'Moses', 'Jesus', 'she', 'we', 'I', 'thou', 'ye', 'all', 'there', 'when', 'so')
    lengths = [max(1, new * (1 + i * 5 % 8) // 8) for i in range(len(words))]     # mixed: new/8 ... new, shuffled
    bodies = [{'prompt': f'And {w} said', 'max_tokens': n, 'temperature': 0} for w, n in zip(words, lengths)]

    def clients(url, gap):
        latency, errors, made, texts = [], [], [], {}
        def ask(i, body):
            time.sleep(i * gap)
            s = time.perf_counter()
            r = httpx.post(url + '/v1/completions', json=body, timeout=600)
            latency.append(time.perf_counter() - s)
            if r.status_code != 200: errors.append(r.text); return
            made.append(r.json()['usage']['completion_tokens']); texts[i] = r.json()['choices'][0]['text']
        threads = [threading.Thread(target=ask, args=(i, b)) for i, b in enumerate(bodies)]
        t0 = time.perf_counter()
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors[0]
        return sum(made) / (time.perf_counter() - t0), latency, texts

    results, texts, gap = {}, {}, None
    for continuous in (False, True):
        with Server(gen, Limits(max_new_tokens=new, max_prompts=16, max_batch=16, max_waiting=64,
                                continuous=continuous)) as url:
            httpx.post(url + '/v1/completions', json=bodies[0], timeout=120)              # warm up
            t0, made = time.perf_counter(), 0
            for body in bodies: made += httpx.post(url + '/v1/completions', json=body, timeout=600).json()['usage']['completion_tokens']
            one = time.perf_counter() - t0
            gap = gap or one / len(bodies) / 2          # arrivals twice as fast as one at a time serves them (the
            for name, g in (('all at once', 0.0), ('staggered', gap)):   # same schedule for both)
                rate, latency, texts[continuous, name] = clients(url, g)
                results[continuous, name] = rate, latency
        results[continuous, 'one after another'] = made / one, None
    same = all(texts[False, k] == texts[True, k] for _, k in texts)
    print(f'server, 16 clients asking {min(lengths)}-{max(lengths)} greedy tokens each ({sum(lengths)} in all); '
          f'the same texts either way: {same}; staggered: one every {gap * 1000:.0f} ms')
    for name in dict.fromkeys(k for _, k in results):
        line = f'  {name:>18}:'
        for continuous in (False, True):
            rate, latency = results[continuous, name]
            line += f'  {"continuous" if continuous else "before"} {rate:,.0f} tokens/s'
            if latency:
                q = statistics.quantiles(latency, n=100, method='inclusive')
                line += f' (p50 {q[49]:.2f} s, p99 {q[98]:.2f} s)'
        base, now = results[False, name][0], results[True, name][0]
        print(f'{line}  -> {now / base:.2f}x')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--preset', default='small')
    ap.add_argument('--new', type=int, default=128)
    ap.add_argument('--vocab', type=int, default=None, help="vocabulary size (default GPT-2's 50,257)")
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--skip-server', action='store_true')
    ap.add_argument('--server-only', action='store_true', help='only the server part (no transformers comparison)')
    ap.add_argument('--dtype', default='auto', choices=['auto', 'fp32', 'bf16'],
                    help="auto: the dtype gptkit's measurement picks (transformers then runs in the same one); "
                         'on a GPU bf16')
    ap.add_argument('--device', default='cpu', choices=['cpu', 'cuda'], help='cuda: both sides on the GPU')
    a = ap.parse_args()
    if a.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: this torch sees no CUDA GPU')
    from gptkit.inference.decode import choose_decode
    from gptkit.inference.generator import Generator
    from gptkit.machine.cpu import this_cpu
    ours, hf, tok, cfg, err = models(a.preset, a.vocab)
    import transformers
    print(this_cpu().summary())
    if a.device == 'cuda':              # the GPU decodes through the modules, in bf16 unless told otherwise
        choice, name = None, a.dtype if a.dtype != 'auto' else 'bf16'
        where = f'{name} on {torch.cuda.get_device_name()}'
    else:
        choice = choose_decode(ours, ('fp32', 'bf16') if a.dtype == 'auto' else (a.dtype,))
        name, where = choice.dtype, f'{choice.dtype} on CPU'
    dtype = torch.bfloat16 if name == 'bf16' else torch.float32
    ours, hf = ours.to(device=a.device, dtype=dtype), hf.to(device=a.device, dtype=dtype)
    print(f'{a.preset}: {cfg.layers} layers, hidden {cfg.hidden}, vocabulary {cfg.vocab:,}; {where} (both sides), '
          f'{torch.get_num_threads()} threads; torch {torch.__version__}, transformers {transformers.__version__}; '
          f'max |logit difference| {err:.1e} (fp32)')
    if choice is not None:
        print(f'gptkit {choice.why}')
    gen = Generator(ours, tok, choice)
    for batch in () if a.server_only else (1, 8): bench_batch(gen, hf, tok, batch, a.new, a.rounds)
    if not a.skip_server: bench_server(gen, a.new)


if __name__ == '__main__':
    main()
