"""Render docs/ from the notebooks: `nbdev-docs` when Quarto is installed, otherwise plain HTML.

The fallback runs nbdev's notebook processing (what `nbdev-proc-nbs` does, without its attempt to install
Quarto), executes each processed notebook and converts it with nbconvert into docs/<name>.html (the index
notebook into docs/overview.html), and writes docs/index.html linking every chapter. Usage: python tools/docs.py [--out DIR] [--no-execute]
"""
from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chapter_title(nb: Path) -> tuple[str, str]:
    "(title, summary) from the notebook's first markdown cell: '# Title' and '> summary'"
    for cell in json.loads(nb.read_text(encoding='utf-8'))['cells']:
        if cell['cell_type'] != 'markdown': continue
        lines = ''.join(cell['source']).splitlines()
        title = next((l[2:].strip() for l in lines if l.startswith('# ')), nb.stem)
        summary = next((l[1:].strip() for l in lines if l.startswith('>')), '')
        return title, summary
    return nb.stem, ''


def write_index(out: Path, pages: list[tuple[str, Path]]):
    "docs/index.html: a link to every chapter, written atomically"
    items = []
    for page, nb in pages:
        title, summary = chapter_title(nb)
        items.append(f'<li><a href="{html.escape(page)}">{html.escape(title)}</a> ({html.escape(nb.name)})'
                     f'{" &mdash; " + html.escape(summary) if summary else ""}</li>')
    text = ('<!doctype html>\n<html><head><meta charset="utf-8"><title>gptkit documentation</title></head><body>\n'
            '<h1>gptkit documentation</h1>\n<p>Chapters, rendered from the notebooks in nbs/:</p>\n<ul>\n'
            + '\n'.join(items) + '\n</ul>\n</body></html>\n')
    tmp = out / 'index.html.tmp'
    tmp.write_text(text, encoding='utf-8')
    tmp.replace(out / 'index.html')


def test_flags() -> set[str]:
    "The flags of cells nbdev-test skips unless asked: settings.ini `tst_flags` (the project uses gpu and slow)"
    import configparser
    ini = configparser.ConfigParser()
    ini.read(ROOT / 'settings.ini')
    return {'gpu', 'slow'} | set(ini.get('DEFAULT', 'tst_flags', fallback='').replace(',', ' ').split())


def flagged(source: str, flags: set[str]) -> bool:
    "Whether a cell carries one of `flags` as an nbdev directive (`#| gpu`)"
    for line in source.splitlines():
        s = line.strip()
        if not s.startswith('#|'): break
        if s[2:].strip() in flags: return True
    return False


def execute(nb_path: Path):
    "Run a notebook in place, in its own folder, so its outputs appear in the docs (flagged cells are shown, not run)"
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor
    nb = nbformat.read(nb_path, as_version=4)
    flags = test_flags()
    for c in nb.cells:
        if c.cell_type == 'code' and flagged(c.source, flags):
            c.metadata.setdefault('tags', []).append('skip-execution')
    ExecutePreprocessor(timeout=600, kernel_name='python3').preprocess(nb, {'metadata': {'path': str(nb_path.parent)}})
    nbformat.write(nb, nb_path)


def to_html(nb_path: Path) -> str:
    "One processed notebook as a standalone HTML page"
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(nb_path, as_version=4)
    nb.cells = [c for c in nb.cells if not (c.cell_type == 'raw' and c.source.lstrip().startswith('---'))]  # Quarto front matter
    for c in nb.cells: c.metadata.pop('execution', None)
    return HTMLExporter().from_notebook_node(nb)[0]


def render_html(out: Path, run: bool = True) -> list[Path]:
    "Execute copies of the notebooks, process them with nbdev, and convert each to HTML in `out`"
    from nbdev.serve import proc_nbs
    os.chdir(ROOT)
    os.environ.update(IN_TEST='1')  # IN_TEST: the notebooks' own nbdev_export() cells do nothing
    build = ROOT / '_build' / 'nbs'
    shutil.rmtree(build.parent, ignore_errors=True)
    shutil.copytree(ROOT / 'nbs', build, ignore=shutil.ignore_patterns('*.yml', '.ipynb_checkpoints'))
    if run:   # two kernels at a time: much of a notebook's run is start-up, imports and waiting on subprocesses
        from concurrent.futures import ThreadPoolExecutor
        def run_one(nb):
            execute(nb)
            print(f'executed nbs/{nb.name}', flush=True)
        with ThreadPoolExecutor(2) as pool: list(pool.map(run_one, sorted(build.glob('*.ipynb'))))
    proc_nbs(path=str(build), force=True)
    out.mkdir(parents=True, exist_ok=True)
    pages = []
    for nb in sorted((ROOT / '_proc').glob('*.ipynb'), key=lambda p: (p.stem != 'index', p.name)):
        page = 'overview.html' if nb.stem == 'index' else f'{nb.stem}.html'
        tmp = out / (page + '.tmp')
        tmp.write_text(to_html(nb), encoding='utf-8')
        tmp.replace(out / page)
        pages.append((page, ROOT / 'nbs' / nb.name))
        print(f'rendered nbs/{nb.name} -> {out / page}')
    write_index(out, pages)
    shutil.rmtree(build.parent, ignore_errors=True)
    return [out / p for p, _ in pages]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path, default=ROOT / 'docs', help='where to write the HTML (default docs/)')
    ap.add_argument('--no-execute', action='store_true', help='render without running the notebooks')
    args = ap.parse_args(argv)
    quarto = shutil.which('quarto')
    if quarto and args.out.resolve() == (ROOT / 'docs').resolve():
        return subprocess.run([str(Path(sys.executable).parent / 'nbdev-docs')], cwd=ROOT).returncode
    render_html(args.out.resolve(), run=not args.no_execute)
    print(f'wrote {args.out / "index.html"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
