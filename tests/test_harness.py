"""lm-evaluation-harness through gptkit: on local tasks (multiple choice, generation, rolling perplexity) the gptkit
model class gives what lm-eval's own HFLM gives on the Hugging Face export of the same checkpoint; `gptkit eval
--tasks` prints a table and saves JSON; an unknown task, a missing data file or a missing lm-eval: one sentence,
nothing written; under tensor parallelism (2 gloo processes) the same metrics."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_here, torch_threads

from gptkit.errors import ConfigError, DataError
from gptkit.eval.harness import evaluate_tasks, find_tasks, load_tasks, metric_rows, require_lm_eval

DATA = Path(__file__).parent / 'data' / 'harness'
TASKS = 'kjv_choice,kjv_complete,kjv_verses'
DIST_ENV = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')


@pytest.fixture(scope='module', autouse=True)
def offline_one_thread():
    require_lm_eval(offline=True)           # nothing from the network: the tasks read tests/data/harness
    with torch_threads(1):
        yield


@pytest.fixture(scope='module')
def gptkit_results(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp('harness') / 'results.json'
    return evaluate_tasks(tiny_checkpoint, TASKS, include_path=DATA, batch_size=3, offline=True, log_samples=True,
                          out=out)


def responses(res: dict, task: str) -> list:
    return [s['resps'] for s in sorted(res['samples'][task], key=lambda s: s['doc_id'])]


def scores(resps: list) -> list[float]:
    "The log-likelihoods in one sample's responses: (value, greedy) per choice, or the value of a whole text"
    return [x[0][0] if isinstance(x[0], (list, tuple)) else x[0] for x in resps]


def hflm_results(hf: Path, limit=None) -> dict:
    "lm-eval's own HFLM on a Hugging Face folder, on the test tasks"
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    tm, specs = find_tasks(TASKS, DATA)
    return lm_eval.simple_evaluate(HFLM(pretrained=str(hf), device='cpu', batch_size=4), tasks=load_tasks(tm, specs),
                                   task_manager=tm, log_samples=True, limit=limit)


def check_equal(want: dict, got: dict):
    "Every metric (1e-4), every log-likelihood (1e-6 relative) and every generated text the same"
    rows = {r[:2]: r[2:] for r in metric_rows(got)}
    assert {r[:2] for r in metric_rows(want)} == set(rows) and len(rows) == 6
    for task, metric, value, se, n in metric_rows(want):
        assert rows[task, metric][0] == pytest.approx(value, rel=1e-4, abs=1e-4), (task, metric)
        assert rows[task, metric][2] == n
        if se is not None:
            assert rows[task, metric][1] == pytest.approx(se, rel=1e-4, abs=1e-4)
    for task in ('kjv_choice', 'kjv_verses'):                                   # every log-likelihood, not just means
        for a, b in zip(responses(want, task), responses(got, task), strict=True):
            assert scores(a) == pytest.approx(scores(b), rel=1e-6, abs=1e-4)
    assert responses(got, 'kjv_complete') == responses(want, 'kjv_complete')   # greedy text, cut at the stop strings


def test_metrics_equal_lm_evals_own_hflm_on_the_hugging_face_export(tiny_checkpoint, gptkit_results, tmp_path):
    from gptkit.interop.hf import export_hf
    got = gptkit_results
    check_equal(hflm_results(export_hf(tiny_checkpoint, tmp_path / 'hf')), got)
    rows = {r[:2]: r[2] for r in metric_rows(got)}
    assert 0 < rows['kjv_choice', 'acc'] < 1 and 0 < rows['kjv_choice', 'acc_norm'] < 1          # not all one way
    assert sum(bool(t[0][0].strip()) for t in responses(got, 'kjv_complete')) >= 6               # text to compare
    saved = json.loads(Path(got['file']).read_text())
    assert saved['results']['kjv_choice']['acc,none'] == got['results']['kjv_choice']['acc,none']


def test_a_llama_3_checkpoint_scores_with_its_begin_of_text_as_hflm_does(tmp_path):
    # found by trying: without the token Llama 3's post-processor adds, word perplexity differed by 9.9%
    from test_family_tokenizers import llama3

    from gptkit.config.sections import LLAMA, ModelConfig
    from gptkit.interop.hf import export_hf, write_run
    from gptkit.model.decoder import GPT
    from gptkit.tokenizer.bpe import load_tokenizer
    llama3(tmp_path / 'tok')
    tok = load_tokenizer(tmp_path / 'tok')
    torch.manual_seed(0)
    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=64, vocab=tok.vocab_size,
                      tie_embeddings=False, **LLAMA)
    run = write_run(GPT(cfg).state_dict(), cfg, tok, tmp_path / 'run', 'a random tiny Llama')
    got = evaluate_tasks(run, TASKS, include_path=DATA, batch_size=4, offline=True, log_samples=True, limit=6)
    check_equal(hflm_results(export_hf(run, tmp_path / 'hf'), limit=6), got)


def test_cli_prints_a_table_and_saves_json_in_the_run_folder(tiny_checkpoint, tmp_path):
    run = shutil.copytree(tiny_checkpoint, tmp_path / 'run')
    r = run_here('eval', '--checkpoint', run, '--tasks', 'kjv_choice', '--include-path', DATA, '--limit', 6,
                 '--offline')
    assert r.returncode == 0, r.stderr[-2000:]
    files = list((run / 'eval').glob('lm_eval-*.json'))
    assert len(files) == 1 and not list((run / 'eval').glob('.*'))              # no temporary left beside it
    res = json.loads(files[0].read_text())['results']['kjv_choice']
    lines = [line.split() for line in r.stdout.splitlines() if line.split()[:1] == ['kjv_choice']]
    assert [line[1] for line in lines] == ['acc', 'acc_norm']
    assert [float(line[2]) for line in lines] == pytest.approx([res['acc,none'], res['acc_norm,none']], abs=1e-4)
    assert all(line[-1] == '6' for line in lines) and f'{res["acc_stderr,none"]:.4f}' in r.stdout


def said(r) -> str:
    "What a command run by `run_here` printed, without the SystemExit that CliRunner records"
    return '\n'.join(line for line in (r.stdout + r.stderr).splitlines() if not line.startswith('SystemExit'))


def test_unknown_task_is_one_sentence_before_the_model_loads_and_nothing_is_written(tiny_checkpoint, tmp_path,
                                                                                      monkeypatch):
    import lm_eval.tasks
    class LocalOnly(lm_eval.tasks.TaskManager):      # lm-eval's own 14,000 tasks take 6-13 s to index: not looked at
        def __init__(self, *args, include_defaults=True, **kw):
            super().__init__(*args, include_defaults=False, **kw)
    monkeypatch.setattr(lm_eval.tasks, 'TaskManager', LocalOnly)
    run = shutil.copytree(tiny_checkpoint, tmp_path / 'run')
    r = run_here('eval', '--checkpoint', run, '--tasks', 'kjv_choice,kjv_nonesuch', '--include-path', DATA)
    msg = said(r)
    assert r.returncode == 2 and len(msg.splitlines()) == 1, msg
    assert msg == (f"error: --tasks kjv_nonesuch: no lm-eval task, group or tag of that name in {DATA} or lm-eval's "
                   'own tasks')
    assert not (run / 'eval').exists()
    with pytest.raises(ConfigError, match=r'--include-path|include_path .*: no such folder'):
        evaluate_tasks(tmp_path / 'no_run', 'kjv_choice', include_path=tmp_path / 'nowhere')


def test_a_missing_data_file_is_named_with_its_yaml(tmp_path):
    (tmp_path / 'gone.yaml').write_text((DATA / 'kjv_choice.yaml').read_text().replace('kjv_choice', 'gone'))
    with pytest.raises(DataError, match=rf'^{tmp_path}/gone.yaml: data_files names gone.jsonl, which is neither '
                                        'beside the YAML nor in '):
        evaluate_tasks(tmp_path / 'no_run', 'gone', include_path=tmp_path)


def test_without_lm_eval_the_module_imports_and_eval_tasks_says_how_to_install(tiny_checkpoint, monkeypatch):
    code = "import sys; sys.modules['lm_eval'] = None; import gptkit.eval.harness, gptkit_cli.main"
    assert subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).returncode == 0
    monkeypatch.setitem(sys.modules, 'lm_eval', None)                           # what an import finds when missing
    r = run_here('eval', '--checkpoint', tiny_checkpoint, '--tasks', 'hellaswag')
    assert r.returncode == 1 and said(r) == (
        "error: gptkit eval --tasks runs lm-evaluation-harness, which is not installed: pip install 'gptkit[eval]'")


def _worker(rank, world, ckpt, init_file, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        got = evaluate_tasks(ckpt, TASKS, include_path=DATA, batch_size=3, offline=True, log_samples=True, tp=world,
                             device='cpu', out=out)
        assert (got is None) == (rank != 0)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_metrics_equal_one_process(tiny_checkpoint, gptkit_results, tmp_path, request):
    if 'slow' not in (request.config.getoption('--nb-flags') or ''):
        pytest.skip('slow: run with --nb-flags slow')
    import torch.multiprocessing as mp
    env = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
    try:
        mp.spawn(_worker, args=(2, str(tiny_checkpoint), str(tmp_path / 'init'), str(tmp_path / 'tp.json')),
                 nprocs=2, join=True)
    finally:
        os.environ.update(env)
    got = json.loads((tmp_path / 'tp.json').read_text())
    want = {r[:2]: r[2] for r in metric_rows(gptkit_results)}
    assert {r[:2]: r[2] for r in metric_rows(got)} == pytest.approx(want, rel=1e-5)
    assert responses(got, 'kjv_complete') == json.loads(json.dumps(responses(gptkit_results, 'kjv_complete')))


def test_a_task_file_that_names_python_code_is_refused_and_the_code_never_runs(tiny_checkpoint, tmp_path):
    "lm-eval imports the module a task's `!function` names: gptkit refuses it unless told to trust the folder"
    tasks = tmp_path / 'tasks'
    tasks.mkdir()
    shutil.copy(DATA / 'kjv_complete.jsonl', tasks)
    marker = tmp_path / 'ran'
    (tasks / 'utils.py').write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    "def doc_to_text(doc):\n    return doc['prompt']\n")
    yaml = (DATA / 'kjv_complete.yaml').read_text().replace('task: kjv_complete', 'task: coded')
    coded = yaml.replace('doc_to_text: "{{prompt}}"', 'doc_to_text: !function utils.doc_to_text')
    (tasks / 'coded.yaml').write_text(coded)
    run = shutil.copytree(tiny_checkpoint, tmp_path / 'run')
    r = run_here('eval', '--checkpoint', run, '--tasks', 'coded', '--include-path', tasks)
    msg = said(r)
    assert r.returncode == 2 and len(msg.splitlines()) == 1, msg
    assert f'{tasks}/coded.yaml:9 carries the YAML tag !function' in msg and '--trust-task-code' in msg
    assert not marker.exists() and not (run / 'eval').exists()
