"""Entry point of the `gptkit` console script: registers the commands on the app.

`gptkit estimate ...` registers only the estimate command: building typer's parameters for every command, and
importing their modules, would be most of its start-up time. Anything else (`gptkit --help`, an unknown name, an
option before the command) registers them all, and so does `from gptkit_cli.main import app`.
"""
from __future__ import annotations

import importlib
import sys

# command (or command group) -> the module of gptkit_cli that registers it
COMMANDS = {'checkpoint': 'checkpoint', 'client': 'serve', 'data': 'data', 'doctor': 'doctor', 'estimate': 'estimate',
            'eval': 'eval', 'generate': 'generate', 'profile': 'profile', 'quickstart': 'quickstart', 'serve': 'serve',
            'tokenizer': 'tokenizer', 'train': 'train'}


def register(names: list[str] | None = None):
    "Import the modules that register `names` (None: every command) on the app; return the app"
    for module in sorted({COMMANDS[n] for n in names} if names else set(COMMANDS.values())):
        importlib.import_module(f'gptkit_cli.{module}')
    from gptkit_cli.app import app
    return app


def _command(argv: list[str]) -> str | None:
    "The command `argv` names, when it is the first word and a known one"
    return argv[0] if argv and argv[0] in COMMANDS else None


def main():
    name = _command(sys.argv[1:])
    register([name] if name else None)()


def __getattr__(attr: str):
    if attr == 'app':
        return register()
    raise AttributeError(f'module {__name__!r} has no attribute {attr!r}')


if __name__ == '__main__':
    main()
