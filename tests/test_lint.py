"""ruff, configured in pyproject.toml (line length 120, pyflakes, import order), passes on gptkit/ and cli/."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generated_all(v: dict) -> bool:
    "nbdev writes `__all__` itself and wraps it before adding `__all__ = `, so its first line can reach ~130"
    if v['code'] != 'E501': return False
    line = (ROOT / v['filename']).read_text(encoding='utf-8').splitlines()[v['location']['row'] - 1]
    return line.startswith('__all__ = [')


def test_ruff_passes_on_the_library_and_the_cli():
    ruff = Path(sys.executable).with_name('ruff')
    assert ruff.exists(), f'{ruff} is missing: pip install -c constraints.txt ruff'
    r = subprocess.run([str(ruff), 'check', '--no-cache', '--output-format', 'json', 'gptkit', 'cli'],
                       cwd=ROOT, capture_output=True, text=True)
    found = [v for v in json.loads(r.stdout or '[]') if not _generated_all(v)]
    where = [f"{Path(v['filename']).relative_to(ROOT)}:{v['location']['row']}: {v['code']} {v['message']}" for v in found]
    assert not where, '\n'.join(where)
