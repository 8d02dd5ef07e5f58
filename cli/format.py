"""How numbers look in the CLI's tables, and user text (paths, prompts, names) kept literal inside rich markup."""
from __future__ import annotations

from rich.markup import escape

GiB = 2**30


# C0 and C1 control characters but tab and newline: a name holding ESC ] 0 ; ... or ESC [ 2 J would retitle or clear
# the user's terminal when printed, so they are shown as \x1b and the like
CONTROLS = {c: f'\\x{c:02x}' for c in (*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f, *range(0x80, 0xa0))}


def text(value) -> str:
    "`value` as literal text inside rich markup: 'runs/[bold]x' is shown as it is, control characters as \\x1b"
    return escape(str(value).translate(CONTROLS))


def count(n: float) -> str:
    "354871296 -> '354.87M'"
    for unit, div in (('T', 1e12), ('B', 1e9), ('M', 1e6), ('K', 1e3)):
        if abs(n) >= div:
            return f'{n / div:.2f}{unit}'
    return f'{n:.0f}'


def gib(n: float) -> str:
    "Bytes as GiB with two decimals"
    return f'{n / GiB:,.2f} GiB'


def flops(n: float) -> str:
    "FLOPs with an SI prefix: 1.2e18 -> '1.20 EFLOP'"
    for unit, div in (('Z', 1e21), ('E', 1e18), ('P', 1e15), ('T', 1e12), ('G', 1e9), ('M', 1e6)):
        if n >= div:
            return f'{n / div:.2f} {unit}FLOP'
    return f'{n:.0f} FLOP'


def duration(seconds: float) -> str:
    "Seconds as the largest sensible unit"
    if seconds >= 2 * 86400:
        return f'{seconds / 86400:,.1f} days'
    if seconds >= 2 * 3600:
        return f'{seconds / 3600:.1f} hours'
    if seconds >= 120:
        return f'{seconds / 60:.1f} minutes'
    return f'{seconds:.2f} s'


def perplexity(value: float) -> str:
    "A perplexity: 12.34 or 123,456.78; past a million in scientific notation (1.005e+20), which a table keeps whole"
    if abs(value) >= 1e6:
        return f'{value:.3e}'
    return f'{value:,.2f}'
