"""The `gptkit` typer app, its error handling and the shared rich consoles."""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Annotated, List, Optional, get_type_hints

import typer
from rich.console import Console

from gptkit.errors import ConfigError, GptkitError
from gptkit_cli.format import text

# Typer's coercion of option values without pydantic, for the plain types gptkit's options use.
#
# typer 0.29 coerces every option through a pydantic TypeAdapter, built when the option is first processed (its
# default too), so `gptkit estimate` imported pydantic and pydantic-core, most of its start-up time. The values
# gptkit's options take (str, int, float, bool, a path, a list of them) need no schema: they are coerced here the way
# click coerced them, and anything else (ranges, choices, parsers, tuples, files) goes to typer's own coercion as
# before. Older typer versions, which coerce with click's types, are left as they are.
PLAIN = {str: 'text', int: 'integer', float: 'number', bool: 'boolean'}
BOOLS = {'1': True, 'true': True, 't': True, 'yes': True, 'y': True, 'on': True, '': False,   # click's words
         '0': False, 'false': False, 'f': False, 'no': False, 'n': False, 'off': False}


def _is_plain_leaf(annotation, info) -> bool:
    "A str, int, float, bool or Path option with none of the settings that need typer's own coercion"
    if info.parser is not None or getattr(info, 'click_type', None) is not None:
        return False
    if info.min is not None or info.max is not None or info.clamp:
        return False
    return annotation in PLAIN or (isinstance(annotation, type) and issubclass(annotation, Path))


def plain_values() -> bool:
    "Coerce plain options without pydantic from now on, where this typer coerces through pydantic; True if so"
    try:
        import typer.core as core
        from typer._click.exceptions import BadParameter
        from typer._coercion import RuntimeParam
        from typer._param_types import coerce_cli_path
        from typer._typing import get_args, get_origin
    except ImportError:                  # a typer that coerces with click's types imports no pydantic
        return False
    typers_own = getattr(core, 'build_runtime_param', None)
    if typers_own is None or getattr(typers_own, 'gptkit_plain', False):
        return typers_own is not None

    @dataclasses.dataclass(frozen=True)
    class PlainRuntimeParam(RuntimeParam):
        "A str, int, float, bool or path value, or a list of them, coerced as click did"
        leaf: type = str

        def _one(self, value, param, ctx):
            if isinstance(value, bytes):
                value = os.fsdecode(value)
            if isinstance(self.leaf, type) and issubclass(self.leaf, Path):
                path_type = self.parameter_info.path_type or self.leaf
                value = path_type(value) if isinstance(value, str) and issubclass(path_type, Path) else value
                return coerce_cli_path(value, self.parameter_info, path_type=path_type, param=param, ctx=ctx)
            if self.leaf is str:
                return str(value)
            if self.leaf is bool and not isinstance(value, bool):
                if str(value).strip().lower() not in BOOLS:
                    raise BadParameter(f'{value!r} is not a valid boolean.', ctx=ctx, param=param)
                return BOOLS[str(value).strip().lower()]
            try:
                return self.leaf(value)
            except (TypeError, ValueError):
                raise BadParameter(f'{value!r} is not a valid {PLAIN[self.leaf]}.', ctx=ctx, param=param) from None

        def _coerce_value(self, value, param, ctx):
            if isinstance(value, (list, tuple)):
                return [self._one(v, param, ctx) for v in value]
            return self._one(value, param, ctx)

    def build_runtime_param(descriptor):
        annotation, info = descriptor.annotation, descriptor.parameter_info
        leaf = get_args(annotation)[0] if get_origin(annotation) is list and get_args(annotation) else annotation
        if descriptor.file_annotation is None and _is_plain_leaf(leaf, info):
            return PlainRuntimeParam(parameter_info=info, annotation=annotation, leaf=leaf)
        return typers_own(descriptor)

    build_runtime_param.gptkit_plain = True
    core.build_runtime_param = build_runtime_param
    return True


plain_values()             # options coerced without importing pydantic (typer 0.29): a fast start

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
    "gptkit's installed version (importlib.metadata imported only now: off the start-up path)"
    from importlib.metadata import PackageNotFoundError, version as _pkg_version
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
