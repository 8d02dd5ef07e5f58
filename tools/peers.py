"""Running peers' own tools next to gptkit in tests and benchmarks.

- wikiextractor 3.0.6 (a dev requirement). Its regular expressions fail to compile on Python 3.11, so it runs in
  a subprocess under an older interpreter found on this machine, with this venv's site-packages on its path.
- Megatron-LM's tools/preprocess_data.py. It is not in the megatron-core wheel and Megatron-LM is not on PyPI, so
  it runs from a Megatron-LM source tree you give (`git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM`,
  the tag of the installed megatron-core), in this venv, whose megatron-core it imports."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path


def old_python() -> str | None:
    "An interpreter older than 3.11, or None"
    for cand in ['python3.10', 'python3.9', *sorted(map(str, Path.home().glob('.pyenv/versions/3.1[0]*/bin/python3')))]:
        try:
            if subprocess.run([cand, '-c', 'import sys; assert sys.version_info < (3, 11)'],
                              capture_output=True).returncode == 0: return cand
        except OSError: continue
    return None


def wikiextractor(dump: Path, out: Path, processes: int = 1) -> subprocess.CompletedProcess | str:
    "wikiextractor --json on `dump` into folder `out` (its wiki_* files), or why it cannot run here"
    spec, py = importlib.util.find_spec('wikiextractor'), old_python()
    if spec is None: return 'wikiextractor is not installed in this venv (dev requirement)'
    if py is None: return 'no Python < 3.11 found to run wikiextractor 3.0.6'
    site = str(Path(spec.submodule_search_locations[0]).parent)
    cmd = [py, '-m', 'wikiextractor.WikiExtractor', '--json', '--processes', str(processes), '-q',
           '-o', str(out), str(dump)]
    return subprocess.run(cmd, env={**os.environ, 'PYTHONPATH': site}, capture_output=True, text=True)


def megatron_checkout(path: str | None) -> Path | str:
    "The Megatron-LM source tree at `path` if its tools/preprocess_data.py is there, or why it cannot be used"
    if not path: return 'no Megatron-LM source tree given (--megatron-lm PATH or MEGATRON_LM)'
    tree = Path(path).expanduser()
    if not (tree / 'tools' / 'preprocess_data.py').is_file() or not (tree / 'megatron' / 'training').is_dir():
        return f'{tree} is not a Megatron-LM source tree (no tools/preprocess_data.py and megatron/training)'
    return tree


def megatron_preprocess(tree: Path, jsonl: Path, prefix: Path, workers: int) -> subprocess.CompletedProcess:
    """Megatron-LM's tools/preprocess_data.py on `jsonl` with GPT-2's BPE (GPT2BPETokenizer, the vocab.json and
    merges.txt that gptkit ships, written beside `prefix`) and --append-eod, as Megatron-DeepSpeed's walkthrough runs
    it: writes PREFIX_text_document.bin/.idx"""
    import gzip

    from gptkit.tokenizer.bpe import asset
    files = {}
    for name in ('vocab.json', 'merges.txt'):
        files[name] = prefix.parent / f'megatron-{name}'
        files[name].write_bytes(gzip.decompress((asset('gpt2') / f'{name}.gz').read_bytes()))
    cmd = [sys.executable, str(tree / 'tools' / 'preprocess_data.py'), '--input', str(jsonl), '--output-prefix',
           str(prefix), '--tokenizer-type', 'GPT2BPETokenizer', '--legacy-tokenizer', '--vocab-file',
           str(files['vocab.json']), '--merge-file', str(files['merges.txt']), '--append-eod',
           '--workers', str(workers)]
    return subprocess.run(cmd, env={**os.environ, 'PYTHONWARNINGS': 'ignore'}, capture_output=True, text=True)
