"""The offline docs (tools/docs.py) and the re-execution that gives notebooks their outputs (tools/run_notebooks.py).

The real chapters are rendered once, without running anything, and read in headless Chromium as a reader would:
no directive or In/Out prompt in sight, every chapter in the sidebar, a working next link, the plots shown. The
directives and the execution rules are each checked on a small notebook made here."""
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
import docs  # noqa: E402
import run_notebooks  # noqa: E402

CHAPTERS = sorted(p.stem for p in (ROOT / 'nbs').glob('[0-9]*.ipynb'))
ORDER = ['index.html', 'overview.html'] + [f'{c}.html' for c in CHAPTERS]


@pytest.fixture(scope='module')
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp('docs')
    assert docs.main(['--out', str(out)]) == 0          # in this process: the directive test below reuses its imports
    return out


def _chromium():
    path = shutil.which('chromium') or shutil.which('chromium-browser')
    if path is None:
        pytest.fail("Debian's chromium is not installed: the README's test command installs it "
                    "(apt-get install chromium)")
    return path


def _plotted(nb: Path) -> int:
    "How many PNG outputs the notebook keeps in the cells a reader sees"
    shown = docs.apply_directives(nbformat.read(nb, as_version=4)).cells
    return sum('image/png' in o.get('data', {}) for c in shown if c.cell_type == 'code' for o in c.outputs)


def _chapter_to_read() -> Path:
    "A chapter with hidden cells and a kept plot whose own text never contains '#|' outside its directives"
    for stem in CHAPTERS:
        nb = ROOT / 'nbs' / f'{stem}.ipynb'
        src = nb.read_text(encoding='utf-8')
        prose = re.sub(r'"#\|[^"\n]*', '', src)
        if '"#| hide' in src and _plotted(nb) and '#|' not in prose: return nb
    pytest.fail('no chapter keeps a plot: run python tools/run_notebooks.py and commit the notebooks')


def test_every_page_is_written_and_shows_no_error(rendered):
    assert sorted(p.name for p in rendered.glob('*.html')) == sorted(ORDER)
    for page in ORDER:
        text = (rendered / page).read_text(encoding='utf-8').split('</style>', 1)[1]
        outputs = re.findall(r'output_subarea[^>]*>(.*?)</div>', text, re.S)   # what cells printed, not their code
        assert 'output_error' not in text and not any('Traceback' in o for o in outputs), f'{page} shows an error'
        assert '<nav class="sidebar"' in text and 'class="prompt' not in text, page


def test_every_chapter_shows_no_directive_line():
    "What each real notebook shows once its directives are applied: no line of code starts with `#|`"
    for nb_path in docs.notebooks():
        nb = docs.apply_directives(nbformat.read(nb_path, as_version=4))
        shown = [c for c in nb.cells if c.cell_type == 'code' and not c.metadata.get('transient')]
        assert not [l for c in shown for l in c.source.splitlines() if l.lstrip().startswith('#|')], nb_path.name


def test_a_chapter_reads_right_in_chromium(rendered):
    from playwright.sync_api import sync_playwright
    nb = _chapter_to_read()
    i = ORDER.index(f'{nb.stem}.html')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            '--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
            '--disable-component-update', '--disable-sync', '--no-first-run'])
        try:
            page = browser.new_page()
            page.goto((rendered / ORDER[i]).as_uri())
            text = page.inner_text('body')
            assert '#|' not in text, [l for l in text.splitlines() if '#|' in l][:5]
            assert not re.search(r'\b(In|Out)\s*\[\s*\d*\s*\]', text), 'an In/Out prompt is shown'
            assert 'default_exp' not in text
            sidebar = page.eval_on_selector_all('nav.sidebar li a', 'els => els.map(e => e.getAttribute("href"))')
            assert sidebar == ORDER
            assert page.get_attribute('nav.sidebar li.current a', 'href') == ORDER[i]
            imgs = page.eval_on_selector_all('article img', 'els => els.map(e => [e.naturalWidth, e.alt])')
            assert len(imgs) >= _plotted(nb) > 0 and all(w > 0 for w, _ in imgs), imgs   # decoded, not broken
            page.click('nav.pager a[rel=next]')
            page.wait_for_load_state()
            assert page.url.endswith('/' + ORDER[i + 1])
            assert page.get_attribute('nav.sidebar li.current a', 'href') == ORDER[i + 1]
            page.click('nav.pager a[rel=prev]')
            page.wait_for_load_state()
            assert page.url.endswith('/' + ORDER[i])
        finally: browser.close()


def _nb(path: Path, cells) -> Path:
    nbformat.write(new_notebook(cells=cells, metadata={'kernelspec': {'name': 'python3', 'language': 'python',
                                                                      'display_name': 'python3'}}), path)
    return path


def test_directives_are_honoured(tmp_path):
    def out(text): return [new_output('stream', name='stdout', text=text)]
    nb = _nb(tmp_path / '03_x.ipynb', [
        new_markdown_cell('# X\n\n> a chapter; see [samples](nbs/06_data.samples.ipynb) and [nowhere](zz.ipynb)'),
        new_code_cell('#| default_exp data.x'),
        new_code_cell('#| export\ndef shown(): return 1', outputs=[]),
        new_code_cell('#| hide\nsecret_hidden_source = 1', outputs=out('secret hidden output\n')),
        new_code_cell('#|echo: false\nsecret_echo_source()', outputs=out('echoed output\n')),
        new_code_cell('#| output: false\nvisible_no_output()', outputs=out('secret output false\n')),
        new_code_cell('#| eval: false\nnot_evaluated()', outputs=out('secret eval false\n')),
        new_code_cell('#| include: false\nsecret_include()'),
        new_code_cell('#| code-fold: true\n#| code-summary: "How it is drawn"\nfolded()', outputs=out('fold out\n')),
        new_code_cell('#| gpu\nneeds_a_gpu()'),
        new_code_cell('a = 1\nb = 2  #| hide_line\nc = 3', outputs=[new_output(
            'execute_result', data={'text/plain': '3'}, execution_count=7)], execution_count=7),
    ])
    body = docs.render_body(nb, names={'06_data.samples', 'index'}, flags={'gpu', 'slow'})
    assert 'secret' not in body and '#|' not in body and 'default_exp' not in body
    assert 'shown' in body and 'exported to gptkit.data.x' in body
    assert 'echoed output' in body and 'visible_no_output' in body and 'not_evaluated' in body
    assert '<details class="fold"><summary>How it is drawn</summary>' in body and 'fold out' in body
    assert 'flagged gpu' in body and 'needs_a_gpu' in body
    assert 'b = 2' not in body and 'c' in body and 'Out[' not in body and 'In&nbsp;[' not in body
    assert 'href="06_data.samples.html"' in body and 'href="zz.ipynb"' in body


def test_run_notebooks_keeps_outputs_and_plots_and_skips_flagged_cells(tmp_path):
    shutil.copy(ROOT / 'pyproject.toml', tmp_path)          # nbdev reads tst_flags from here
    (tmp_path / 'nbs').mkdir()
    nb = _nb(tmp_path / 'nbs' / 'x.ipynb', [
        new_markdown_cell('# X'),
        new_code_cell('import os; print(6 * 7, os.environ["IN_TEST"])'),
        new_code_cell('import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);'),
        new_code_cell('#| gpu\nraise RuntimeError("no GPU here")', outputs=[new_output('stream', text='stale\n')]),
        new_code_cell('#| eval: false\nraise RuntimeError("not to be run")'),
    ])
    assert run_notebooks.execute(nb, timeout=120) == 2                      # the two unflagged code cells
    run_notebooks.clean([nb])
    done = nbformat.read(nb, as_version=4)
    assert done.cells[1].outputs[0]['text'] == '42 1\n'
    assert [o for o in done.cells[2].outputs if 'image/png' in o.get('data', {})]    # the plot, inline
    assert done.cells[3].outputs == [] and done.cells[4].outputs == []
    assert all(c.metadata == {} for c in done.cells)                            # no tags or timings left
    before = nb.read_bytes()
    run_notebooks.clean([nb])
    assert nb.read_bytes() == before                                            # clean already: test_sync stays green
