"""`gptkit quickstart`: the whole pipeline on the built-in corpus, on this machine, as far as it is built."""
from __future__ import annotations

import contextlib
import math
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gptkit.config.sections import GPT3_PRESETS, LLAMA_PRESETS, PRECISIONS, PRESETS, ParallelConfig, TrainConfig
from gptkit.errors import ConfigError
from gptkit.train.callbacks import Callback
from gptkit_cli import format as fmt
from gptkit_cli.app import app, err, handles_errors, out
from gptkit_cli.train import RichProgress

HELD_OUT_ARTICLES = 24   # of the built-in held-out text's 96, at most: fewer on a slow machine (HELD_OUT_SECONDS)
QUICK_PRESETS = ('tiny', 'llama-tiny', 'moe-tiny')   # the CPU-sized models of each family
# Sequences per step. Measured on 2 cores (held-out margin over the unigram model, at about 1M tokens): batch 16
# 0.92, 8 1.07, 4 1.13, 2 1.09 nats; 4 also runs the most tokens a second, its logits fitting the caches better.
QUICK_BATCH = 4
BUDGET_SECONDS = 180.0   # the whole quickstart after the install, on any CPU: the steps are sized to fit (issue 51)
DEFAULT_ITERS = 1700     # the most steps it trains, where the machine is fast enough
WARMUP_STEPS = 5         # timed first (they count as training); the rest of the run is sized from their median step
MIN_ITERS = 150          # the fewest steps it trains however slow the machine (a floor for the held-out margin;
                         # not yet measured per preset: the tiny run of 150 steps had validation loss 6.158 at 100)
EVAL_ITERS = 4           # batches per evaluation (validation twice during the run, then validation and test)
HELD_OUT_SECONDS = 20.0  # at most this long on the held-out text, predicted from the step time (one article at least)
AFTER_SECONDS = 10.0     # kept for the tables and the sample after training
FORWARD_SHARE = 1 / 3    # a forward pass's share of a training step's time (the backward pass does twice its work)
FIT_SHARE = 0.95         # of the seconds left, the steps fill this share: later steps ran up to 5% slower than the
                         # warm-up's (moe-tiny on 2 AMX cores: 0.100 s a step in the warm-up, 0.105 s over 1,522)


class Interrupted(KeyboardInterrupt):
    "A stop signal the quickstart ends on: 128 + its number is the exit code"
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@dataclass
class Where:
    "The phase the quickstart is in and what it wrote so far: the line a stop signal ends it with"
    phase: str = 'starting'
    kept: dict = field(default_factory=dict)    # what -> where it is
    live: list = field(default_factory=list)    # rich progress displays to stop on the way out
    iters: int = DEFAULT_ITERS                  # the steps the run trains

    def line(self, signum: int) -> str:
        name = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else signal.Signals(signum).name
        kept = '; '.join(f'{k} in {v}' for k, v in self.kept.items()) or 'nothing'
        return f'stopped by {name} during {self.phase}; kept: {kept} (exit {128 + signum})'


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def _sigterm_stops():
    "SIGTERM ends the quickstart as Ctrl-C does (training's own handler saves a checkpoint first)"
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _raise_interrupted) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


@app.command()
@handles_errors
def quickstart(
    out_dir: Annotated[Path, typer.Option(
        '--out', help='Where the tokenizer and the dataset go.')] = Path('gptkit-quickstart'),
    vocab_size: Annotated[int, typer.Option(help='Entries in the tokenizer trained on the built-in corpus.')] = 4096,
    iters: Annotated[Optional[int], typer.Option(
        help=f'Training steps ({QUICK_BATCH} x 256 tokens each); default: as many as fit {BUDGET_SECONDS:.0f} s in all '
             f'at the step time measured here, {MIN_ITERS:,} to {DEFAULT_ITERS:,}.', show_default=False)] = None,
    preset: Annotated[str, typer.Option(help="The model trained: 'tiny' (GPT), 'llama-tiny' (rotary, RMSNorm, "
                                             "SwiGLU, grouped-query attention) or 'moe-tiny' (llama-tiny's choices "
                                             'with 8 experts, 2 per token).')] = 'tiny',
    precision: Annotated[str, typer.Option(help='auto (on a CPU: bf16 where this machine runs its products 1.3x as '
                                                'fast as fp32, else fp32), fp32 or bf16.')] = 'auto',
):
    ("""The pipeline on the built-in corpus, on this machine: tokenizer, dataset, training the tiny model, """
     """evaluation, sizing real runs, and a sample of text from the model.""")
    if preset.lower() not in QUICK_PRESETS:
        choices = ', '.join(QUICK_PRESETS)
        raise ConfigError([('preset', f'{{key}} must be one of {choices} (CPU-sized), not {preset!r}')])
    if precision not in PRECISIONS:
        raise ConfigError([('precision', f"{{key}} must be one of {', '.join(PRECISIONS)}, not {precision!r}")])
    if iters is not None and iters < 1:
        raise ConfigError([('iters', f'{{key}} must be a positive number of steps, not {iters}')])
    where = Where()
    try:
        with _sigterm_stops():
            _pipeline(out_dir, vocab_size, iters, preset=preset.lower(), precision=precision, where=where)
    except KeyboardInterrupt as e:
        for live in where.live:
            live.stop()
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        err.print(where.line(signum), soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(128 + signum) from None


def _pipeline(out_dir: Path, vocab_size: int, iters: int | None, preset: str, precision: str, where: Where):
    "Every phase in turn, `where` told which one runs and what each kept"
    start = time.perf_counter()
    where.phase = '1-2. the tokenizer and the dataset'
    _data_stage(out_dir, vocab_size)
    where.kept['the tokenizer'] = str(out_dir / 'tokenizer')
    where.kept['the dataset'] = str(out_dir / 'data' / 'corpus_text_document')
    _train_stage(out_dir, iters, preset, precision=precision, where=where, start=start)
    where.phase = '5-8. sizing real runs'
    _estimate_stage()
    run = out_dir / 'run'
    o, r = fmt.text(out_dir), fmt.text(run)    # user text inside markup
    from gptkit.machine.cpu import this_cpu
    cpu = this_cpu()
    out.print(f'\nDone in {time.perf_counter() - start:.1f} s on this {fmt.text(cpu.name)} (machine class '
              f'{cpu.machine_class}, {_torch_threads()} threads). Next: [bold]gptkit train --preset {preset} '
              f'--set train.micro_batch={QUICK_BATCH} --set train.global_batch={QUICK_BATCH} --data '
              f'{o}/data/corpus_text_document '
              f'--tokenizer {o}/tokenizer --out {r} --resume --iters {2 * where.iters}[/] to train on, '
              f'[bold]gptkit generate --checkpoint {r}[/] (an interactive prompt), [bold]gptkit serve --checkpoint '
              f'{r}[/] '
              f'(a web page and the Megatron and OpenAI APIs), [bold]gptkit eval --checkpoint {r}[/], '
              f'[bold]gptkit checkpoint export {r} {o}/hf --to hf[/], [bold]gptkit estimate --help[/], and the '
              f'notebooks in nbs/.')
    where.phase = '9. the sample'
    _sample_stage(run)


def _torch_threads() -> int:
    "torch's threads, torch imported only now (off the CLI's start-up path)"
    import torch
    return torch.get_num_threads()


def _data_stage(out_dir: Path, vocab_size: int):
    from gptkit.data.corpus import DEFAULT_CORPUS, HELD_OUT, clean_text, read_documents  # ftfy: off the start-up path
    from gptkit.data.document import Tally
    from gptkit.data.prepare import PrepareConfig, prepare
    from gptkit.tokenizer.bpe import bytes_per_token, gpt2, save_tokenizer, train_bpe
    out.rule('[bold]gptkit quickstart[/]: a tokenizer and a dataset from the built-in corpus')
    corpus = ', '.join(DEFAULT_CORPUS)
    t0, tally = time.perf_counter(), Tally()
    with out.status(f'1. training a {vocab_size}-entry byte-level BPE on {corpus}'):
        tok = train_bpe((clean_text(d.text) for d in read_documents(DEFAULT_CORPUS, tally)), vocab_size)
        save_tokenizer(tok, out_dir / 'tokenizer')
    held = [d.text for d in read_documents([HELD_OUT])]
    out.print(f'1. tokenizer: {tok.vocab_size:,} entries from {tally.documents:,} documents ({tally.bytes / 2**20:.1f} '
              f'MB) in '
              f'{time.perf_counter() - t0:.1f} s -> {fmt.text(out_dir / "tokenizer")}; bytes per token on {HELD_OUT}: '
              f'{bytes_per_token(tok, held):.2f} (GPT-2: {bytes_per_token(gpt2(), held):.2f})')
    with out.status('2. tokenizing the corpus into Megatron .bin/.idx'):
        data = PrepareConfig(inputs=DEFAULT_CORPUS, output_prefix=str(out_dir / 'data' / 'corpus'),
                             tokenizer=str(out_dir / 'tokenizer'),
                             overwrite=True)        # a rerun on one --out: the dataset of the tokenizer just trained
        res = prepare(data)
    out.print(f'2. dataset: {res.documents:,} documents, {res.tokens:,} tokens in {res.seconds:.1f} s '
              f'({res.mb_per_s:.1f} MB/s) -> {fmt.text(res.prefix)}.bin/.idx\n')


def fit_iters(step_seconds: float, seconds_left: float, warm: int = WARMUP_STEPS, least: int = MIN_ITERS,
              most: int = DEFAULT_ITERS) -> int:
    "Steps in all: the `warm` ones run, then as many as `seconds_left` hold at `step_seconds`, `least` to `most`"
    fit = warm + math.floor(max(0.0, seconds_left) / max(step_seconds, 1e-9))
    return max(least, min(most, fit))


def held_out_articles(step_seconds: float, article_tokens: list[int], step_tokens: int,
                      seconds: float = HELD_OUT_SECONDS) -> int:
    "How many of the held-out articles are evaluated in about `seconds` (one at least, `HELD_OUT_ARTICLES` at most)"
    per_token = step_seconds * FORWARD_SHARE / step_tokens      # no backward pass
    n, total = 0, 0
    for t in article_tokens[:HELD_OUT_ARTICLES]:
        total += t
        if n and total * per_token > seconds:
            break
        n += 1
    return n


def after_training_seconds(step_seconds: float, held_seconds: float, setup_seconds: float) -> float:
    "What the rest of the quickstart takes after the steps: a second set-up, 4 evaluations, the held-out text, the rest"
    evals = 4 * EVAL_ITERS * step_seconds * FORWARD_SHARE
    return setup_seconds + evals + held_seconds + AFTER_SECONDS


class StepClock(Callback):
    "When each optimizer step ended: the machine's step time is the median of the warm-up's steps after the first"
    def __init__(self):
        self.ends = []

    def on_train_step(self, iteration: int):
        self.ends.append(time.perf_counter())

    def step_seconds(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.ends, self.ends[1:]))
        return gaps[len(gaps) // 2] if gaps else math.inf


def _quick_config(out_dir: Path, preset: str, precision: str, iters: int):
    "The quickstart's run of `iters` steps: batch 4, validation at a third and two thirds of the way and at the end"
    from gptkit.train.plan import run_config
    sets = [f'train.iters={iters}', f'train.eval_interval={max(1, iters // 3)}', f'train.eval_iters={EVAL_ITERS}',
            f'train.log_interval={max(1, min(10, iters // 20))}', f'train.micro_batch={QUICK_BATCH}',
            f'train.global_batch={QUICK_BATCH}', 'optim.warmup=0.05', f'train.precision={precision}']
    return run_config(preset, sets=sets, overrides={'data': {'prefix': str(out_dir / 'data' / 'corpus_text_document'),
                                                             'tokenizer': str(out_dir / 'tokenizer')}},
                      vocab=False, out=str(out_dir / 'run'))


def _train(plan, where: Where, stop_after: int | None = None, extra=()):
    "Train `plan` with a progress bar; a stop signal training saved on ends the quickstart (`Interrupted`)"
    from gptkit.train.loop import train
    progress = RichProgress()
    where.live.append(progress.progress)
    result = train(plan, callbacks=[progress, *extra], resume=plan.resume_from is not None, stop_after=stop_after)
    where.live.remove(progress.progress)
    where.kept['the checkpoint'] = f'{result.checkpoint} (step {result.iteration:,})'
    if result.interrupted:
        raise Interrupted(result.signal or signal.SIGINT)
    return result


def _budgeted(plan, out_dir: Path, preset: str, precision: str, where: Where, start: float, article_tokens: list):
    "Train the warm-up steps, time them, then go on for as many steps as the budget holds: (result, s a step)"
    from gptkit.train.plan import plan_run
    clock = StepClock()
    first = _train(plan, where, stop_after=WARMUP_STEPS, extra=[clock])
    step_s, per_step = clock.step_seconds(), plan.cfg.tokens_per_step
    setup_s = max(0.0, first.seconds - (clock.ends[-1] - clock.ends[0]) - step_s)   # set-up, first step's extra, save
    held_s = sum(article_tokens[:held_out_articles(step_s, article_tokens, per_step)]) * step_s * FORWARD_SHARE
    left = BUDGET_SECONDS - (time.perf_counter() - start) - after_training_seconds(step_s, held_s / per_step, setup_s)
    where.iters = fit_iters(step_s, left * FIT_SHARE, first.iteration, MIN_ITERS, DEFAULT_ITERS)
    floor = ' (the fewest that keep the held-out margin: more than the budget on this machine)'
    floor = floor if where.iters == MIN_ITERS and left < (MIN_ITERS - first.iteration) * step_s else ''
    out.print(f'   {first.iteration} warm-up steps took {step_s:.3f} s a step here (set-up {setup_s:.1f} s): '
              f'{where.iters:,} steps in all{floor} fit the quickstart in about {BUDGET_SECONDS:.0f} s '
              f'(--iters N trains N)')
    if where.iters <= first.iteration:
        return first, step_s
    again = plan_run(_quick_config(out_dir, preset, precision, where.iters), resume=True, tok=plan.tokenizer)
    return _train(again, where), step_s


def _held_out_loss(model, held: list, seq_len: int, where: Where) -> float:
    "text_loss over the held-out tokens with its progress shown: a bar in a terminal, whole lines in a log"
    from gptkit.eval.perplexity import text_loss
    windows = (len(held) - 1) // seq_len
    if not out.is_terminal:
        return text_loss(model, held, seq_len, progress=PlainProgress('   held-out', seq_len))
    bar = Progress(TextColumn('[bold]held-out[/]'), BarColumn(), MofNCompleteColumn(), TextColumn('windows'),
                   TextColumn('{task.fields[rate]}'), TimeElapsedColumn(), TextColumn('ETA'), TimeRemainingColumn(),
                   console=out, transient=True)
    where.live.append(bar)
    with bar:
        task = bar.add_task('held-out', total=windows, rate='')
        t0 = time.perf_counter()

        def show(done, total):
            rate = done * seq_len / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, completed=done, rate=f'{rate:,.0f} tok/s')
        loss = text_loss(model, held, seq_len, progress=show)
    where.live.remove(bar)
    return loss


class PlainProgress:
    "Progress as whole lines (a log, a pipe): count, rate and ETA about every tenth of the way and at the end"
    def __init__(self, what: str, seq_len: int):
        self.what, self.seq_len, self.t0, self.shown = what, seq_len, time.perf_counter(), 0

    def __call__(self, done: int, total: int):
        if done < total and done * 10 // total == self.shown * 10 // total:
            return
        self.shown = done
        dt = max(time.perf_counter() - self.t0, 1e-9)
        eta = (total - done) * dt / done
        out.print(f'{self.what}: {done:,}/{total:,} windows, {done * self.seq_len / dt:,.0f} tokens/s, '
                  f'{dt:.1f} s, ETA {eta:.1f} s', soft_wrap=True, highlight=False)


def _train_stage(out_dir: Path, iters: int | None, preset: str = 'tiny', precision: str = 'auto',
                 where: Where | None = None, start: float | None = None):
    "Train the preset (`iters` None: as many steps as the budget holds), then its loss on held-out text"
    from gptkit.data.corpus import HELD_OUT, clean_text, read_documents
    from gptkit.eval.perplexity import token_counts, unigram_loss
    from gptkit.train.engine import device_type
    from gptkit.train.plan import plan_run
    where = Where() if where is None else where
    start = time.perf_counter() if start is None else start
    shutil.rmtree(out_dir / 'run', ignore_errors=True)    # the quickstart always starts its run afresh
    where.phase = '3. training'
    where.iters = iters or DEFAULT_ITERS
    plan = plan_run(_quick_config(out_dir, preset, precision, where.iters))  # tokenizer read once, held-out text too
    cfg, tok = plan.cfg, plan.tokenizer
    steps = f'{iters:,} steps' if iters else f'up to {DEFAULT_ITERS:,} steps (as many as fit)'
    out.print(f'3. training the {preset} preset ({cfg.model.layers} layers, hidden {cfg.model.hidden}, context '
              f'{cfg.model.seq_len}) for {steps} of {cfg.tokens_per_step:,} tokens on DeepSpeed, on this '
              f'{device_type().upper()} in {cfg.train.precision}')
    if plan.precision_why is not None:
        out.print(f'   {fmt.text(plan.precision_why)}')
    docs = list(read_documents([HELD_OUT]))[:HELD_OUT_ARTICLES]
    articles = [tok.encode(clean_text(d.text)) + [tok.eod] for d in docs]
    if iters is None:
        result, step_s = _budgeted(plan, out_dir, preset, precision=precision, where=where, start=start,
                                   article_tokens=[len(a) for a in articles])
        articles = articles[:held_out_articles(step_s, [len(a) for a in articles], cfg.tokens_per_step)]
    else:
        result = _train(plan, where)
    held = [t for a in articles for t in a]
    losses = [f'{name} loss {v:.3f}' for name, v in (('validation', result.valid_loss), ('test', result.test_loss))
              if v is not None]
    out.print(f'   trained {result.iteration:,} steps in {result.seconds:.1f} s: {", ".join(losses) or "no loss"}; '
              f'checkpoint {fmt.text(result.checkpoint)}')
    where.phase = '4. the held-out evaluation'
    ours = _held_out_loss(result.engine.module, held, cfg.model.seq_len, where)
    base = unigram_loss(token_counts(cfg.data.prefix, cfg.data.split, tok.vocab_size), held)
    out.print(f'4. held-out text (the first {len(articles)} articles of {HELD_OUT}, {len(held):,} tokens): '
              f'loss [bold]{ours:.3f}[/] (perplexity {math.exp(ours):,.0f}) against [bold]{base:.3f}[/] (perplexity '
              f'{math.exp(base):,.0f}) for a unigram model of the training data: {base - ours:.2f} nats better\n')
    return ours, base


def _sample_stage(run: Path, prompt: str = 'And the king said unto', tokens: int = 80):
    "Stream a sample from the trained checkpoint, loaded by its path as `gptkit generate` does"
    from gptkit.inference.generator import Generator
    from gptkit.inference.sampling import Sampling
    gen = Generator.from_checkpoint(run, device='cpu', dtype='auto')
    out.print(f'\n[bold]9. A sample from the model trained above[/] (gptkit generate --checkpoint {fmt.text(run)} '
              '--top-k 40 '
              f'--temperature 0.8 '
              '--seed 0):', soft_wrap=True)
    out.print(f'[bold]{prompt}[/]', end='')
    for c in gen.stream([prompt], Sampling(max_new_tokens=tokens, temperature=0.8, top_k=40, seed=0)):
        out.print(c.text, end='', markup=False, highlight=False)
    out.print()


def _estimate_stage():
    from gptkit.estimate.perf import GPUS
    from gptkit.estimate.sizing import count_params, estimate, search
    t = Table(title='5. The GPT-3 family (Brown et al. 2020), parameters counted as Megatron counts them',
              title_justify='left')
    for col in ('preset', 'layers', 'hidden', 'heads', 'parameters', 'padded vocabulary'):
        t.add_column(col, justify='right')
    for name in GPT3_PRESETS:
        m = PRESETS[name].model
        c = count_params(m)
        t.add_row(name, str(m.layers), str(m.hidden), str(m.heads), f'{c.total:,}', str(c.vocab_padded))
    out.print(t)
    t = Table(title='   and the Llama family: Llama 3, SmolLM2, TinyLlama, Qwen2.5, Qwen3, Mistral '
                    '(rotary, RMSNorm, SwiGLU, grouped-query attention)',
              title_justify='left')
    for col in ('preset', 'layers', 'hidden', 'heads / KV', 'SwiGLU', 'parameters'):
        t.add_column(col, justify='right')
    for name in LLAMA_PRESETS:
        m = PRESETS[name].model
        t.add_row(name, str(m.layers), str(m.hidden), f'{m.heads} / {m.kv}', str(m.ffn), f'{count_params(m).total:,}')
    out.print(t)

    m125 = PRESETS['125m'].model
    t = Table(title='6. GPT-3 125M on one A100-80GB: memory per GPU against micro-batch '
                    '(bf16, ZeRO 0, flash attention)',
              title_justify='left')
    for col in ('micro-batch', 'model states', 'activations', 'logits', 'total', 'fits'):
        t.add_column(col, justify='right')
    overtaken = None
    for mb in (1, 2, 4, 8, 16, 64):
        mem = estimate(m125, ParallelConfig(), TrainConfig(micro_batch=mb, global_batch=256), GPUS['a100-80gb']).memory
        states = mem.weights + mem.gradients + mem.optimizer
        if overtaken is None and mem.logits > states:
            overtaken = mb
        t.add_row(str(mb), fmt.gib(states), fmt.gib(mem.activations),
                  fmt.gib(mem.logits), fmt.gib(mem.total), '[green]yes[/]' if mem.fits else '[red]no[/]')
    out.print(t)
    if overtaken:
        out.print(f"[dim]From micro-batch {overtaken} the logits (batch x sequence x vocabulary, with the loss's fp32 "
                  'copies) take more memory than all the model states.[/]\n')

    e = estimate(PRESETS['13b'].model, ParallelConfig(tp=8, pp=2, dp=4, zero=1, sequence_parallel=True),
                 TrainConfig(micro_batch=1, global_batch=1024, recompute='selective'), GPUS['a100-80gb'])
    out.print(f'[bold]7. GPT-3 13B on 64 A100-80GB[/] (tp 8, pp 2, ZeRO 1, selective recompute): '
              f'{fmt.gib(e.memory.total)} per GPU, {fmt.flops(e.flops_per_iteration)} per step, '
              f'{e.iterations:,} steps for 300B tokens, {fmt.duration(e.seconds)} at {e.mfu:.1%} MFU '
              f'({e.to_dict()["time"]["gpu_hours"]:,.0f} GPU-hours).\n')

    best = search(PRESETS['13b'].model, GPUS['a100-80gb'], 64, global_batch=1024, top=3)
    t = Table(title='8. The three fastest layouts for 13B on 64 A100-80GB (gptkit estimate --params 13B --search '
                    '--gpus 64)',
              title_justify='left')
    for col in ('tp', 'pp', 'dp', 'ZeRO', 'recompute', 'micro', 'memory/GPU', 'days'):
        t.add_column(col, justify='right')
    for b in best:
        t.add_row(str(b.parallel.tp), str(b.parallel.pp), str(b.parallel.dp), str(b.parallel.zero), b.train.recompute,
                  str(b.train.micro_batch), fmt.gib(b.memory.total), f'{b.layout_seconds / 86400:.1f}')
    out.print(t)
