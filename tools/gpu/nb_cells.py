"""A notebook's code cells as one Python script, the way `nbdev-test --flags gpu` runs them (cells flagged slow or
notest and `eval: false` left out; gpu cells kept), for a GPU machine that has no nbdev: the documentation-only lines
(`from nbdev...` imports, `show_doc(...)` calls, the export cell) are left out, fastcore's test helpers stay.
Run: python tools/gpu/nb_cells.py nbs/09_kernels.fused.ipynb /tmp/09_kernels.fused.py && (cd nbs && python /tmp/09_kernels.fused.py)
"""
import json
import sys

SKIPPED_FLAGS = ('slow', 'notest', 'eval: false', 'eval:false')


def cell_lines(source: str) -> list[str]:
    "The cell's lines that run without nbdev"
    return [line for line in source.split('\n') if not line.startswith(('from nbdev', 'import nbdev', 'show_doc('))]


def script(notebook: str) -> str:
    "Every code cell that nbdev-test runs with --flags gpu, in order, each announced as it starts"
    future, body = [], []
    for cell in json.load(open(notebook))['cells']:
        if cell['cell_type'] != 'code':
            continue
        source = ''.join(cell['source'])
        flags = ' '.join(line for line in source.split('\n') if line.startswith('#|'))
        if any(f in flags for f in SKIPPED_FLAGS) or 'nbdev_export()' in source:   # the export cell writes gptkit/
            continue
        lines = cell_lines(source)
        future += [line for line in lines if line.startswith('from __future__')]
        lines = [line for line in lines if not line.startswith('from __future__')]
        body.append(f'print("cell {cell.get("id")}", flush=True)\n' + '\n'.join(lines))
    return '\n'.join(sorted(set(future)) + body) + '\n'


if __name__ == '__main__':
    open(sys.argv[2], 'w').write(script(sys.argv[1]))
