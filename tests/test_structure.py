"""The layout of the package holds: short modules and functions, no import cycles, no private name crossing modules,
and chapters that show their results (issue 30). `python tools/structure.py` prints the same measures."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tools'))
import structure  # noqa: E402


def test_no_module_or_function_is_too_long():
    assert structure.long_modules() == [], f'split these modules by concern (at most {structure.MODULE_LINES} lines)'
    assert structure.long_functions() == [], f'extract named steps (at most {structure.FUNCTION_LINES} lines)'


def test_no_import_cycle_and_no_private_name_across_modules():
    graph, private = structure.imports()
    assert structure.cycles(graph) == []
    assert private == [], 'make the name public in the module that owns it'


def test_every_module_sits_in_a_room_and_no_room_imports_a_higher_one():
    "Subpackages by concern in one order (tools/structure.py ROOMS): no upward arrow, so no circle between rooms"
    assert structure.room_problems() == []


def test_the_room_rule_finds_a_flat_module_an_upward_arrow_and_a_room_out_of_order(tmp_path):
    pkg = tmp_path / 'gptkit'
    for room, doc in (('low', '"""Low things"""'), ('high', '"""High things"""'), ('odd', '')):
        (pkg / room).mkdir(parents=True)
        (pkg / room / '__init__.py').write_text(doc + '\n')
    (pkg / '__init__.py').write_text('')
    (pkg / 'errors.py').write_text('x = 1\n')
    (pkg / 'flat.py').write_text('from .errors import x\n')
    (pkg / 'low' / 'a.py').write_text('def f():\n    from ..high.b import y\n')
    (pkg / 'high' / 'b.py').write_text('from ..low.a import f\nfrom ..errors import x\ny = 2\n')
    assert structure.room_problems(tmp_path, rooms=('low', 'high'), base=('gptkit.errors',)) == [
        'gptkit.flat is in no room: move it into one of low, high',
        'gptkit.odd is no room of ROOMS in tools/structure.py: place it in their order',
        'gptkit.low.a imports gptkit.high.b, from a higher room']


def test_each_public_name_has_one_owner():
    "No two modules define a public function or class of the same name, but the fused kernels and their references"
    assert structure.shared_names() == [], 'rename one, or let one module own it and the other import it'


def test_the_owner_rule_finds_a_name_defined_twice(tmp_path):
    pkg = tmp_path / 'gptkit'
    pkg.mkdir()
    (pkg / 'a.py').write_text('def save():\n    pass\n\nclass Row:\n    pass\n')
    (pkg / 'b.py').write_text('def save():\n    pass\n\ndef _private():\n    pass\n')
    (pkg / 'c.py').write_text('class Row:\n    pass\n')
    assert structure.shared_names(tmp_path, protocols=({'gptkit.a', 'gptkit.c'},)) == ['save: gptkit.a, gptkit.b']


def test_the_positional_measure_counts_calls_of_gptkits_own_callables(tmp_path):
    "Six positional arguments to a gptkit function or class are counted; five, keywords, other libraries' aside"
    pkg = tmp_path / 'gptkit'
    pkg.mkdir()
    (pkg / 'a.py').write_text('class Rec:\n    pass\n\ndef f(*a, **k):\n    pass\n')
    (pkg / 'b.py').write_text('import math\nfrom . import a as alias\nfrom .a import Rec, f\n'
                              'Rec(1, 2, 3, 4, 5, 6)\nf(1, 2, 3, 4, 5)\nf(1, 2, 3, x=4, y=5, z=6)\n'
                              'alias.f(1, 2, 3, 4, 5, 6)\nmath.hypot(1, 2, 3, 4, 5, 6)\nalias.f.apply(1, 2, 3, 4, 5, 6)\n'
                              '@triton_jit\ndef kernel(x):\n    f(1, 2, 3, 4, 5, 6)\n')   # Triton's language aside
    (tmp_path / 'cli').mkdir()
    assert structure.many_positional(tmp_path) == ['gptkit/b.py:4 Rec (6)', 'gptkit/b.py:7 alias.f (6)']


def test_no_call_of_gptkits_own_passes_more_than_five_positional_arguments():
    "Reordering a field or a parameter cannot silently move values: past five, arguments are passed by name"
    assert structure.many_positional() == [], 'pass these arguments by keyword'


RECORDS = ('gptkit.train.callbacks.StepMetrics', 'gptkit.train.callbacks.RunInfo', 'gptkit.train.loop.Loop',
           'gptkit.train.run.TrainRequest', 'gptkit.train.launch.Launch', 'gptkit.estimate.sizing.Estimate',
           'gptkit.estimate.perf.StepTime', 'gptkit.diagnose.profile.ProfileResult', 'gptkit.eval.perplexity.Perplexity',
           'gptkit.data.prepare.PrepareConfig', 'gptkit.config.params.Param')


@pytest.mark.parametrize('name', RECORDS)
def test_the_records_that_cross_functions_are_keyword_only_and_typed(name):
    "Each field is given by name, and none is typed `object` (the Loop's engine, parallel state and samples had been)"
    import dataclasses
    import importlib
    module, _, cls = name.rpartition('.')
    record = getattr(importlib.import_module(module), cls)
    fields = dataclasses.fields(record)
    assert all(f.kw_only for f in fields), f'{name}: @dataclass(kw_only=True)'
    assert [f.name for f in fields if f.type in ('object', 'object | None')] == [], name


def test_every_import_of_a_gptkit_module_names_one_that_exists():
    "Inside functions too, where an import runs only when its function does (a moved module's old name, relative)"
    assert structure.unresolved_imports() == []


def test_every_chapter_keeps_outputs_in_a_third_of_its_code_cells():
    share = structure.OUTPUT_SHARE
    quiet = [f'{name}: {kept} of {n}' for name, kept, n in structure.chapter_outputs() if kept < n * share]
    assert quiet == [], 'show results after each exported piece, recorded with nbdev-test --save'


def test_the_measures_find_what_they_look_for(tmp_path):
    "A long module, a long function, a cycle, a private import and a silent chapter, each found in a made-up tree"
    pkg = tmp_path / 'gptkit'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    (pkg / 'a.py').write_text('from .b import _hidden\n' + 'x = 1\n' * 600)
    (pkg / 'b.py').write_text('def f():\n    from gptkit.a import x\n' + '    y = 1\n' * 60 + '\n_hidden = 2\n')
    (tmp_path / 'cli').mkdir()
    (tmp_path / 'nbs').mkdir()
    cells = [{'cell_type': 'code', 'source': ['1'], 'outputs': [{'text': '1'}] if out else []}
             for out in (True, False, False, False)]
    (tmp_path / 'nbs' / '01_a.ipynb').write_text(json.dumps({'cells': cells}))
    assert structure.long_modules(tmp_path) == [('gptkit/a.py', 601)]
    assert structure.long_functions(tmp_path) == [('gptkit/b.py:f', 62)]
    graph, private = structure.imports(tmp_path)
    assert structure.cycles(graph) == [('gptkit.a', 'gptkit.b')] and private == ['gptkit.a imports gptkit.b._hidden']
    assert structure.inner_imports(tmp_path) == {'gptkit/b.py': 1}
    (pkg / 'c.py').write_text('def g():\n    from .gone import x\n')
    assert structure.unresolved_imports(tmp_path) == ['gptkit/c.py:2 gptkit.gone']
    assert structure.chapter_outputs(tmp_path) == [('01_a.ipynb', 1, 4)]
