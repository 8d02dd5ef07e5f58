"""The project's own promises: the README's commands, CI, the nbdev settings, the pinned versions."""
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r'```sh\n(.+?)\n```', (ROOT / 'README.md').read_text(encoding='utf-8'))[:2]


def test_readme_is_generated_from_the_index_notebook():
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'readme.py'), '--check'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_has_the_two_commands_and_ci_runs_the_test_one():
    main, tests = readme_commands()
    assert main.endswith('gptkit quickstart') and 'constraints.txt' in main
    assert 'pytest' in tests and 'constraints.txt' in tests
    ci = [l for l in (ROOT / '.ci' / 'run').read_text().splitlines() if l.strip() and not l.startswith(('#', 'set ', 'cd '))]
    assert ci == [tests]


def test_pyproject_holds_only_build_system_nbdev_and_ruff():
    cfg = tomllib.loads((ROOT / 'pyproject.toml').read_text())
    assert set(cfg) == {'build-system', 'tool'} and set(cfg['tool']) == {'nbdev', 'ruff'}
    assert cfg['tool']['ruff']['line-length'] == 120 and set(cfg['tool']['ruff']['lint']['select']) == {'E501', 'E701', 'E702', 'E703', 'F', 'I'}
    assert {'slow', 'gpu'} <= set(cfg['tool']['nbdev']['tst_flags'].split())


def test_constraints_pin_every_requirement_and_torch():
    lines = (ROOT / 'constraints.txt').read_text().splitlines()
    pins = dict(l.split('==') for l in lines if '==' in l and not l.startswith('#'))
    assert pins['torch'] == '2.13.0'
    from configparser import ConfigParser
    cfg = ConfigParser(); cfg.read(ROOT / 'settings.ini')
    reqs = cfg['DEFAULT']['requirements'].split() + cfg['DEFAULT']['dev_requirements'].split()
    assert not [r for r in reqs if r.lower() not in pins], 'every requirement needs a pin in constraints.txt'


def test_every_notebook_is_listed_in_the_index():
    listed = (ROOT / 'README.md').read_text()
    for nb in sorted((ROOT / 'nbs').glob('[0-9]*.ipynb')):
        assert f'nbs/{nb.name}' in listed, f'{nb.name} is missing from the chapter table in nbs/index.ipynb'
