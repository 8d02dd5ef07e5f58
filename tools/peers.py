"""Running peers' own tools next to gptkit in tests and benchmarks: wikiextractor 3.0.6 (a dev requirement).

wikiextractor 3.0.6's regular expressions fail to compile on Python 3.11, so it runs in a subprocess under an
older interpreter found on this machine, with this venv's site-packages on its path."""
from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path


def old_python() -> str | None:
    "An interpreter older than 3.11, or None"
    for cand in ['python3.10', 'python3.9', *sorted(map(str, Path.home().glob('.pyenv/versions/3.1[0]*/bin/python3')))]:
        try:
            if subprocess.run([cand, '-c', 'import sys; assert sys.version_info < (3, 11)'],
                              capture_output=True).returncode == 0: return cand
        except OSError: continue
    return None


def wikiextractor(dump: Path, out: Path, processes: int = 1) -> subprocess.CompletedProcess | str:
    "wikiextractor --json on `dump` into folder `out` (its wiki_* files), or why it cannot run here"
    spec, py = importlib.util.find_spec('wikiextractor'), old_python()
    if spec is None: return 'wikiextractor is not installed in this venv (dev requirement)'
    if py is None: return 'no Python < 3.11 found to run wikiextractor 3.0.6'
    site = str(Path(spec.submodule_search_locations[0]).parent)
    cmd = [py, '-m', 'wikiextractor.WikiExtractor', '--json', '--processes', str(processes), '-q',
           '-o', str(out), str(dump)]
    return subprocess.run(cmd, env={**os.environ, 'PYTHONPATH': site}, capture_output=True, text=True)
