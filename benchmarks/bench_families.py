"""What each change from GPT to Llama does to held-out loss at equal compute, on the built-in corpus, on this CPU.

The `tiny` GPT preset (2 layers, hidden 128, 4 heads, context 256) is changed one step at a time into `llama-tiny`:
rotary positions, RMSNorm, SwiGLU (8h/3 wide: the GELU MLP's parameters), 2 KV heads, no biases, untied embeddings.
Every model trains the same steps on the same batches (same seed, same data order) with the tiny recipe, so each
sees the same tokens at (nearly) the same FLOPs per token, printed beside it; the held-out loss is measured on the
quickstart's held-out text (the first 24 articles of the built-in Wikipedia sample, never trained on). A second seed
of the GPT baseline shows how much of a difference is noise.

Run: .venv/bin/python benchmarks/bench_families.py [--iters 300] [--out bench-families] [--plot nbs/images/families.png]
(about 35 minutes on two cores); --from-json benchmarks/results/families.json redraws the plot of a run.

--moe (issue 32, item 7): `moe-tiny` (4 layers, hidden 128, 8 SwiGLU experts 128 wide, top 2) against the dense model
of equal active parameters: the same preset with one SwiGLU MLP 256 wide (k x 128) in place of each MoE layer, so a
token meets the same MLP parameters (2 x 3 x 128 x 128 = 98,304 a layer) and only the router (8 x 128 a layer) is
extra; same recipe, steps, batches and tokens, two seeds each. Writes families_moe.json and its plot (held-out and
validation loss, and each run's training loss against tokens):
.venv/bin/python benchmarks/bench_families.py --moe [--iters 300] --plot nbs/images/families_moe.png
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

STEPS = [('GPT (tiny)', {}), ('+ rotary', {'position': 'rotary'}), ('+ RMSNorm', {'norm': 'rmsnorm'}),
         ('+ SwiGLU', {'activation': 'swiglu'}), ('+ 2 KV heads', {'kv_heads': 2}), ('+ no biases', {'bias': False}),
         ('+ untied = llama-tiny', {'tie_embeddings': False})]
HELD_OUT_ARTICLES = 24
MOE_RUNS = [('dense, equal active', {'moe_experts': 0, 'ffn_hidden': 256}), ('moe-tiny', {})]


def data(out: Path, vocab: int = 4096) -> tuple[str, str]:
    "(dataset prefix, tokenizer folder) of the built-in corpus, built once"
    from gptkit.data.corpus import DEFAULT_CORPUS, clean_text, read_documents
    from gptkit.data.prepare import PrepareConfig, prepare
    from gptkit.tokenizer.bpe import save_tokenizer, train_bpe
    prefix = out / 'data' / 'corpus_text_document'
    if not Path(f'{prefix}.idx').is_file():
        save_tokenizer(train_bpe((clean_text(d.text) for d in read_documents(DEFAULT_CORPUS)),
                                 vocab), out / 'tokenizer')
        prepare(PrepareConfig(inputs=DEFAULT_CORPUS, output_prefix=str(out / 'data' / 'corpus'),
                              tokenizer=str(out / 'tokenizer')))
    return str(prefix), str(out / 'tokenizer')


def run(name: str, model: dict, seed: int, iters: int, prefix: str, tok_dir: str, out: Path, held: list[int],
        preset: str = 'tiny') -> dict:
    from gptkit.estimate.sizing import count_params, flops_per_iteration
    from gptkit.eval.perplexity import text_loss
    from gptkit.estimate.moe import active_params
    from gptkit.train.plan import run_config
    from gptkit.train.loop import train
    reports = max(1, iters // (10 if preset == 'tiny' else 30))
    folder = f'run-{len(model)}-{seed}' if preset == 'tiny' else f'run-{preset}-{len(model)}-{seed}'
    cfg = run_config(preset, sets=[f'train.iters={iters}', f'train.eval_interval={iters}', 'train.eval_iters=4',
                                   f'train.log_interval={reports}', 'optim.warmup=0.05', f'train.seed={seed}'],
                     overrides={'model': model, 'data': {'prefix': prefix, 'tokenizer': tok_dir}},
                     out=str(out / folder))
    t = time.perf_counter()
    result = train(cfg)
    loss = text_loss(result.engine.module, held, cfg.model.seq_len)
    row = {'name': name, 'seed': seed, 'model': model, 'held_out_loss': loss, 'valid_loss': result.valid_loss,
            'parameters': count_params(cfg.model).total, 'seconds': time.perf_counter() - t,
            'flops_per_token': flops_per_iteration(cfg.model, 1) / cfg.model.seq_len,
            'tokens': iters * cfg.tokens_per_step}
    if preset == 'tiny':
        return row
    rows = [json.loads(line) for line in (Path(cfg.out) / 'metrics.jsonl').read_text().splitlines()]
    curve = [(r['iteration'], r['loss']) for r in rows if r.get('kind') == 'train']
    return {**row, 'active_parameters': active_params(cfg.model, row['parameters']), 'train_curve': curve}


def plot(rows: list[dict], path: Path):
    "Held-out and validation loss of each step (seed 0), with the GPT baseline's second seed as the noise mark"
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    main, other = [r for r in rows if r['seed'] == 0], [r for r in rows if r['seed'] == 1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in zip(axes, ('valid_loss', 'held_out_loss'),
                              ('validation split (in domain)', 'held-out Wikipedia text (out of domain)')):
        ax.plot(range(len(main)), [r[key] for r in main], 'o-', label='seed 0')
        if other:
            ax.plot([0], [other[0][key]], 'x', color='gray', ms=9, label='GPT, seed 1')
        ax.set_xticks(range(len(main)), [r['name'] for r in main], rotation=25, ha='right', fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel('loss (nats/token)')
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT tiny -> llama-tiny, one change at a time, {main[0]['tokens']:,} tokens each (CPU)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def plot_moe(rows: list[dict], path: Path):
    "Training loss against tokens of each run; the validation and held-out losses of each model, one mark a seed"
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = list(dict.fromkeys(r['name'] for r in rows))
    per_step = rows[0]['tokens'] / rows[0]['train_curve'][-1][0]
    for r in rows:
        i = names.index(r['name'])
        it, loss = zip(*r['train_curve'])
        axes[0].plot([k * per_step / 1e6 for k in it], loss, color=f'C{i}', ls='-' if r['seed'] == 0 else ':',
                     label=f"{r['name']}, seed {r['seed']}")
        for ax, key in zip(axes[1:], ('valid_loss', 'held_out_loss')):
            ax.plot([i], [r[key]], 'o' if r['seed'] == 0 else 'x', color=f'C{i}', ms=8)
    last = min(loss for r in rows for _, loss in r['train_curve'])
    axes[0].set_ylim(last - 0.1, last + 1.5)
    axes[0].set_xlabel('tokens trained (millions)')
    axes[0].set_title('training loss (solid: seed 0, dotted: seed 1)', fontsize=10)
    axes[0].legend(fontsize=8)
    first = {n: next(r for r in rows if r['name'] == n) for n in names}
    ticks = [f"{n}\n{first[n]['parameters'] / 1e6:.2f}M params, {first[n]['active_parameters'] / 1e6:.2f}M active"
             for n in names]
    for ax, title in zip(axes[1:], ('validation split (in domain)', 'held-out Wikipedia text (out of domain)')):
        ax.set_xticks(range(len(names)), ticks, fontsize=8)
        ax.set_xlim(-0.5, len(names) - 0.5)
        ax.set_title(title, fontsize=10)
    for ax in axes:
        ax.set_ylabel('loss (nats/token)')
        ax.grid(alpha=0.3)
    fig.suptitle(f"moe-tiny against the dense model of equal active parameters, {rows[0]['tokens']:,} tokens each "
                 "(CPU)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--iters', type=int, default=300)
    ap.add_argument('--out', type=Path, default=Path('bench-families'))
    ap.add_argument('--plot', type=Path, default=Path('nbs/images/families.png'))
    ap.add_argument('--from-json', type=Path, help='Only draw the plot of the results in this families.json.')
    ap.add_argument('--moe', action='store_true', help='moe-tiny against the dense model of equal active parameters')
    a = ap.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    draw = plot_moe if a.moe else plot
    if a.from_json:
        return draw(json.loads(a.from_json.read_text()), a.plot)
    from gptkit.data.corpus import HELD_OUT, clean_text, read_documents
    from gptkit.tokenizer.bpe import load_tokenizer
    prefix, tok_dir = data(a.out)
    tok = load_tokenizer(tok_dir)
    held = []
    for d in list(read_documents([HELD_OUT]))[:HELD_OUT_ARTICLES]:
        held += tok.encode(clean_text(d.text)) + [tok.eod]
    rows, model = [], {}
    if a.moe:
        for seed in (0, 1):
            for name, model in MOE_RUNS:
                rows.append(run(name, model, seed, a.iters, prefix, tok_dir, a.out, held, preset='moe-tiny'))
                r = rows[-1]
                print(f"{r['name']:20} seed {seed}  held-out loss {r['held_out_loss']:.4f}  "
                      f"valid {r['valid_loss']:.4f}  "
                      f"{r['parameters']:>9,} parameters, {r['active_parameters']:>9,} active  "
                      f"{r['flops_per_token'] / 1e6:6.2f} MFLOP/token  {r['seconds']:5.1f} s", flush=True)
                (a.out / 'families_moe.json').write_text(json.dumps(rows, indent=1))    # each run as it ends
        plot_moe(rows, a.plot)
        return print(f'wrote {a.out / "families_moe.json"} and {a.plot}')
    for i, (name, change) in enumerate(STEPS):
        model = {**model, **change}
        for seed in (0, 1) if i == 0 else (0,):
            rows.append(run(name, dict(model), seed, a.iters, prefix, tok_dir, a.out, held))
            r = rows[-1]
            print(f"{r['name']:24} seed {r['seed']}  held-out loss {r['held_out_loss']:.4f}  "
                  f"valid {r['valid_loss']:.4f}  {r['parameters']:>9,} parameters  "
                  f"{r['flops_per_token'] / 1e6:6.2f} MFLOP/token  {r['seconds']:5.1f} s", flush=True)
    (a.out / 'families.json').write_text(json.dumps(rows, indent=1))
    plot(rows, a.plot)
    print(f'wrote {a.out / "families.json"} and {a.plot}')


if __name__ == '__main__':
    main()
