"""lm-evaluation-harness speed: gptkit's model class (`gptkit.eval.harness.GptkitLM`) on a checkpoint against lm-eval's own
`HFLM` on the Hugging Face export of the same checkpoint.

Target (issue 34, item 4): gptkit at least as fast as HFLM (ratio >= 1.0x), same metrics.
Both sides: the same weights (a random GPT-2-architecture model with GPT-2's tokenizer, written as a gptkit run and
exported with `gptkit.interop.hf.export_hf`), the same dtype, the same batch size, and the same three local tasks as
tests/data/harness with more rows, made here from the built-in KJV: multiple choice (4 choices of two words:
loglikelihood), the next word of a verse (generate_until, greedy, at most --gen-toks tokens, stop at '\\n' or '.'),
and perplexity of passages longer than the context (loglikelihood_rolling). Timed: lm-eval's `evaluate` (requests,
model calls, metrics), not loading; the tasks are read beforehand. Rounds alternate between the two so that machine
noise hits both alike; the median round of each is compared. Every metric is checked equal (1e-4) first.
Run: .venv/bin/python benchmarks/bench_harness.py [--rows 200] [--batch-size 16] [--rounds 3] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ('kjv_choice', 'kjv_complete', 'kjv_verses')


def verses() -> list[str]:
    "KJV verses of 8 to 30 words, shuffled with a fixed seed"
    from gptkit.data.corpus import read_documents
    out = []
    for d in read_documents(['builtin:kjv']):
        for line in d.text.splitlines():
            m = re.match(r'^\d+ (.+)$', line.strip())
            if m and 8 <= len(m[1].split()) <= 30:
                out.append(m[1])
    random.Random(0).shuffle(out)
    return out


def write_tasks(folder: Path, rows: int, gen_toks: int) -> Path:
    "The three tasks of tests/data/harness, with `rows` rows each (passages: rows // 4), in `folder`"
    vs, rng = verses(), random.Random(1)
    lines = {'kjv_choice': [], 'kjv_complete': [], 'kjv_verses': []}
    for i, v in enumerate(vs[:rows]):
        w, label = v.split(), i % 4
        k = rng.randrange(4, len(w) - 2)
        others = [rng.choice(vs).split() for _ in range(3)]
        wrong = [' '.join(o[(j := rng.randrange(1, len(o) - 2)):j + 2]) for o in others]
        choices = wrong[:label] + [' '.join(w[k:k + 2])] + wrong[label:]
        lines['kjv_choice'].append({'context': ' '.join(w[:k]), 'choices': choices, 'label': label})
    for v in vs[rows:2 * rows]:
        w = v.split()
        k = rng.randrange(3, len(w) - 1)
        lines['kjv_complete'].append({'prompt': ' '.join(w[:k]), 'answer': w[k]})
    passages = vs[2 * rows:2 * rows + rows // 4 * 12]
    lines['kjv_verses'] = [{'text': ' '.join(passages[i:i + 12])} for i in range(0, len(passages), 12)]
    for name, rows_ in lines.items():
        (folder / f'{name}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows_))
        yaml = (ROOT / 'tests' / 'data' / 'harness' / f'{name}.yaml').read_text()
        (folder / f'{name}.yaml').write_text(yaml.replace('max_gen_toks: 12', f'max_gen_toks: {gen_toks}'))
    return folder


def checkpoint(folder: Path, layers: int, hidden: int, seq_len: int) -> tuple[Path, Path]:
    "(gptkit run, its Hugging Face export) of a random GPT-2-architecture model with GPT-2's tokenizer"
    from gptkit.config.sections import ModelConfig
    from gptkit.interop.hf import export_hf, write_run
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import gpt2
    tok = gpt2()
    torch.manual_seed(0)
    cfg = ModelConfig(layers=layers, hidden=hidden, heads=hidden // 64, seq_len=seq_len, vocab=tok.vocab_size,
                      dropout=0.0)
    run = write_run(GPT(cfg).state_dict(), cfg, tok, folder / 'run', 'a random GPT')
    return run, export_hf(run, folder / 'hf')


def timed(lm, tm, specs) -> tuple[float, dict]:
    "Seconds lm-eval's evaluate takes on `lm` (tasks read before the clock starts), and its results"
    from lm_eval import evaluator

    from gptkit.eval.harness import load_tasks
    loaded = tm.load(load_tasks(tm, specs))                 # fresh Task objects: lm-eval keeps requests on them
    start = time.perf_counter()
    res = evaluator.evaluate(lm=lm, task_dict=loaded, bootstrap_iters=0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rows', type=int, default=200, help='examples in each task (passages: a quarter)')
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--gen-toks', type=int, default=16)
    p.add_argument('--layers', type=int, default=4)
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--seq-len', type=int, default=256)
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--device', default='cpu')
    p.add_argument('--threads', type=int, default=None, help='torch threads on a CPU (default: as torch chooses)')
    a = p.parse_args()
    from gptkit.machine.cpu import this_cpu
    print(this_cpu().summary())   # ratios hold for this machine class only
    if a.threads:
        torch.set_num_threads(a.threads)
    from gptkit.eval.harness import find_tasks, lm_class, metric_rows, require_lm_eval
    require_lm_eval(offline=True)
    import logging
    logging.getLogger('lm_eval').setLevel(logging.ERROR)
    from lm_eval.models.huggingface import HFLM

    from gptkit.inference.generator import Generator
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / 'tasks').mkdir()
        tasks = write_tasks(d / 'tasks', a.rows, a.gen_toks)
        run, hf = checkpoint(d, a.layers, a.hidden, a.seq_len)
        gen = Generator.from_checkpoint(run, device=a.device, dtype=torch.float32)
        ours = lm_class()(gen, a.batch_size, 256)
        theirs = HFLM(pretrained=str(hf), device=a.device, batch_size=a.batch_size, dtype='float32')
        tm, specs = find_tasks(','.join(TASKS), tasks)
        times = {'gptkit': [], 'HFLM': []}
        results = {}
        timed(ours, tm, specs)                                  # warm-up: first calls, caches
        timed(theirs, tm, specs)
        for _ in range(a.rounds):
            for name, lm in (('gptkit', ours), ('HFLM', theirs)):
                seconds, results[name] = timed(lm, tm, specs)
                times[name].append(seconds)
        want = {r[:2]: r[2] for r in metric_rows(results['HFLM'])}
        got = {r[:2]: r[2] for r in metric_rows(results['gptkit'])}
        bad = [k for k in want if abs(got.get(k, float('nan')) - want[k]) > 1e-4 * max(1.0, abs(want[k]))]
        print(f'model: {a.layers} layers, hidden {a.hidden}, context {a.seq_len}, vocabulary {gen.tok.vocab_size:,}; '
              f'{a.device}, fp32, batch {a.batch_size}, torch threads {torch.get_num_threads()}')
        n = {t: results['HFLM']['n-samples'][t]['effective'] for t in TASKS}
        print('tasks: ' + ', '.join(f'{t} {k} examples' for t, k in n.items()))
        for (task, metric), v in want.items():
            print(f'  {task:14s} {metric:16s} HFLM {v:.6g}  gptkit {got.get((task, metric), float("nan")):.6g}')
        if bad:
            print(f'metrics differ: {bad}')
            sys.exit(1)
        for name, ts in times.items():
            print(f'{name:7s} ' + '  '.join(f'{t:.2f} s' for t in ts) + f'   median {statistics.median(ts):.2f} s')
        ratio = statistics.median(times['HFLM']) / statistics.median(times['gptkit'])
        print(f'gptkit is {ratio:.2f}x as fast as HFLM (target >= 1.0x)')


if __name__ == '__main__':
    main()
