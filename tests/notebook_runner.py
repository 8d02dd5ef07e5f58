"""Runs notebooks one after another in one process, as each of `nbdev-test`'s workers does, so that the libraries they
import (torch, DeepSpeed, transformers) are imported once and not once a notebook.

tests/test_notebooks.py starts it in nbs/, writes one JSON line a notebook on its standard input
(`{"nb": path, "flags": "gpu slow"}`) and reads one JSON line back (`{"ok", "seconds", "error", "rss"}`). What the
notebooks print outside their cells goes to standard error, never into the replies."""
import io
import json
import os
import sys
import traceback


def resident_bytes() -> int:
    "This process's resident memory now (not its peak): the caller starts a fresh runner when it grows too large"
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def run(nb: str, flags: str, cfg) -> dict:
    "One notebook through nbdev's own `test_nb`, with the flags `nbdev-test --flags` would pass"
    from nbdev.test import test_nb
    skip = cfg.tst_flags.split() if isinstance(cfg.tst_flags, str) else list(cfg.tst_flags)
    err, real = io.StringIO(), sys.__stderr__
    sys.__stderr__ = err                     # test_nb writes a failed cell's traceback there
    try:
        ok, seconds = test_nb(nb, skip_flags=skip, force_flags=flags.split(), basepath=cfg.config_path,
                              cell_timeout=cfg.cell_timeout or None)
    except BaseException:                    # a notebook that raises SystemExit or worse is a failed notebook
        ok, seconds = False, 0.0
        err.write(traceback.format_exc())
    finally:
        sys.__stderr__ = real
    return {'ok': bool(ok), 'seconds': seconds, 'error': err.getvalue()[-10000:]}


def main():
    replies = os.fdopen(os.dup(1), 'w', buffering=1)
    os.dup2(2, 1)
    from nbdev.config import get_config
    cfg = get_config()
    for line in sys.stdin:
        req = json.loads(line)
        reply = run(req['nb'], req.get('flags', ''), cfg)
        replies.write(json.dumps({**reply, 'rss': resident_bytes()}) + '\n')


if __name__ == '__main__':
    main()
