"""tools/docs.py renders every notebook to HTML (the fallback used when Quarto is missing).

The notebooks' cells are run by tests/test_notebooks.py; here the render runs with --no-execute, and the execution
step (outputs kept, cells flagged gpu/slow shown but not run) is checked on a small notebook."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
import docs  # noqa: E402


def test_docs_render_every_chapter(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'docs.py'), '--out', str(tmp_path), '--no-execute'],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    index = (tmp_path / 'index.html').read_text()
    links = re.findall(r'<a href="([^"]+)">', index)
    chapters = sorted(p.stem for p in (ROOT / 'nbs').glob('[0-9]*.ipynb'))
    assert links == ['overview.html'] + [f'{c}.html' for c in chapters]
    for page in links:
        text = (tmp_path / page).read_text()
        assert 'Traceback' not in text and 'NameError' not in text, f'{page} shows an error'


def test_execution_keeps_outputs_and_skips_flagged_cells(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('print(6 * 7)'),
                                         nbformat.v4.new_code_cell('#| gpu\nraise RuntimeError("no GPU here")')])
    path = tmp_path / 'x.ipynb'
    nbformat.write(nb, path)
    docs.execute(path)
    done = nbformat.read(path, as_version=4)
    assert done.cells[0].outputs[0]['text'] == '42\n'
    assert done.cells[1].outputs == [] and 'skip-execution' in done.cells[1].metadata['tags']
    assert 'no GPU here' in docs.to_html(path)            # shown, not run
