"""What a newcomer reads (issue 51, items 8 and 9): the estimator's words, help texts, logs, docs images, start-up."""
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
import docs  # noqa: E402

from gptkit_cli.main import app  # noqa: E402

runner = CliRunner()


def flat(text: str) -> str:
    "Rich's output as one line of words: box characters and line breaks gone"
    return ' '.join(re.sub(r'[│╭╮╰╯─]', ' ', text).split())


def test_a_layout_that_does_not_fit_has_no_time_or_mfu_and_says_what_would_fit():
    r = runner.invoke(app, ['estimate', '--params', '13B'])          # one A100-80GB: 267.61 GiB a GPU
    assert r.exit_code == 0, r.output
    words = flat(r.output)
    assert 'does not fit' in words
    assert 'MFU / HFU' not in words and 'days' not in words and 'GPU-hours' not in words
    assert 'Step time on' not in words                               # the step's breakdown: none either
    assert 'try gptkit estimate --params 13B --search --gpus N' in words
    fits = runner.invoke(app, ['estimate', '--params', '13B', '--gpus', '64', '--tp', '8', '--pp', '2', '--zero', '1',
                               '--sequence-parallel', '--recompute', 'selective'])
    assert 'MFU / HFU' in flat(fits.output) and '28.9 days' in flat(fits.output)


def test_the_quickstart_and_the_readme_say_the_mfu_the_estimate_uses(capsys):
    from gptkit.config.sections import PRESETS, ParallelConfig, TrainConfig
    from gptkit.estimate.sizing import GPUS, estimate
    from gptkit_cli import quickstart
    e = estimate(PRESETS['13b'].model, ParallelConfig(tp=8, pp=2, dp=4, zero=1, sequence_parallel=True),
                 TrainConfig(micro_batch=1, global_batch=1024, recompute='selective'), GPUS['a100-80gb'])
    said = f'{e.mfu:.1%} MFU'
    assert said != '40.0% MFU'
    quickstart._estimate_stage()
    shown = flat(capsys.readouterr().out)
    assert f'{e.seconds / 86400:,.1f} days at {said}' in shown and '40% MFU' not in shown
    index = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text())
    example = next(c for c in index['cells'] if 'days at' in ''.join(c['source']))
    assert '40% MFU' not in ''.join(example['source']) and '{e.mfu:.1%} MFU' in ''.join(example['source'])
    assert f'{e.seconds / 86400:.1f} days at {said}' in ''.join(example['outputs'][0]['text'])
    assert '40% MFU' not in (ROOT / 'README.md').read_text()


def test_checkpoint_help_names_every_family_that_imports():
    from gptkit.interop.hf_config import LLAMA_LIKE, MOE_TYPES
    from gptkit_cli.checkpoint import FAMILY_NAMES
    for args in (['checkpoint', 'import', '--help'], ['checkpoint', '--help'], ['checkpoint', 'export', '--help']):
        words = flat(runner.invoke(app, args).output)
        assert 'GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, OLMoE' in words, args
    assert list(FAMILY_NAMES) == ['gpt2', *LLAMA_LIKE, *MOE_TYPES]


def test_perplexity_past_a_million_in_scientific_notation():
    from rich.console import Console
    from gptkit_cli import eval as cli_eval
    p = NS(words=1000, source='held-out.txt', documents=1, scored=2000, windows=2, context=1024, stride=512,
           loss=10.0, perplexity=22026.47, word_perplexity=1.0054246888112569e20, tokens=2001, seconds=1.0)
    console = Console(width=80, record=True)
    res = NS(checkpoint='runs/tiny', iteration=200, tokens_trained=10**6, parameters=10**6, device='cpu', perplexity=p,
             cloze=None)
    console.print(cli_eval._table(res))
    text = console.export_text()
    assert '1.005e+20' in text and '22,026.47' in text and '…' not in text


def test_progress_in_a_log_is_whole_lines(capsys):
    from gptkit_cli.train import RichProgress
    progress = RichProgress()                             # stdout is pytest's capture: not a terminal
    progress.on_start(NS(iters=100, start=0, resumed_from=None, device='cpu', cfg=None, world_size=1))
    m = NS(iteration=10, loss=5.104, lr=5.5e-4, tokens_per_s=12345.0, tflops=0.512, mfu=0.031, grad_norm=1.25,
           loss_scale=None, memory_gib=0.5, step_seconds=0.1)
    progress.on_step(m)
    progress.on_step(NS(**{**vars(m), 'iteration': 20, 'loss': 4.9}))
    progress.on_end(None)
    lines = capsys.readouterr().out.splitlines()
    want = 'loss 5.104 | lr 5.50e-04 | 12,345 tok/s | 0.512 TFLOP/s | MFU 3.1% | grad 1.25 | 0.5 GiB'
    assert any(line.startswith('train 10/100 | ' + want) for line in lines), lines
    assert any(line.startswith('train 20/100 | loss 4.900') for line in lines), lines
    assert not any('…' in line for line in lines), lines


def test_docs_pages_find_every_image_they_show(tmp_path, monkeypatch):
    chapters = [ROOT / 'nbs' / '07b_model.decoder.ipynb', ROOT / 'nbs' / '07d_model.moe.ipynb']
    monkeypatch.setattr(docs, 'notebooks', lambda nbs: chapters)
    docs.render_html(tmp_path)
    shown = 0
    for page in ('07b_model.decoder.html', '07d_model.moe.html'):
        for src in re.findall(r'<img\b[^>]*?\bsrc="([^"]+)"', (tmp_path / page).read_text()):
            if not src.startswith('data:'):
                assert (tmp_path / src).is_file(), f'{page} shows {src}, which docs/ lacks'
                shown += 1
    assert shown >= 2                                      # images/families.png and images/families_moe.png


def test_chapter_11_keeps_one_frame_of_its_live_plot():
    nb = json.loads((ROOT / 'nbs' / '11_train.loop.ipynb').read_text())
    cell = next(c for c in nb['cells'] if c['cell_type'] == 'code' and 'LivePlot()' in ''.join(c['source']))
    frames = [o for o in cell['outputs'] if 'image/png' in o.get('data', {})]
    assert len(frames) == 1, f'{len(frames)} frames of the live plot'


def test_the_cli_starts_without_pydantic_torch_or_numpy():
    heavy = ('pydantic', 'pydantic_core', 'torch', 'numpy', 'gptkit.interop.hf_config', 'gptkit.train.engine', 'gptkit.store.folders')
    for argv in (['--help'], ['estimate', '--params', '13B'], ['estimate', '--help']):
        code = ('import sys\n'
                f'sys.argv = ["gptkit", *{argv!r}]\n'
                'from gptkit_cli.main import main\n'
                'try:\n    main()\nexcept SystemExit:\n    pass\n'
                f'print("HEAVY", sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\n')
        r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
        assert 'HEAVY []' in r.stderr, (argv, r.stderr[-500:])


def test_plain_options_are_coerced_as_before():
    r = runner.invoke(app, ['estimate', '--tp', 'abc'])
    assert r.exit_code == 2 and "'abc' is not a valid integer" in flat(r.output)
    r = runner.invoke(app, ['estimate', '--preset', '1.3b', '--gpu-memory', '40', '--tokens', '1B', '--flash',
                            '--json'])
    d = json.loads(r.output)
    assert d['gpu']['memory'] == 40 * 2**30 and d['time']['tokens'] == 10**9
    r = runner.invoke(app, ['estimate', '--params', '1B', '--hardware', 'no-such-file.json'])   # a Path option
    assert r.exit_code == 2 and 'hardware profile file no-such-file.json cannot be read' in flat(r.output)
