"""Render docs/ from the notebooks as plain, offline HTML: one page per chapter, with the outputs and plots the
notebooks keep, nbdev's cell directives honoured, a sidebar listing every chapter and previous/next links.

Nothing is executed here: the pages show the outputs saved in the notebooks (refresh them with
`python tools/run_notebooks.py`). The index notebook becomes docs/overview.html, each chapter docs/<name>.html,
and docs/index.html lists them all. Directives, as nbdev and Quarto read them (leading `#|` lines or the
cell's `nbdev` metadata): `hide` and `include: false` drop the cell; `echo: false` (and the `hide_input`
metadata) show the output without the source; `output: false` and `eval: false` show the source without an
output; `code-fold` (with `code-summary`) folds the source; `hide_line` drops a line; `filter_stream` drops
stream lines; `export`/`exports`/`exporti` cells show their source, labelled with the module they export to; a
cell left empty once its directives are gone (`default_exp`) is dropped. No directive line and no In/Out
prompt is ever shown. `--quarto` runs nbdev-docs instead, where Quarto is installed.

Usage: python tools/docs.py [--out DIR] [--quarto]
"""
from __future__ import annotations

import argparse
import functools
import html
import json
import re
import shutil
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'


def chapter_title(nb: Path) -> tuple[str, str]:
    "(title, summary) from the notebook's first markdown cell: '# Title' and '> summary'"
    for cell in json.loads(nb.read_text(encoding='utf-8'))['cells']:
        if cell['cell_type'] != 'markdown': continue
        lines = ''.join(cell['source']).splitlines()
        title = next((l[2:].strip() for l in lines if l.startswith('# ')), nb.stem)
        start = next((i for i, l in enumerate(lines) if l.startswith('>')), len(lines))
        summary = ' '.join(l[1:].strip() for l in takewhile(lambda l: l.startswith('>'), lines[start:]))
        return title, summary
    return nb.stem, ''


def notebooks(nbs: Path = NBS) -> list[Path]:
    "The notebooks in reading order: the index (overview) first, then the chapters by name"
    found = [p for p in nbs.glob('*.ipynb') if not p.name.startswith(('_', '.'))]
    return sorted(found, key=lambda p: (p.stem != 'index', p.name))


def page_name(nb: Path) -> str:
    return 'overview.html' if nb.stem == 'index' else f'{nb.stem}.html'


# ---------------------------------------------------------------------------------------------------------------
# nbdev's directives, applied to the notebook before nbconvert renders it

def _on(v) -> bool:
    "A directive value that means yes: bare (''), true, show"
    return v is not None and str(v).strip().lower() not in ('false', 'no', '0')


def split_directives(cell) -> tuple[dict, str]:
    "(directives, source without its directive lines): nbdev's own parsing, leading `#|` lines and `nbdev` metadata"
    from fastcore.nbio import NbCell, first_code_ln
    dirs = NbCell(0, dict(cell)).directives
    lines = cell.source.splitlines(True)
    start = first_code_ln(lines)
    start = len(lines) if start is None else start
    head = [l for l in lines[:start] if not l.lstrip().startswith('#|')]
    body = ''.join(head + lines[start:]).strip('\n')
    body = '\n'.join(l for l in body.split('\n') if not re.search(r'#\|\s*hide_line\s*$', l))
    return dirs, body


def _filter_stream(cell, words: str):
    for out in cell.outputs:
        if out.output_type == 'stream' and words.split():
            pat = '|'.join(map(re.escape, words.split()))
            out.text = ''.join(l for l in out.text.splitlines(True) if not re.search(pat, l))


WIDGET = 'application/vnd.jupyter.widget-view+json'


def _static_outputs(cell):
    "Interactive widgets cannot run in a static page: say so instead of rendering an empty box"
    for out in cell.outputs:
        data = out.get('data', {})
        if WIDGET in data:
            out.data = {'text/html': '<p class="widget-note">An interactive widget: open the notebook in Jupyter '
                                     'to use it.</p>'}


def _link_notebooks(md: str, names: set[str]) -> str:
    "Markdown links to a chapter notebook (`nbs/04_data.indexed.ipynb`) point at its page instead"
    def sub(m):
        stem = m.group(2)
        if stem not in names: return m.group(0)
        return f'{m.group(1)}{"overview" if stem == "index" else stem}.html{m.group(3) or ""})'
    return re.sub(r'(\]\()(?:\.?/?nbs/)?([\w.-]+)\.ipynb(#[^)\s]*)?\)', sub, md)


def apply_directives(nb, module: str | None = None, names: set[str] = frozenset(), flags: set[str] = frozenset(),
                     lib: str = 'gptkit'):
    "Rewrite notebook `nb` in place as a reader should see it (see the module docstring); returns it"
    cells = []
    for cell in nb.cells:
        if cell.cell_type == 'raw':
            if cell.source.lstrip().startswith('---'): continue  # Quarto front matter
            cells.append(cell); continue
        dirs, body = split_directives(cell)
        if 'hide' in dirs or not _on(dirs.get('include', 'true')): continue
        if cell.cell_type == 'markdown':
            cell.source = _link_notebooks(body, names)
            cells.append(cell); continue
        cell.source = body
        cell.execution_count = None
        meta = cell.metadata
        for k in ('execution', 'tags', 'collapsed', 'scrolled', 'jupyter'): meta.pop(k, None)
        if not _on(dirs.get('output', 'true')) or not _on(dirs.get('eval', 'true')): cell.outputs = []
        if 'filter_stream' in dirs: _filter_stream(cell, dirs['filter_stream'])
        _static_outputs(cell)
        hide_source = not _on(dirs.get('echo', 'true')) or meta.pop('hide_input', False) or not body.strip()
        if hide_source: meta['transient'] = {'remove_source': True}
        if not cell.outputs and hide_source: continue          # nothing left to show (`default_exp`, empty cells)
        fold = dirs.get('code-fold')
        if fold is not None and _on(fold) and not hide_source:
            meta['gptkit_fold'] = {'open': str(fold).strip().lower() == 'show',
                                   'summary': dirs.get('code-summary', 'Code').strip('"\'')}
        if {'export', 'exports', 'exporti'} & dirs.keys() and not hide_source:
            target = dirs.get('export') or dirs.get('exports') or dirs.get('exporti') or module
            if target and not target.startswith(lib + '.'): target = f'{lib}.{target}'
            if target: meta['gptkit_note'] = f'exported to {target}'
        skipped = sorted(flags & dirs.keys())
        if skipped and not hide_source:
            meta['gptkit_note'] = f'flagged {", ".join(skipped)}: not run by default, so no output here'
        cells.append(cell)
    nb.cells = cells
    return nb


def default_exp(nb) -> str | None:
    "The module a notebook exports to, from its `default_exp` directive"
    for cell in nb.cells:
        if cell.cell_type == 'code':
            m = re.search(r'^\s*#\|\s*default_exp\s+(\S+)', cell.source, flags=re.M)
            if m: return m.group(1)
    return None


# ---------------------------------------------------------------------------------------------------------------
# nbconvert: the body of each page

TEMPLATE = r"""{%- extends 'basic/index.html.j2' -%}
{% block input_group -%}
{%- set fold = cell.metadata.get('gptkit_fold') -%}
{%- if cell.metadata.get('gptkit_note') %}<div class="cell-note">{{ cell.metadata.gptkit_note | e }}</div>{% endif -%}
{%- if fold -%}
<details class="fold"{{ ' open' if fold.open }}><summary>{{ fold.summary | e }}</summary>
{{ super() }}
</details>
{%- else -%}
{{ super() }}
{%- endif -%}
{%- endblock input_group %}
{% block data_png scoped %}
<div class="output_png output_subarea {{ extra_class }}">
<img src="data:image/png;base64,{{ output.data['image/png'] | escape_html }}"
 alt="{{ output.data.get('text/plain', 'a plot') | escape_html }}">
</div>
{%- endblock data_png %}
{% block input %}
<div class="inner_cell"><div class="input_area">
{{ cell.source | highlight_code(metadata=cell.metadata) }}
</div></div>
{%- endblock input %}
"""


@functools.cache
def exporter():
    "nbconvert's HTML exporter with our template (no prompts), skipping two slow steps that add nothing here"
    import jinja2
    from nbconvert import HTMLExporter
    from nbconvert.exporters import TemplateExporter
    from nbconvert.filters.highlight import Highlight2HTML

    class Exporter(HTMLExporter):
        def from_notebook_node(self, nb, resources=None, **kw):
            # HTMLExporter's own method adds a BeautifulSoup pass (alt text, which the template above writes, and
            # tabindex on JupyterLab markup, which this template does not use): a third of the render time
            return TemplateExporter.from_notebook_node(self, nb, resources, **kw)

    e = Exporter(extra_loaders=[jinja2.DictLoader({'gptkit.html.j2': TEMPLATE})], template_file='gptkit.html.j2',
                 exclude_input_prompt=True, exclude_output_prompt=True)
    e.register_filter('highlight_code', Highlight2HTML(pygments_lexer='python', parent=e))  # 1.6x ipython3's speed
    return e


def render_body(nb_path: Path, names: set[str] = frozenset(), flags: set[str] = frozenset(),
                lib: str = 'gptkit') -> str:
    "The HTML of one notebook's cells, as a reader sees them"
    import nbformat
    nb = nbformat.read(nb_path, as_version=4)
    apply_directives(nb, default_exp(nb), names, flags, lib)
    return exporter().from_notebook_node(nb, resources={'metadata': {'path': str(nb_path.parent)}})[0]


# ---------------------------------------------------------------------------------------------------------------
# The page around it: sidebar, previous/next, style

CSS = """
:root { --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --code: #f6f8fa; --accent: #0969da; --side: 17rem; }
* { box-sizing: border-box; }
html { font-size: 16px; }
body { margin: 0; color: var(--fg); background: #fff; line-height: 1.6;
       font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
a { color: var(--accent); text-decoration: none; } a:hover { text-decoration: underline; }
nav.sidebar { position: fixed; top: 0; left: 0; bottom: 0; width: var(--side); overflow-y: auto; padding: 1.2rem 1rem;
              border-right: 1px solid var(--line); background: #fafbfc; font-size: .9rem; }
nav.sidebar .home { display: block; font-weight: 700; font-size: 1.15rem; color: var(--fg); margin-bottom: .8rem; }
nav.sidebar ol { list-style: none; margin: 0; padding: 0; }
nav.sidebar li a { display: block; padding: .25rem .5rem; border-radius: 6px; color: var(--fg); }
nav.sidebar li a:hover { background: #eef1f4; text-decoration: none; }
nav.sidebar li.current a { background: #ddf4ff; color: var(--accent); font-weight: 600; }
nav.sidebar .num { color: var(--muted); font-variant-numeric: tabular-nums; margin-right: .35rem; }
main { margin-left: var(--side); padding: 2rem 2.5rem 4rem; }
article { max-width: 66rem; }
h1, h2, h3, h4 { line-height: 1.25; margin: 1.6em 0 .6em; }
h1 { font-size: 2rem; margin-top: 0; }
h2 { font-size: 1.5rem; border-bottom: 1px solid var(--line); padding-bottom: .3em; }
.anchor-link { visibility: hidden; margin-left: .3em; color: var(--muted); }
h1:hover .anchor-link, h2:hover .anchor-link, h3:hover .anchor-link, h4:hover .anchor-link { visibility: visible; }
blockquote { margin: 0 0 1rem; padding: .2rem 1rem; color: var(--muted); border-left: .25em solid var(--line); }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace;
            font-size: .85rem; }
:not(pre) > code { background: var(--code); padding: .1em .35em; border-radius: 4px; }
pre { margin: 0; padding: .8rem 1rem; overflow-x: auto; line-height: 1.45; }
.cell { margin: 1rem 0; }
.input_area { background: var(--code); border: 1px solid var(--line); border-radius: 6px; }
.input_area .highlight { background: transparent; }
.output_wrapper { margin-top: .35rem; }
.output_area pre { background: #fff; border-left: 3px solid var(--line); padding: .4rem .9rem; }
.output_area img { max-width: 100%; height: auto; display: block; margin: .5rem 0; }
.output_stderr pre { background: #fff8f0; border-left-color: #e3b341; }
.output_error pre { background: #fff0f0; border-left-color: #cf222e; }
.cell-note { font-size: .78rem; color: var(--muted); margin-bottom: .2rem; }
details.fold > summary { cursor: pointer; color: var(--muted); font-size: .85rem; margin-bottom: .3rem; }
table { border-collapse: collapse; margin: 1rem 0; display: block; overflow-x: auto; font-size: .9rem; }
th, td { border: 1px solid var(--line); padding: .35rem .7rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; } tr:nth-child(even) td { background: #fbfcfd; }
.widget-note { color: var(--muted); font-style: italic; }
nav.pager { display: flex; justify-content: space-between; gap: 1rem; max-width: 66rem; margin-top: 3rem;
            padding-top: 1rem; border-top: 1px solid var(--line); }
nav.pager a { display: block; padding: .6rem .9rem; border: 1px solid var(--line); border-radius: 6px; max-width: 48%; }
nav.pager a.next { margin-left: auto; text-align: right; }
nav.pager small { display: block; color: var(--muted); }
ul.chapters li { margin: .4rem 0; }
@media (max-width: 900px) {
  nav.sidebar { position: static; width: auto; border-right: 0; border-bottom: 1px solid var(--line); }
  main { margin-left: 0; padding: 1.2rem; }
}
"""


@functools.cache
def style() -> str:
    "The page style: ours plus Pygments' colours for the highlighted code"
    from pygments.formatters import HtmlFormatter
    return CSS + HtmlFormatter(style='default').get_style_defs('.highlight')


def page(title: str, body: str, nav: str, pager: str) -> str:
    return ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<title>{html.escape(title)} - gptkit</title>\n<style>{style()}</style>\n</head><body>\n'
            f'{nav}\n<main>\n<article>\n{body}\n</article>\n{pager}\n</main>\n</body></html>\n')


def sidebar(entries: list[tuple[str, str]], current: str) -> str:
    "Every page in reading order, the current one marked"
    items = []
    for href, title in entries:
        num = re.match(r'(\d+\w?)_', href)
        label = (f'<span class="num">{html.escape(num.group(1))}</span>' if num else '') + html.escape(title)
        cur = ' class="current"' if href == current else ''
        items.append(f'<li{cur}><a href="{html.escape(href)}"{" aria-current=page" if cur else ""}>{label}</a></li>')
    return ('<nav class="sidebar" aria-label="Chapters"><a class="home" href="index.html">gptkit</a>\n<ol>\n'
            + '\n'.join(items) + '\n</ol>\n</nav>')


def pager(entries: list[tuple[str, str]], i: int) -> str:
    "Previous and next links for the page at position `i` of the reading order"
    links = []
    if i > 0:
        href, title = entries[i - 1]
        links.append(f'<a class="prev" rel="prev" href="{html.escape(href)}"><small>Previous</small>'
                     f'{html.escape(title)}</a>')
    if i + 1 < len(entries):
        href, title = entries[i + 1]
        links.append(f'<a class="next" rel="next" href="{html.escape(href)}"><small>Next</small>'
                     f'{html.escape(title)}</a>')
    return '<nav class="pager" aria-label="Previous and next">' + ''.join(links) + '</nav>'


def _write(path: Path, text: str):
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(text, encoding='utf-8')
    tmp.replace(path)


IMG_SRC = re.compile(r"""<img\b[^>]*?\bsrc\s*=\s*["']([^"']+)["']""", re.I)


def local_images(body: str) -> list[str]:
    "The relative paths of the images a page's HTML shows (`images/families.png`), not data: or web addresses"
    found = [html.unescape(src) for src in IMG_SRC.findall(body)]
    return [src for src in dict.fromkeys(found) if not re.match(r'^([a-z][a-z0-9+.-]*:|/|#)', src, flags=re.I)]


def copy_images(body: str, src_dir: Path, out: Path) -> list[Path]:
    "Copy the images the page `body` links to from the notebook's folder `src_dir` to the same paths under `out`"
    copied = []
    for rel in local_images(body):
        src, dst = (src_dir / rel).resolve(), (out / rel).resolve()
        if not dst.is_relative_to(out):
            print(f'warning: {rel} lies outside {out}; not copied', file=sys.stderr)
        elif not src.is_file():
            print(f'warning: a page shows {rel}, which is not in {src_dir}', file=sys.stderr)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            copied.append(dst)
    return copied


def contents(nbs: list[Path]) -> str:
    "The body of docs/index.html: every page with its summary"
    items = []
    for nb in nbs:
        title, summary = chapter_title(nb)
        items.append(f'<li><a href="{page_name(nb)}">{html.escape(title)}</a> <code>{html.escape(nb.name)}</code>'
                     f'{" &mdash; " + html.escape(summary) if summary else ""}</li>')
    return ('<h1>gptkit documentation</h1>\n<p>The chapters, rendered from the notebooks in <code>nbs/</code> with '
            'the outputs they keep:</p>\n<ul class="chapters">\n' + '\n'.join(items) + '\n</ul>')


def render_html(out: Path, nbs_dir: Path = NBS) -> list[Path]:
    "Write one page per notebook in `nbs_dir` and docs/index.html into `out`; returns the pages in reading order"
    from nbdev.config import get_config
    cfg = get_config(nbs_dir)
    flags, lib = set(cfg.tst_flags.split()), cfg.lib_path.name
    nbs = notebooks(nbs_dir)
    names = {nb.stem for nb in nbs}
    titles = ['Overview' if nb.stem == 'index' else chapter_title(nb)[0] for nb in nbs]
    entries = [('index.html', 'Contents')] + [(page_name(nb), t) for nb, t in zip(nbs, titles)]
    out.mkdir(parents=True, exist_ok=True)
    _write(out / 'index.html', page('Contents', contents(nbs), sidebar(entries, 'index.html'), pager(entries, 0)))
    pages = [out / 'index.html']
    for i, nb in enumerate(nbs, start=1):
        href, title = entries[i]
        body = render_body(nb, names, flags, lib)
        copy_images(body, nb.parent, out)             # a markdown image such as ![...](images/families.png)
        _write(out / href, page(title, body, sidebar(entries, href), pager(entries, i)))
        pages.append(out / href)
        print(f'rendered {nb.relative_to(nbs_dir.parent) if nb.is_relative_to(nbs_dir.parent) else nb} -> {out / href}')
    return pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path, default=ROOT / 'docs', help='where to write the HTML (default docs/)')
    ap.add_argument('--quarto', action='store_true', help="run nbdev-docs (Quarto's site) instead; needs Quarto")
    args = ap.parse_args(argv)
    if args.quarto:
        if not shutil.which('quarto'): raise SystemExit('--quarto needs Quarto on PATH (https://quarto.org)')
        return subprocess.run([str(Path(sys.executable).parent / 'nbdev-docs')], cwd=ROOT).returncode
    render_html(args.out.resolve())
    print(f'wrote {args.out / "index.html"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
