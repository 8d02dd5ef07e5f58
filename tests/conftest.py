import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption('--nb-flags', default=os.environ.get('GPTKIT_NB_FLAGS', ''),
                     help='nbdev test flags to run that are skipped by default, e.g. "gpu slow"')


@pytest.fixture(scope='session')
def root() -> Path:
    return ROOT
