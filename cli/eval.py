"""`gptkit eval`: perplexity (per token and per word) and LAMBADA-style cloze accuracy of a checkpoint."""
from __future__ import annotations

import os
from typing import Annotated, Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from gptkit.engine import device_type
from gptkit.errors import ConfigError
from gptkit.files import json_text
from gptkit_cli import format as fmt
from gptkit_cli.app import TextKey, app, err, handles_errors, out
from gptkit_cli.launch import join_tp, launch_tp

Opt = typer.Option


@app.command('eval')
@handles_errors
def eval_(
    ctx: typer.Context,
    checkpoint: Annotated[str, Opt(help='Run folder, its checkpoints/ folder, or one iter_XXXXXXX folder.')],
    text: Annotated[Optional[str], Opt(help='Perplexity on this text file (one document; .gz allowed).')] = None,
    jsonl: Annotated[Optional[str], Opt(help='Perplexity on this JSON Lines file, one document per line.')] = None,
    text_key: TextKey = 'text',
    lambada: Annotated[Optional[str], Opt(
        help='Cloze accuracy on a JSON Lines file of {"text": passage}: is the last word predicted exactly?')] = None,
    perplexity: Annotated[bool, Opt(
        '--perplexity/--no-perplexity',
        help='Measure perplexity (default on the built-in held-out Wikipedia text).')] = True,
    stride: Annotated[Optional[int], Opt(
        help='New tokens per window (default: the context, no overlap); smaller gives more context.')] = None,
    batch_size: Annotated[int, Opt(help='Windows or examples per forward pass.')] = 8,
    max_documents: Annotated[Optional[int], Opt(help='Only the first N documents of the perplexity text.')] = None,
    device: Annotated[Optional[str], Opt(help="cpu, cuda, cuda:1 ... (default: cuda when there is one).")] = None,
    as_json: Annotated[bool, Opt('--json', help='Print the results as JSON only.')] = False,
    tp: Annotated[int, Opt(help='Shard the model over this many processes on this machine, as training splits it '
                                '(torchrun; gloo on CPU, NCCL on GPU).')] = 1,
):
    ("""Measure a checkpoint: perplexity per token and per word (Megatron's WikiText-103 way) and """
     """LAMBADA-style accuracy.""")
    if text is not None and jsonl is not None:
        raise ConfigError([('text', '{key} and --jsonl both name a text to measure; give one')])
    if not perplexity and lambada is None:
        raise ConfigError([('lambada', '{key} is needed with --no-perplexity: there is nothing else to measure')])
    if tp < 1:
        raise ConfigError([('tp', f'{{key}} must be at least 1, not {tp}')])
    if tp > 1 and 'RANK' not in os.environ:
        raise typer.Exit(launch_tp(ctx, 'eval', tp))
    rank = 0
    if tp > 1:
        rank, device = join_tp(device)
    from gptkit.data.corpus import HELD_OUT  # ftfy and the readers: not on the CLI's start-up path
    from gptkit.evaluate import evaluate
    source = (text or jsonl or HELD_OUT) if perplexity else None
    device = device or device_type()
    with _Bar() as bar:
        res = evaluate(checkpoint, source, jsonl=True if jsonl else False if text else None, text_key=text_key,
                       cloze=lambada, stride=stride, batch_size=batch_size, max_documents=max_documents, device=device,
                       progress=bar.update, tp=tp)
    if rank != 0:
        return
    if as_json:
        print(json_text(res.to_dict(), indent=1))   # NaN as null
        return
    out.print(_table(res))


class _Bar:
    "A rich progress bar per stage on stderr (count, rate, ETA), gone when done"
    def __enter__(self):
        self.progress = Progress(TextColumn('[bold]{task.description}'), BarColumn(), MofNCompleteColumn(),
                                 TextColumn('{task.fields[rate]}'), TimeElapsedColumn(), TextColumn('ETA'),
                                 TimeRemainingColumn(),
                                 console=err, transient=True)
        self.progress.start()
        self.tasks = {}
        return self

    def update(self, stage: str, done: int, total: int):
        unit = 'windows' if stage == 'perplexity' else 'examples'
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total, rate='')
        task = self.tasks[stage]
        self.progress.update(task, completed=done, total=total)
        speed = self.progress.tasks[task].speed
        self.progress.update(task, rate=f'{speed:,.1f} {unit}/s' if speed else '')

    def __exit__(self, *exc):
        self.progress.stop()


def _table(res) -> Table:
    t = Table(title=f'{fmt.text(res.checkpoint)}: step {res.iteration if res.iteration is not None else "?"}'
                    + (f', {fmt.count(res.tokens_trained)} tokens trained' if res.tokens_trained else '')
                    + f', {fmt.count(res.parameters)} parameters, on {res.device}',
              title_justify='left', show_header=False, box=None, padding=(0, 2))
    t.add_column(style='cyan')
    t.add_column(justify='right')
    t.add_column(style='dim')
    p = res.perplexity
    if p is not None:
        t.add_row('text', f'{p.words:,} words',
                  f'{fmt.text(p.source)} ({p.documents:,} document{"s" if p.documents != 1 else ""})')
        t.add_row('tokens scored', f'{p.scored:,}', f'{p.windows:,} windows of {p.context}, stride {p.stride}')
        t.add_row('loss', f'{p.loss:.4f}', 'nats per token')
        t.add_row('perplexity', f'{p.perplexity:,.2f}', 'per token: exp(loss)')
        if p.word_perplexity is not None:
            t.add_row('word perplexity', f'{p.word_perplexity:,.2f}',
                      f'per word: exp(loss x {(p.tokens - 1) / (p.words - 1):.3f} tokens/word)')
        t.add_row('time', f'{p.seconds:.2f} s', f'{p.scored / max(p.seconds, 1e-9):,.0f} tokens/s')
    c = res.cloze
    if c is not None:
        t.add_row('cloze accuracy', f'{c.accuracy:.2%}',
                  f'{c.correct:,} of {c.examples:,} last words exact: {fmt.text(c.source)}')
        t.add_row('time', f'{c.seconds:.2f} s', f'{c.examples / max(c.seconds, 1e-9):,.1f} examples/s')
    return t
