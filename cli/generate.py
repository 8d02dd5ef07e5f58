"""`gptkit generate`: text from a checkpoint, streamed as it comes, from prompts, a file or an interactive prompt."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from gptkit.errors import ConfigError
from gptkit.files import read_text
from gptkit_cli import format as fmt
from gptkit_cli.app import app, err, flag, handles_errors, out, report, typed_prompts
from gptkit_cli.launch import join_tp, launch_tp

Opt = typer.Option


def _name(key: str) -> str:
    "Sampling keys as flags; 'FILE line N' stays as it is"
    return key if ' ' in key else flag(key)


PROMPT_FILE_BYTES = 64 * 2**20   # prompts read from one --prompt-file at most; more is a job for a script


def read_prompts(prompts: list[str], prompt_file: Optional[Path]) -> list[tuple[str, str]]:
    "(where, prompt) pairs from --prompt and --prompt-file (one prompt per line, \\n for a newline inside)"
    found = [('prompt', p) for p in prompts]
    if prompt_file is not None:
        lines = read_text(prompt_file, 'prompt_file', PROMPT_FILE_BYTES).splitlines()   # a regular file, size checked
        found += [(f'{prompt_file} line {i}', line.replace('\\n', '\n'))
                  for i, line in enumerate(lines, 1) if line.strip()]
        if not any(w != 'prompt' for w, _ in found):
            raise ConfigError([('prompt_file', f'{{key}} {prompt_file} holds no prompt (one per line)')])
    return found


def _sampling(**kw):
    from gptkit.inference.sampling import Sampling
    return Sampling(**kw)


MAX_SAMPLES = 100_000   # sequences per prompt printed to a terminal


class _Seqs:
    "Item i // samples for sequence i: `samples` sequences per item, without a list of them all"
    def __init__(self, items: list, samples: int):
        self.items, self.samples = items, samples
    def __getitem__(self, i: int):
        return self.items[i // self.samples]
    def __len__(self) -> int:
        return len(self.items) * self.samples


def _run(gen, items: list[tuple[str, str]], sampling, samples: int, batch_size: int, asked: bool = False):
    """Generate for (where, prompt) items; stream live when one sequence runs, else print each as it finishes.
    `asked`: --max-new-tokens was given, and a prompt the context has no room for that many after is refused"""
    from gptkit.inference.sampling import check_room
    prompts = [gen.encode(p, w) for w, p in items]          # each prompt once, however many samples
    for (where, _), ids in zip(items if asked else [], prompts):
        check_room(len(ids), sampling.max_new_tokens, gen.context, where='the prompt' if where == 'prompt' else where)
    n = len(items) * samples
    batch_size = min(batch_size, n)
    gen.check_batch(batch_size)                               # before any work: the KV cache must fit
    seqs = _Seqs(items, samples)
    enc = _Seqs(prompts, samples)
    total, t0 = 0, time.perf_counter()
    for start in range(0, n, batch_size):
        part = list(range(start, min(start + batch_size, n)))
        if n == 1:
            out.print(seqs[0][1], style='bold', end='', markup=False, highlight=False)
            for c in gen.stream([enc[0]], sampling):
                out.print(c.text, end='', markup=False, highlight=False)
                total += c.token is not None
                if c.finish_reason:
                    out.print(f'\n[dim]({c.finish_reason})[/]')
            continue
        texts = {i: '' for i in part}
        with out.status(f'generating {len(part)} sequences ({part[0] + 1}-{part[-1] + 1} of {len(seqs)})') as status:
            for c in gen.stream([enc[i] for i in part], sampling):
                i = part[c.index]
                texts[i] += c.text
                total += c.token is not None
                status.update(f'generating: {total:,} tokens, {total / (time.perf_counter() - t0):,.1f} tokens/s')
                if c.finish_reason:
                    sample = f', sample {i % samples + 1}' if samples > 1 else ''
                    out.print(f'[dim]── {fmt.text(seqs[i][0])}{sample} ({c.finish_reason})[/]', soft_wrap=True)
                    out.print(seqs[i][1], style='bold', end='', markup=False, highlight=False)
                    out.print(texts[i], markup=False, highlight=False)
    dt = time.perf_counter() - t0
    err.print(f'[dim]{total:,} tokens in {dt:.2f} s ({total / max(dt, 1e-9):,.1f} tokens/s)[/]')


@app.command()
@handles_errors(name=_name)
def generate(
    ctx: typer.Context,
    checkpoint: Annotated[Path, Opt(help='A run folder, its checkpoints/ folder or one iter_XXXXXXX folder.')],
    prompt: Annotated[Optional[List[str]], Opt(
        help='Text to continue (repeat for more). Without --prompt or --prompt-file: an interactive prompt.')] = None,
    prompt_file: Annotated[Optional[Path], Opt(
        help='A text file with one prompt per line (\\n inside a line is a newline).')] = None,
    max_new_tokens: Annotated[Optional[int], Opt(help=(
        'New tokens per sequence at most (default 64, or as many as the context leaves after the prompt); more than '
        'the context leaves is refused.'), show_default=False)] = None,
    temperature: Annotated[float, Opt(help='Divide the logits by this (> 0); lower is more conservative.')] = 1.0,
    top_k: Annotated[int, Opt(help='Sample from the k most likely tokens only (0: all).')] = 0,
    top_p: Annotated[float, Opt(
        help='Sample from the smallest set of tokens whose probability reaches p (1: all).')] = 1.0,
    greedy: Annotated[bool, Opt('--greedy', help='Always take the most likely token.')] = False,
    seed: Annotated[Optional[int], Opt(help='Seed for reproducible sampling.')] = None,
    num_samples: Annotated[int, Opt(help='Sequences per prompt.')] = 1,
    stop: Annotated[Optional[List[str]], Opt(
        help='Stop a sequence before this text (repeat for more); the end of a document always stops.')] = None,
    batch_size: Annotated[int, Opt(help='Sequences generated together.')] = 8,
    device: Annotated[Optional[str], Opt(help='cpu or cuda (default: cuda when there is a GPU).')] = None,
    dtype: Annotated[str, Opt(help='fp32, bf16, or auto: on a CPU the one measured faster for this model\'s '
                                   'shapes (bf16 where 1.3x or more); on a GPU bf16 (fp16 without '
                                   'it).')] = 'auto',
    tp: Annotated[int, Opt(help='Shard the model over this many processes on this machine, as training splits it '
                                '(torchrun; gloo on CPU, NCCL on GPU).')] = 1,
):
    """Generate text from a checkpoint, streamed as it comes (on a CPU in the dtype and layout measured fastest)."""
    if tp < 1:
        raise ConfigError([('tp', f'{{key}} must be at least 1, not {tp}')])
    if tp > 1 and 'RANK' not in os.environ:
        if not prompt and prompt_file is None:
            raise ConfigError([('tp', '{key} needs --prompt or --prompt-file: every process reads the same '
                                      'prompts')])
        seed = seed if greedy or seed is not None else random.randrange(2**63)   # every rank samples alike
        raise typer.Exit(launch_tp(ctx, 'generate', tp, [] if seed is None else ['--seed', str(seed)]))
    if tp > 1:
        device = join_tp(device)[1]
    problems = _problems(num_samples, batch_size)
    if problems:
        raise ConfigError(problems)
    asked = max_new_tokens is not None
    sampling = _sampling(max_new_tokens=64 if max_new_tokens is None else max_new_tokens, temperature=temperature,
                         top_k=top_k, top_p=top_p, greedy=greedy, seed=seed, stop=tuple(stop or ()))
    items = read_prompts(prompt or [], prompt_file)
    from gptkit.inference.generator import Generator
    with out.status(f'loading {fmt.text(checkpoint)}'):
        gen = Generator.from_checkpoint(checkpoint, device=device, dtype=dtype, tp=tp)
    step, cfg, weight = gen.loaded.state.get('iteration', '?'), gen.model.cfg, gen.model.wte.weight
    err.print(f'[dim]{fmt.text(gen.loaded.folder)} (step {step}, {cfg.layers} layers, hidden {cfg.hidden}, '
              f'context {gen.context}) on {weight.device}, {str(weight.dtype).replace("torch.", "")}[/]')
    if gen.decode is not None:
        err.print(f'[dim]{fmt.text(gen.decode.why)}[/]')
    if items:
        return _run(gen, items, sampling, samples=num_samples, batch_size=batch_size, asked=asked)
    _interactive(gen, sampling, num_samples, batch_size, asked)


def _problems(num_samples: int, batch_size: int) -> list[tuple[str, str]]:
    "Every problem with the counts `gptkit generate` was given, as (option, sentence) pairs"
    problems = [(k, f'{{key}} must be at least 1, not {v}')
                for k, v in (('num_samples', num_samples), ('batch_size', batch_size)) if v < 1]
    if num_samples > MAX_SAMPLES:
        problems.append(('num_samples', f'{{key}} {num_samples:,} is more than {MAX_SAMPLES:,}; for more, call '
                                        'gptkit.inference.generator.Generator from a script and write as it goes'))
    return problems


def _interactive(gen, sampling, num_samples: int, batch_size: int, asked: bool):
    "Prompts typed one at a time, each answered as it comes, until an empty line or Ctrl-D"
    err.print('[dim]Type a prompt and press Enter; an empty line or Ctrl-D quits.[/]')
    for text in typed_prompts():
        try:
            _run(gen, [('prompt', text)], sampling, samples=num_samples, batch_size=batch_size, asked=asked)
        except ConfigError as e:
            report(e, _name)
