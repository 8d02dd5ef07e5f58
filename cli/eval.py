"""`gptkit eval`: perplexity (per token and per word) and LAMBADA-style cloze accuracy of a checkpoint, or with
`--tasks` the tasks of lm-evaluation-harness."""
from __future__ import annotations

import os
from pathlib import Path
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

from gptkit.errors import ConfigError
from gptkit.files import json_text
from gptkit_cli import format as fmt
from gptkit_cli.app import TextKey, app, err, handles_errors, out
from gptkit_cli.launch import join_tp, launch_tp

Opt = typer.Option
# `--tasks` and the options that go with it: lm-evaluation-harness (gptkit.eval.harness)
Tasks = Annotated[Optional[str], Opt(help='Run these lm-evaluation-harness tasks, groups or tags instead '
                                          '(comma-separated, e.g. hellaswag,arc_easy).')]
IncludePath = Annotated[Optional[str], Opt(help='A folder of lm-eval task YAMLs of your own (--tasks); their '
                                                'data_files are read relative to the YAML.')]
Limit = Annotated[Optional[float], Opt(help='Only the first N examples of each task (--tasks; below 1: that '
                                            'fraction).')]
NumFewshot = Annotated[Optional[int], Opt(help="Examples shown before each question (--tasks; default: the task's "
                                               'own).')]
MaxGenToks = Annotated[int, Opt(help='Most tokens a generation task generates unless the task says (--tasks).')]
SeqLen = Annotated[Optional[int], Opt(help="Tokens of context per window (default: the checkpoint's training length); "
                                             'give the same to every model compared.')]
OutFile = Annotated[Optional[str], Opt('--out', help='Save the results here (--tasks; default: '
                                                     'RUN/eval/lm_eval-TIME.json).')]
Offline = Annotated[bool, Opt(help='Never ask the Hugging Face Hub for a dataset: only what is cached or local '
                                   '(--tasks).')]
TrustTaskCode = Annotated[bool, Opt(help='Let task files under --include-path run the Python code they name '
                                         "(lm-eval's !function tags, Hugging Face evaluate metrics); refused "
                                         'otherwise.')]


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
    seq_len: SeqLen = None,
    batch_size: Annotated[int, Opt(help='Windows or examples per forward pass.')] = 8,
    max_documents: Annotated[Optional[int], Opt(help='Only the first N documents of the perplexity text.')] = None,
    device: Annotated[Optional[str], Opt(help="cpu, cuda, cuda:1 ... (default: cuda when there is one).")] = None,
    as_json: Annotated[bool, Opt('--json', help='Print the results as JSON only.')] = False,
    tp: Annotated[int, Opt(help='Shard the model over this many processes on this machine, as training splits it '
                                '(torchrun; gloo on CPU, NCCL on GPU).')] = 1,
    tasks: Tasks = None,
    include_path: IncludePath = None,
    limit: Limit = None,
    num_fewshot: NumFewshot = None,
    max_gen_toks: MaxGenToks = 256,
    out_file: OutFile = None,
    offline: Offline = False,
    trust_task_code: TrustTaskCode = False,
):
    ("""Measure a checkpoint: perplexity per token and per word (Megatron's WikiText-103 way) and """
     """LAMBADA-style accuracy; with --tasks, lm-evaluation-harness tasks.""")
    if tp < 1:
        raise ConfigError([('tp', f'{{key}} must be at least 1, not {tp}')])
    if tasks is not None:
        return _harness(ctx, checkpoint, tasks, (text, jsonl, lambada), include_path=include_path, limit=limit,
                        batch_size=batch_size, num_fewshot=num_fewshot, max_gen_toks=max_gen_toks, out_file=out_file,
                        offline=offline, device=device, tp=tp, as_json=as_json, trust_code=trust_task_code)
    if text is not None and jsonl is not None:
        raise ConfigError([('text', '{key} and --jsonl both name a text to measure; give one')])
    if not perplexity and lambada is None:
        raise ConfigError([('lambada', '{key} is needed with --no-perplexity: there is nothing else to measure')])
    if tp > 1 and 'RANK' not in os.environ:
        raise typer.Exit(launch_tp(ctx, 'eval', tp))
    rank, device = join_tp(device) if tp > 1 else (0, device)
    from gptkit.data.corpus import HELD_OUT  # ftfy and the readers: not on the CLI's start-up path
    from gptkit.eval.perplexity import evaluate
    source = (text or jsonl or HELD_OUT) if perplexity else None
    from gptkit.train.engine import device_type
    device = device or device_type()
    with _Bar() as bar:
        res = evaluate(checkpoint, source, jsonl=True if jsonl else False if text else None, text_key=text_key,
                       cloze=lambada, stride=stride, batch_size=batch_size, max_documents=max_documents, device=device,
                       progress=bar.update, tp=tp, seq_len=seq_len)
    if rank != 0:
        return
    if as_json:
        print(json_text(res.to_dict(), indent=1))   # NaN as null
        return
    out.print(_table(res))


def _harness(ctx, checkpoint, tasks, others, *, include_path, limit, batch_size, num_fewshot, max_gen_toks, out_file,
             offline, device, tp, as_json, trust_code=False):
    """gptkit eval --tasks: lm-eval's simple_evaluate on the checkpoint; a table of every metric, the JSON saved
    (`others`: the flags of gptkit's own measures, refused beside it)"""
    from gptkit.eval.harness import evaluate_tasks, find_tasks, require_lm_eval
    if any(v is not None for v in others):
        raise ConfigError([('tasks', '{key} runs lm-evaluation-harness alone; measure --text, --jsonl or --lambada '
                                     'in a gptkit eval of their own')])
    if tp > 1 and 'RANK' not in os.environ:
        require_lm_eval(offline)
        find_tasks(tasks, include_path, trust_code)   # an unknown task refused before any process starts
        raise typer.Exit(launch_tp(ctx, 'eval', tp))
    if tp > 1:
        _, device = join_tp(device)
    res = evaluate_tasks(checkpoint, tasks, include_path=include_path, limit=limit, batch_size=batch_size,
                         num_fewshot=num_fewshot, out=out_file, device=device, tp=tp, max_gen_toks=max_gen_toks,
                         offline=offline, trust_code=trust_code)
    if res is None:                              # a rank after the first
        return
    if as_json:
        print(Path(res['file']).read_text(), end='')
        return
    out.print(_harness_table(res))
    err.print(f'[dim]saved {fmt.text(res["file"])}[/dim]')


def _harness_table(res: dict) -> Table:
    from gptkit.eval.harness import metric_rows
    g = res['gptkit']
    step = g['iteration'] if g['iteration'] is not None else '?'
    t = Table(title=f'{fmt.text(g["checkpoint"])}: step {step}, lm-evaluation-harness on {g["device"]}'
                    + (f', tp {g["tp"]}' if g['tp'] > 1 else '') + f', {g["seconds"]:.1f} s',
              title_justify='left', box=None, padding=(0, 2))
    for name, style, justify in (('task', 'cyan', 'left'), ('metric', None, 'left'), ('value', None, 'right'),
                                 ('stderr', 'dim', 'right'), ('n', 'dim', 'right')):
        t.add_column(name, style=style, justify=justify)
    for task, metric, value, se, n in metric_rows(res):
        t.add_row(task, metric, f'{value:.4f}', f'± {se:.4f}' if se is not None else '', f'{n:,}' if n else '')
    return t


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
        t.add_row('perplexity', fmt.perplexity(p.perplexity), 'per token: exp(loss)')
        if p.word_perplexity is not None:
            t.add_row('word perplexity', fmt.perplexity(p.word_perplexity),
                      f'per word: exp(loss x {(p.tokens - 1) / (p.words - 1):.3f} tokens/word)')
        t.add_row('time', f'{p.seconds:.2f} s', f'{p.scored / max(p.seconds, 1e-9):,.0f} tokens/s')
    c = res.cloze
    if c is not None:
        t.add_row('cloze accuracy', f'{c.accuracy:.2%}',
                  f'{c.correct:,} of {c.examples:,} last words exact: {fmt.text(c.source)}')
        t.add_row('time', f'{c.seconds:.2f} s', f'{c.examples / max(c.seconds, 1e-9):,.1f} examples/s')
    return t
