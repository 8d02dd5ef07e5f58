"""The library is what the notebooks export, and the notebooks are clean (nbdev-clean changes nothing)."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _copy_project(dst: Path) -> Path:
    for name in ('pyproject.toml', 'settings.ini'): shutil.copy(ROOT / name, dst / name)
    for name in ('nbs', 'gptkit'): shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns('__pycache__'))
    return dst


def _files(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob('*')) if p.is_file() and '__pycache__' not in p.parts}


def _run(cmd, cwd):
    env = {k: v for k, v in __import__('os').environ.items() if k != 'IN_TEST'}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def _diff(before: dict, after: dict) -> list:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def test_library_matches_notebooks(tmp_path):
    proj = _copy_project(tmp_path)
    _run([str(BIN / 'nbdev-export')], proj)
    changed = _diff(_files(ROOT / 'gptkit'), _files(proj / 'gptkit'))
    assert not changed, f'nbdev-export changes {changed}: edit the notebooks, then run nbdev-export'


def test_notebooks_are_clean(tmp_path):
    proj = _copy_project(tmp_path)
    _run([str(BIN / 'nbdev-clean')], proj)
    changed = _diff(_files(ROOT / 'nbs'), _files(proj / 'nbs'))
    assert not changed, f'nbdev-clean changes {changed}: run nbdev-clean and commit'
