"""The `gptkit` typer app, its error handling and the shared rich consoles."""
from __future__ import annotations

import functools
import os
from importlib.metadata import PackageNotFoundError, version as _pkg_version
from typing import Annotated, List, Optional

import typer
from rich.console import Console

from gptkit.config import ConfigError, GptkitError

# Options several commands share
Inputs = Annotated[List[str], typer.Option('--input', '-i',
                                           help='File, directory, glob or builtin:NAME (repeat for more).')]
TokenizerName = Annotated[str, typer.Option(help="'gpt2' or a tokenizer directory.")]
TextKey = Annotated[str, typer.Option(help='JSON Lines field or Parquet/Arrow column holding the text.')]
InputFormat = Annotated[str, typer.Option('--format', help="Read every input as jsonl|txt|parquet|arrow|mediawiki (for "
                                          "names that do not say, like wikiextractor's wiki_00); auto: by name and "
                                          "content.")]

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

app = typer.Typer(name='gptkit', no_args_is_help=True, add_completion=False, rich_markup_mode='rich',
                  pretty_exceptions_show_locals=False, context_settings={'help_option_names': ['-h', '--help']},
                  help='Pre-train GPT models the Megatron-DeepSpeed way, from notebooks and one CLI.')


def flag(key: str) -> str:
    "The CLI flag for a library key: micro_batch -> --micro-batch"
    return '--' + key.replace('_', '-')


def report(e: GptkitError, name=flag) -> int:
    "Print `e` as one red line naming the flag, file or key (keys shown as `name(key)`); return its exit code"
    msg = e.render(name) if isinstance(e, ConfigError) else str(e)
    err.print(f'[bold red]error:[/] {msg}', soft_wrap=True)
    return e.exit_code


def handles_errors(fn):
    "Turn expected failures into one red line and an exit code; GPTKIT_DEBUG=1 shows the traceback"
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try: return fn(*args, **kwargs)
        except GptkitError as e:
            if os.environ.get('GPTKIT_DEBUG'): raise
            raise typer.Exit(report(e)) from None
    return wrapper


def package_version() -> str:
    try: return _pkg_version('gptkit')
    except PackageNotFoundError: return 'unknown (not installed)'


def _version(value: bool):
    if value:
        out.print(f'gptkit {package_version()}')
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option('--version', callback=_version, is_eager=True,
                                               help='Show the version and exit.')] = False,
         local_rank: Annotated[Optional[int], typer.Option('--local_rank', '--local-rank', hidden=True,
                                                           help="Set by DeepSpeed's launcher; ranks are read from the "
                                                                "environment.")] = None):
    """Pre-train GPT models the Megatron-DeepSpeed way, from notebooks and one CLI.

    Start with [bold]gptkit quickstart[/], or size a run with [bold]gptkit estimate --params 13B[/].
    """
