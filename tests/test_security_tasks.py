"""lm-eval task folders are data: the seven ways a folder under `gptkit eval --include-path` ran Python before
(issue 50), and what this session's hostile round added (a FIFO, a billion laughs, a metric script, a link out).
Each writes a marker file if its code runs; each must be refused in one sentence naming the file, before any model
loads, and leave no marker. `--trust-task-code` stays the one way to run a task's Python."""
import codecs
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_here

from gptkit.errors import ConfigError, DataError
from gptkit.eval.harness import find_tasks, load_tasks, require_lm_eval
from gptkit.eval.task_files import check_task_folder, sandboxed_templates, task_yaml

DATA = Path(__file__).parent / 'data' / 'harness'
BASE = (DATA / 'kjv_complete.yaml').read_text().replace('task: kjv_complete', 'task: coded')


@pytest.fixture(scope='module', autouse=True)
def offline():
    require_lm_eval(offline=True)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    "A task folder with the test data, a utils.py that leaves a marker when imported, and lm-eval's own tasks unseen"
    import lm_eval.tasks
    class LocalOnly(lm_eval.tasks.TaskManager):          # lm-eval's own 14,000 tasks take 6-13 s to index
        def __init__(self, *args, include_defaults=True, **kw):
            super().__init__(*args, include_defaults=False, **kw)
    monkeypatch.setattr(lm_eval.tasks, 'TaskManager', LocalOnly)
    tasks = tmp_path / 'tasks'
    tasks.mkdir()
    shutil.copy(DATA / 'kjv_complete.jsonl', tasks)
    (tasks / 'utils.py').write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'ran')!r}).write_text('ran')\n"
                                    "def doc_to_text(doc):\n    return doc['prompt']\n")
    return tasks


def with_text(doc_to_text: str) -> str:
    return BASE.replace('doc_to_text: "{{prompt}}"', f'doc_to_text: {doc_to_text}')


def refused(tasks: Path, *needles: str) -> str:
    "The sentence find_tasks and load_tasks refuse the folder with; the marker never written"
    with pytest.raises((ConfigError, DataError)) as e:
        tm, specs = find_tasks('coded', tasks)
        with sandboxed_templates():
            for task in load_tasks(tm, specs):
                task.doc_to_text(task.test_docs()[0])
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and all(n in msg for n in needles), msg
    assert not (tasks.parent / 'ran').exists()
    return msg


# the seven ways of issue 50

def test_a_yaml_in_utf16_with_a_bom_is_refused(folder):
    (folder / 'coded.yaml').write_bytes(codecs.BOM_UTF16_LE + with_text('!function utils.doc_to_text')
                                        .encode('utf-16-le'))
    refused(folder, f'{folder}/coded.yaml', 'byte-order mark')


def test_a_tag_directive_is_refused(folder):
    (folder / 'coded.yaml').write_text('%TAG !f! !func\n---\n' + with_text('!f!tion utils.doc_to_text'))
    refused(folder, f'{folder}/coded.yaml:1', '%TAG')


def test_a_uri_escaped_tag_is_refused(folder):
    (folder / 'coded.yaml').write_text(with_text('!functio%6E utils.doc_to_text'))
    refused(folder, f'{folder}/coded.yaml:9', 'tag')


def test_an_include_not_named_yaml_is_read_by_the_same_loader(folder):
    (folder / 'base.inc').write_text('doc_to_text: !function utils.doc_to_text\n')
    (folder / 'coded.yaml').write_text('include: base.inc\n' + BASE.replace('doc_to_text: "{{prompt}}"\n', ''))
    refused(folder, f'{folder}/base.inc:1', 'tag')


def test_an_include_outside_the_folder_is_refused(folder, tmp_path):
    outside = tmp_path / 'elsewhere'
    outside.mkdir()
    (outside / 'utils.py').write_text((folder / 'utils.py').read_text())
    (outside / 'base.yaml').write_text('doc_to_text: !function utils.doc_to_text\n')
    (folder / 'coded.yaml').write_text(f'include: {outside / "base.yaml"}\n'
                                       + BASE.replace('doc_to_text: "{{prompt}}"\n', ''))
    refused(folder, f'{folder}/coded.yaml', 'include', 'outside --include-path')


def test_a_hash_in_a_quoted_string_before_the_tag_is_no_hiding_place(folder):
    (folder / 'coded.yaml').write_text(with_text('"#" ').replace('doc_to_text: "#" ',
                                       'doc_to_text: {"#": 1, x: !function utils.doc_to_text}'))
    refused(folder, f'{folder}/coded.yaml:9', 'tag')


def test_a_template_reaching_for_globals_is_refused_and_never_runs(folder, tmp_path):
    marker = tmp_path / 'ran'
    hostile = f"\"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}\""
    (folder / 'coded.yaml').write_text(with_text(hostile))
    refused(folder, f'{folder}/coded.yaml', 'doc_to_text', '__globals__', 'sandbox')


def test_the_sandbox_holds_where_the_check_cannot_see(folder, tmp_path):
    "A name built at render time (`attr` of a joined string) passes the reading; Jinja's sandbox makes it undefined"
    marker = tmp_path / 'ran'
    hostile = ("\"{{ (cycler|attr(['_', '_init_', '_']|join)|attr(['_', '_globals_', '_']|join)).os.system("
               f"'touch {marker}') }}}}\"")
    (folder / 'coded.yaml').write_text(with_text(hostile))
    refused(folder, 'lm-eval task coded', '__globals__')


def test_the_cli_refuses_a_hostile_template_before_the_model_loads(folder, tiny_checkpoint, tmp_path):
    marker = tmp_path / 'ran'
    (folder / 'coded.yaml').write_text(with_text(f"\"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') "
                                                 "}}\""))
    run = shutil.copytree(tiny_checkpoint, tmp_path / 'run')
    r = run_here('eval', '--checkpoint', run, '--tasks', 'coded', '--include-path', folder, '--limit', '1')
    msg = '\n'.join(line for line in (r.stdout + r.stderr).splitlines() if not line.startswith('SystemExit'))
    assert r.returncode == 2 and len(msg.splitlines()) == 1 and 'doc_to_text' in msg, msg
    assert not marker.exists() and not (run / 'eval').exists()


# this session's own hostile round

def test_a_fifo_named_yaml_is_refused_without_reading_it(folder):
    os.mkfifo(folder / 'stuck.yaml')                      # lm-eval's index would wait on it for ever
    (folder / 'coded.yaml').write_text(BASE)
    refused(folder, f'{folder}/stuck.yaml', 'not a regular file')


def test_aliases_are_refused(folder):
    laughs = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + ''.join(
        f'{c}: &{c} [{",".join(["*" + p] * 9)}]\n' for p, c in zip('abcdefgh', 'bcdefghi'))
    (folder / 'coded.yaml').write_text(laughs + BASE)
    refused(folder, f'{folder}/coded.yaml:1', 'anchor &a')


def test_a_metric_that_names_a_script_is_refused(folder, tmp_path):
    "A metric lm-eval does not know is loaded by Hugging Face evaluate, which imports a local script as code"
    (folder / 'metric.py').write_text((folder / 'utils.py').read_text())
    (folder / 'coded.yaml').write_text(BASE.replace('metric: exact_match', f'metric: {folder / "metric.py"}'))
    refused(folder, f'{folder}/coded.yaml', 'metric_list[0].metric', '--trust-task-code')


def test_a_link_to_a_file_outside_is_refused(folder, tmp_path):
    (tmp_path / 'outside.yaml').write_text(BASE)
    (folder / 'coded.yaml').symlink_to(tmp_path / 'outside.yaml')
    refused(folder, f'{folder}/coded.yaml', 'outside --include-path')


def test_a_huge_file_is_refused_by_its_size(folder):
    (folder / 'coded.yaml').write_text(BASE + '#' * (1 << 21))
    refused(folder, f'{folder}/coded.yaml', 'MiB')


# what stays allowed

def test_plain_tasks_with_includes_pass_and_trust_still_runs_code(folder, tmp_path):
    (folder / 'base.inc').write_text('doc_to_text: "{{prompt}}"\n')
    (folder / 'coded.yaml').write_text('include: base.inc\n' + BASE.replace('doc_to_text: "{{prompt}}"\n', ''))
    assert check_task_folder(folder) == [folder / 'base.inc', folder / 'coded.yaml']
    tm, specs = find_tasks('coded', folder)
    with sandboxed_templates():
        task, = load_tasks(tm, specs)
        assert task.doc_to_text(task.test_docs()[0]) == task.test_docs()[0]['prompt']
    (folder / 'coded.yaml').write_text(with_text('!function utils.doc_to_text'))
    tm, specs = find_tasks('coded', folder, trust_code=True)
    load_tasks(tm, specs)
    assert (tmp_path / 'ran').exists()
    assert task_yaml(DATA / 'kjv_complete.yaml')['task'] == 'kjv_complete'


def test_a_file_nested_deep_is_refused_before_it_crashes_the_loader(folder):
    "200,000 lists inside each other ended the process in a segmentation fault of the YAML loader"
    (folder / 'coded.yaml').write_text(BASE + 'x: ' + '[' * 200_000 + ']' * 200_000 + '\n')
    refused(folder, f'{folder}/coded.yaml:', 'more than 32 deep')
