"""Write README.md from nbs/index.ipynb (markdown as is, code cells as fenced Python).

nbdev's own `nbdev-readme` needs Quarto, which cannot be installed everywhere; this keeps the README in
step with the index notebook without it. `tests/test_project.py` fails when they disagree.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render(nb_path: Path = ROOT / 'nbs' / 'index.ipynb') -> str:
    "The README text for the notebook at `nb_path`"
    cells = json.loads(nb_path.read_text(encoding='utf-8'))['cells']
    parts = []
    for cell in cells:
        src = ''.join(cell['source']).strip()
        if not src or src.startswith('#|'): continue
        parts.append(src if cell['cell_type'] == 'markdown' else f'```python\n{src}\n```')
    return '\n\n'.join(parts) + '\n'


def main(argv: list[str]) -> int:
    text, readme = render(), ROOT / 'README.md'
    if '--check' in argv:
        same = readme.exists() and readme.read_text(encoding='utf-8') == text
        if not same: print('README.md is out of step with nbs/index.ipynb: run python tools/readme.py', file=sys.stderr)
        return 0 if same else 1
    tmp = readme.with_suffix('.md.tmp')
    tmp.write_text(text, encoding='utf-8')
    tmp.replace(readme)
    print(f'wrote {readme.relative_to(ROOT)}')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
