"""`gptkit tokenizer train|encode|info`: byte-level BPE."""
from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from gptkit_cli import format as fmt
from gptkit_cli.app import InputFormat, Inputs, TextKey, TokenizerName, app, handles_errors, out

tok_app = typer.Typer(help='Train and use byte-level BPE tokenizers.', no_args_is_help=True)
app.add_typer(tok_app, name='tokenizer')
Opt = typer.Option


@tok_app.command()
@handles_errors
def train(
    input: Inputs,
    output: Annotated[str, Opt(help='Directory for vocab.json, merges.txt and tokenizer.json.')],
    vocab_size: Annotated[int, Opt(help='Entries, including the 256 bytes and <|endoftext|>.')] = 8192,
    min_frequency: Annotated[int, Opt(help='Merge pairs seen at least this often.')] = 2,
    held_out: Annotated[str, Opt(help='Text to measure bytes per token on.')] = 'builtin:wikipedia',
    text_key: TextKey = 'text',
    format: InputFormat = 'auto',
    overwrite: Annotated[bool, Opt('--overwrite', help='Replace a tokenizer already in --output.')] = False,
):
    """Train a byte-level BPE tokenizer with <|endoftext|> as end of document."""
    from gptkit.data.corpus import clean_text, expand_inputs, read_documents
    from gptkit.data.document import Tally
    from gptkit.tokenizer.bpe import bytes_per_token, check_new_tokenizer, gpt2, save_tokenizer, train_bpe
    check_new_tokenizer(output, overwrite)           # refused before the corpus is read
    tally, paths = Tally(), expand_inputs(input, format)
    total = sum(p.stat().st_size for p in paths)
    start = time.perf_counter()
    with Progress(TextColumn('[bold]reading and counting pairs'), BarColumn(), TextColumn('{task.percentage:>3.0f}%'),
                  TextColumn('{task.description}'), TimeElapsedColumn(), TextColumn('ETA'), TimeRemainingColumn(),
                  console=out, transient=True) as bar:
        task = bar.add_task('', total=total)
        def docs():
            for d in read_documents(paths, tally, text_key, fmt=format):
                bar.update(task, completed=tally.input_bytes,
                           description=f'{tally.documents:,} docs, {tally.bytes / 2**20:.1f} MB')
                yield clean_text(d.text)
        tok = train_bpe(docs(), vocab_size, min_frequency)
    seconds = time.perf_counter() - start
    d = save_tokenizer(tok, check_new_tokenizer(output, overwrite))   # again: a run may have started there meanwhile
    held = [d_.text for d_ in read_documents([held_out])]
    out.print(f'trained on {tally.documents:,} documents ({tally.bytes / 2**20:.1f} MB) in {seconds:.1f} s: '
              f'{tok.vocab_size:,} entries, <|endoftext|> = {tok.eod}; '
              f'wrote {fmt.text(d)}/vocab.json, merges.txt, tokenizer.json')
    out.print(f'bytes per token on {fmt.text(held_out)}: {bytes_per_token(tok, held):.2f} (GPT-2: '
              f'{bytes_per_token(gpt2(), held):.2f})')
    for ex in tally.examples:
        out.print(f'[yellow]  {fmt.text(ex)}[/]')
    if tok.vocab_size < vocab_size:
        out.print(f'[yellow]note[/]: the corpus yields only {tok.vocab_size:,} of the {vocab_size:,} entries asked for '
                  f'(no pair left seen {min_frequency} times); a smaller --vocab-size or more text gives a full one')


@tok_app.command()
@handles_errors
def encode(
    text: Annotated[str, typer.Argument(help='Text to encode.')],
    tokenizer: TokenizerName = 'gpt2',
):
    """Print the token ids of TEXT."""
    from gptkit.tokenizer.bpe import load_tokenizer
    out.print(load_tokenizer(tokenizer).encode(text))


@tok_app.command()
@handles_errors
def info(tokenizer: TokenizerName = 'gpt2'):
    """Vocabulary size, end-of-document id and an example encoding."""
    from gptkit.tokenizer.bpe import load_tokenizer
    tok = load_tokenizer(tokenizer)
    ids = tok.encode('Hello world')
    end = fmt.text(tok.hf.id_to_token(tok.eod) or 'end of document')
    out.print(f'{fmt.text(tok.name)}: {tok.vocab_size:,} entries, {end} = {tok.eod}, "Hello world" -> {ids}')
