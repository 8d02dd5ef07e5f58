"""tools/docs.py renders every notebook to HTML (the fallback used when Quarto is missing)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_render_every_chapter(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'docs.py'), '--out', str(tmp_path)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    index = (tmp_path / 'index.html').read_text()
    links = re.findall(r'<a href="([^"]+)">', index)
    chapters = sorted(p.stem for p in (ROOT / 'nbs').glob('[0-9]*.ipynb'))
    assert links == ['overview.html'] + [f'{c}.html' for c in chapters]
    for page in links:
        text = (tmp_path / page).read_text()
        assert 'Traceback' not in text and 'NameError' not in text, f'{page} shows an error'
    assert (tmp_path / '01_estimate.html').read_text().count('data:image/png') >= 2  # the memory plots
