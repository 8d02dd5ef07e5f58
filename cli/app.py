"""The `gptkit` typer app, its error handling and the shared rich consoles."""
from __future__ import annotations

import functools
import os
from importlib.metadata import PackageNotFoundError, version as _pkg_version
from typing import Annotated, List, Optional, get_type_hints

import typer
from rich.console import Console

from gptkit.errors import ConfigError, GptkitError
from gptkit_cli.format import text

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


def _key(name):
    "`name` for keys that are settings; a key that says where it came from ('model.layers (run.yaml, line 3)') as is"
    return lambda key: key if ' ' in key else name(key)


def given(fn, kwargs: dict) -> list[tuple[str, str]]:
    "(option, value) for each path-like value the command `fn` was given: ('--out', 'runs/a'); arguments as NAME"
    try:
        hints = get_type_hints(fn, include_extras=True)
    except Exception:                    # a name the annotations use is not importable here: plain flags
        hints = {}
    found = []
    for name, value in kwargs.items():
        info = [m for m in getattr(hints.get(name), '__metadata__', ()) if isinstance(m, typer.models.ParameterInfo)]
        option = flag(name)
        if info and isinstance(info[0], typer.models.ArgumentInfo):
            option = info[0].metavar or name.upper()
        elif info and isinstance(info[0].default, str) and info[0].default.startswith('-'):
            option = info[0].default
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, (str, os.PathLike)) and os.fspath(v):
                found.append((option, os.fspath(v)))
    return found


def os_error(e: OSError, options: list[tuple[str, str]] = ()) -> str:
    "An OSError as one sentence: the option among `options` (see `given`) whose path it concerns, and what went wrong"
    path = e.filename2 if e.filename2 is not None else e.filename    # a rename: the name it was writing
    why = e.strerror or str(e)
    if path is None:
        return why
    path = os.fsdecode(path)
    target = os.path.abspath(path)
    # the option whose value is the path, lies above it or starts it (an output prefix), or needs it as a folder
    near = [(o, v) for o, v in options if target.startswith(os.path.abspath(v))
            or os.path.abspath(v).startswith(target + os.sep)]
    found = max(((len(os.path.abspath(v)), o, v) for o, v in near), default=None)
    if found is None:
        return f'{path}: {why}'
    if os.path.abspath(found[2]) == target:
        return f'{found[1]} {path}: {why}'
    return f'{found[1]} {found[2]}: {path}: {why}'


def report(e: GptkitError | OSError, name=flag, options: list[tuple[str, str]] = ()) -> int:
    "Print `e` as one red line naming the flag, file or key (keys shown as `name(key)`); return its exit code"
    if isinstance(e, OSError):
        msg, code = os_error(e, options), 1
    else:
        msg, code = str(e), e.exit_code
    if isinstance(e, ConfigError):
        msg = e.render(_key(name))
    err.print(f'[bold red]error:[/] {text(msg)}', soft_wrap=True)
    return code


def handles_errors(fn=None, *, name=flag):
    "Turn expected failures and OSErrors into one red line and an exit code; GPTKIT_DEBUG=1 shows the traceback"
    if fn is None:
        return functools.partial(handles_errors, name=name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (GptkitError, OSError) as e:
            if os.environ.get('GPTKIT_DEBUG'):
                raise
            raise typer.Exit(report(e, name, given(fn, kwargs))) from None
    return wrapper


def typed_prompts():
    "Lines typed at a `> ` prompt, one at a time, until an empty line, Ctrl-D or Ctrl-C"
    while True:
        try:
            text = input('> ')
        except (EOFError, KeyboardInterrupt):
            return
        if not text.strip():
            return
        yield text


def package_version() -> str:
    try:
        return _pkg_version('gptkit')
    except PackageNotFoundError:
        return 'unknown (not installed)'


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
