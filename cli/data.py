"""`gptkit data prepare|inspect`: text to Megatron .bin/.idx, and a look inside."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gptkit.errors import DataError
from gptkit_cli import format as fmt
from gptkit_cli.app import InputFormat, Inputs, TextKey, app, handles_errors, out

data_app = typer.Typer(help='Prepare and inspect tokenized datasets (Megatron .bin/.idx).', no_args_is_help=True)
app.add_typer(data_app, name='data')
Opt = typer.Option


def _bar(label: str) -> Progress:
    "A transient progress bar: percent of the input, a description, elapsed time and ETA"
    return Progress(TextColumn(f'[bold]{label}'), BarColumn(), TextColumn('{task.percentage:>3.0f}%'),
                    TextColumn('{task.description}'), TimeElapsedColumn(), TextColumn('ETA'), TimeRemainingColumn(),
                    console=out, transient=True)


def _print_prepared(res, chat: bool):
    "What a prepare wrote and dropped, the problems it met, and (for --chat) the loss mask"
    t = Table(title=fmt.text(f'{res.prefix}.bin/.idx'), title_justify='left', show_header=False, box=None,
              padding=(0, 2))
    t.add_column(style='cyan')
    t.add_column(justify='right')
    t.add_row('documents read', f'{res.tally.documents:,}')
    for reason, n in sorted(res.dropped.items()):
        t.add_row(f'  dropped: {reason.replace("_", " ")}', f'{n:,}')
    for reason, n in sorted(res.tally.problems.items()):
        t.add_row(f'  bad input: {reason.replace("_", " ")}', f'{n:,}')
    t.add_row('documents written', f'{res.documents:,}')
    t.add_row('tokens written', f'{res.tokens:,}')
    if chat:
        t.add_row('tokens trained (loss mask 1)', f'{res.trained:,} ({res.trained / max(res.tokens, 1):.0%})')
    t.add_row('text read', f'{res.tally.bytes / 2**20:,.2f} MB')
    t.add_row('time', f'{res.seconds:.2f} s ({res.mb_per_s:.1f} MB/s, {res.docs_per_s:,.0f} documents/s)')
    out.print(t)
    if chat:
        out.print(f'loss mask: {fmt.text(res.mask_prefix)}.bin/.idx (conversations rendered with '
                  f'{fmt.text(res.template)})', soft_wrap=True)
    for ex in res.tally.examples:
        out.print(f'[yellow]  {fmt.text(ex)}[/]')
    for p in res.removed:
        out.print(f'[dim]removed {fmt.text(p)}, left by a run that was killed[/]', soft_wrap=True)


@data_app.command()
@handles_errors
def prepare(
    input: Inputs,
    output_prefix: Annotated[str, Opt(help='Writes PREFIX_text_document.bin/.idx.')],
    tokenizer: Annotated[str, Opt(help="'gpt2', a tokenizer directory, or a Hugging Face model's folder (its "
                                       "tokenizer.json; end-of-text: config.json's eos_token_id).")] = 'gpt2',
    text_key: TextKey = 'text',
    txt_split: Annotated[str, Opt(help=".txt files: one document per 'file' or per 'blank-line' block.")] = 'file',
    workers: Annotated[int, Opt(help='Tokenizer threads, and processes that read a multistream .xml.bz2 dump.')] = 2,
    append_eod: Annotated[bool, Opt(
        '--append-eod/--no-append-eod', help="End each document with the tokenizer's end-of-text token.")] = True,
    min_tokens: Annotated[int, Opt(help='Drop documents with fewer tokens.')] = 0,
    dedupe: Annotated[bool, Opt('--dedupe', help='Drop exact duplicate documents.')] = False,
    clean: Annotated[bool, Opt('--clean/--no-clean', help='NFC, \\n line ends, no control characters.')] = True,
    fix_unicode: Annotated[bool, Opt('--fix-unicode', help='Also repair mojibake with ftfy (slower).')] = False,
    strict: Annotated[bool, Opt('--strict', help='Stop at the first bad input, naming file and line.')] = False,
    format: InputFormat = 'auto',
    shard: Annotated[str, Opt(help='I/N: prepare only the I-th of N slices of the input files (N parallel runs, '
                                   'then gptkit data merge).')] = '',
    overwrite: Annotated[bool, Opt('--overwrite', help='Replace a dataset already at the output prefix.')] = False,
    keep_truncated: Annotated[bool, Opt('--keep-truncated', help='Keep what was read from a truncated or unreadable '
                                                                  'input instead of failing.')] = False,
    chat: Annotated[bool, Opt('--chat', help="JSON Lines of conversations ('messages', or 'prompt' and 'completion'), "
                                             "rendered with the tokenizer's chat template or the plain one; also "
                                             'writes PREFIX_text_document_loss_mask.bin/.idx (1: an assistant '
                                             'token).')] = False,
):
    """Tokenize text into a Megatron indexed dataset (.bin/.idx); with --chat, conversations and their loss mask."""
    from gptkit.data.prepare import PrepareConfig, prepare
    cfg = PrepareConfig(inputs=tuple(input), output_prefix=output_prefix, tokenizer=tokenizer, text_key=text_key,
                        txt_split=txt_split, workers=workers, append_eod=append_eod, min_tokens=min_tokens,
                        dedupe=dedupe, clean=clean, fix_unicode=fix_unicode, strict=strict, format=format, shard=shard,
                        overwrite=overwrite, keep_truncated=keep_truncated)
    run = prepare
    if chat:
        from gptkit.data.chat import prepare_chat as run
    with _bar('preparing') as bar:
        task = bar.add_task('', total=None)
        update = lambda p: bar.update(task, total=p.input_total or None, completed=p.input_bytes,
                                      description=f'{p.documents:,} docs, {p.bytes / 2**20:,.1f} MB, {p.tokens:,} '
                                                  f'tokens, '
                                                  f'{p.bytes / 2**20 / max(p.seconds, 1e-9):.1f} MB/s')
        res = run(cfg, update)
    _print_prepared(res, chat)


@data_app.command()
@handles_errors
def inspect(
    prefix: Annotated[str, typer.Argument(help='Dataset prefix (PREFIX.bin and PREFIX.idx).')],
    tokenizer: Annotated[Optional[str], Opt(
        help="Decode a few documents with 'gpt2' or a tokenizer directory.")] = None,
    show: Annotated[int, Opt(help='How many documents to decode.')] = 2,
):
    """Documents, tokens, dtype, length histogram and a few decoded documents of a .bin/.idx pair."""
    import numpy as np

    from gptkit.data.indexed import IndexedDataset, data_paths, dataset_writer, stale_dataset_temporaries
    writer, stale = dataset_writer(prefix), stale_dataset_temporaries(prefix)
    missing = [p for p in data_paths(prefix) if not p.is_file()]
    left = ', '.join(f'{p.name} ({p.stat().st_size / 2**20:,.1f} MB)' for p in stale)
    if missing and writer:
        raise DataError(f'{prefix}: not written yet, it is being written by {writer}; inspect it when that ends')
    if missing and stale:
        raise DataError(f'{missing[0]}: no such file, only {left}, left by a prepare or merge of {prefix} that was '
                        'killed; run it again (it removes what was left)')
    ds = IndexedDataset(prefix)
    doc_lengths = np.diff(np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])[ds.document_indices])
    out.print(f'[bold]{fmt.text(str(prefix))}[/]: {ds.num_documents:,} documents, {len(ds):,} sequences, '
              f'{ds.num_tokens:,} tokens of {ds.dtype}')
    if ds.num_documents:
        out.print(f'document length: min {doc_lengths.min():,}, median {int(np.median(doc_lengths)):,}, max '
                  f'{doc_lengths.max():,} tokens')
        edges = np.unique(np.geomspace(1, max(2, doc_lengths.max() + 1), 9).astype(int))
        counts, _ = np.histogram(doc_lengths, bins=edges)
        t = Table(title='length histogram (tokens)', title_justify='left', box=None)
        t.add_column('tokens', justify='right')
        t.add_column('documents', justify='right')
        t.add_column('')
        for lo, hi, c in zip(edges[:-1], edges[1:], counts):
            t.add_row(f'{lo:,}-{hi - 1:,}', f'{c:,}', '█' * int(40 * c / max(1, counts.max())))
        out.print(t)
    if writer:
        out.print(f'[yellow]{fmt.text(str(prefix))} is being written again by {fmt.text(writer)}[/]', soft_wrap=True)
    if stale:
        out.print(f'[yellow]{fmt.text(left)}: left by a prepare or merge of this prefix that was killed; delete it (a '
                  'prepare or merge into this folder removes it too)[/]', soft_wrap=True)
    if tokenizer and show:
        from gptkit.tokenizer.bpe import load_tokenizer
        tok = load_tokenizer(tokenizer)
        for j in range(min(show, ds.num_documents)):
            text = tok.decode(ds.document(j))
            out.print(f'[bold]document {j}[/] ({len(ds.document(j)):,} tokens): '
                      f'{fmt.text(repr(text[:300]))}{"..." if len(text) > 300 else ""}')


@data_app.command()
@handles_errors
def corpora():
    """List the built-in corpora (use them as --input builtin:NAME)."""
    from gptkit.data.corpus import BUILTIN, DEFAULT_CORPUS, HELD_OUT, builtin_path
    t = Table(title='Built-in corpora (sources and licences: gptkit/assets/PROVENANCE.md)', title_justify='left')
    for col in ('input', 'compressed', 'what'):
        t.add_column(col)
    for name, (_, what) in BUILTIN.items():
        role = (' [dim](quickstart training corpus)[/]' if f'builtin:{name}' in DEFAULT_CORPUS
                else ' [dim](held out)[/]' if f'builtin:{name}' == HELD_OUT else '')
        t.add_row(f'builtin:{name}', f'{builtin_path(name).stat().st_size / 2**20:.2f} MiB', what + role)
    from gptkit.data.chat import CHAT_SETS, chat_inputs
    for name, (_, what) in CHAT_SETS.items():
        size = chat_inputs([f'builtin:{name}'])[0].stat().st_size
        t.add_row(f'builtin:{name}', f'{size / 2**20:.2f} MiB', what + ' [dim](conversations: prepare with --chat)[/]')
    out.print(t)


@data_app.command()
@handles_errors
def merge(
    input: Annotated[list[str], Opt('--input', '-i', help='Dataset prefix, .bin/.idx file or folder of them, merged '
                                                          'in the order given (repeat for more).')],
    output_prefix: Annotated[str, Opt(help='Writes PREFIX.bin/.idx.')],
    mixed_tokenizers: Annotated[bool, Opt('--mixed-tokenizers', help='Merge datasets that gptkit prepared with '
                                                                      'different tokenizers.')] = False,
    overwrite: Annotated[bool, Opt('--overwrite', help='Replace a dataset already at the output prefix.')] = False,
):
    """Join indexed datasets into one, byte for byte as Megatron's tools/merge_datasets.py."""
    from gptkit.data.indexed import merge_datasets
    with _bar('merging') as bar:
        task = bar.add_task('', total=None)
        update = lambda p: bar.update(task, total=p.total or None, completed=p.bytes,
                                      description=f'{p.datasets:,} datasets, {p.bytes / 2**20:,.1f} MB, '
                                                  f'{p.bytes / 2**20 / max(p.seconds, 1e-9):.1f} MB/s')
        res = merge_datasets(input, output_prefix, update, mixed_tokenizers=mixed_tokenizers, overwrite=overwrite)
    t = Table(title=fmt.text(f'{res.prefix}.bin/.idx'), title_justify='left', show_header=False, box=None,
              padding=(0, 2))
    t.add_column(style='cyan')
    t.add_column(justify='right')
    t.add_row('datasets merged', f'{res.datasets:,}')
    t.add_row('documents written', f'{res.documents:,}')
    t.add_row('sequences written', f'{res.sequences:,}')
    t.add_row('tokens written', f'{res.tokens:,} ({res.dtype})')
    t.add_row('bytes written', f'{res.bytes / 2**20:,.2f} MB')
    t.add_row('time', f'{res.seconds:.2f} s ({res.mb_per_s:.1f} MB/s)')
    out.print(t)
