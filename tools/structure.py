"""How the package is laid out, measured: module and function lengths, import cycles, private names crossing modules,
imports inside functions and the chapters' kept outputs. `python tools/structure.py` prints them;
`tests/test_structure.py` holds the limits.
"""
from __future__ import annotations

import ast
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 600       # the most lines a module of gptkit/ may have (nbdev's generated _modidx.py aside)
FUNCTION_LINES = 60      # the most lines a function of gptkit/ or cli/ may have
POSITIONAL_MOST = 5      # the most positional arguments a call of gptkit's own functions and classes may pass
OUTPUT_SHARE = 1 / 3     # the least share of a chapter's code cells that keep an output
BASE = ('gptkit.errors', 'gptkit.files')   # the modules below every room
# the subpackages by concern, lowest first: a room's modules import only from their own room, lower ones and BASE
ROOMS = ('config', 'store', 'estimate', 'tokenizer', 'data', 'kernels', 'model', 'parallel', 'machine', 'checkpoint',
         'train', 'interop', 'inference', 'eval', 'serve', 'diagnose')


def library_files(root: Path = ROOT) -> list[Path]:
    "The modules of gptkit/, nbdev's generated index aside"
    return sorted(p for p in (root / 'gptkit').rglob('*.py') if p.name != '_modidx.py')


def cli_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / 'cli').glob('*.py'))


def module_name(path: Path, root: Path = ROOT) -> str:
    "gptkit/data/corpus.py -> gptkit.data.corpus"
    parts = path.relative_to(root).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def long_modules(root: Path = ROOT) -> list[tuple[str, int]]:
    "(module, lines) of each module of gptkit/ over `MODULE_LINES`"
    sizes = [(str(p.relative_to(root)), len(p.read_text(encoding='utf-8').splitlines())) for p in library_files(root)]
    return [(name, n) for name, n in sizes if n > MODULE_LINES]


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def long_functions(root: Path = ROOT) -> list[tuple[str, int]]:
    "(file:function, lines) of each function of gptkit/ and cli/ over `FUNCTION_LINES`"
    out = []
    for p in library_files(root) + cli_files(root):
        for f in _functions(p):
            n = f.end_lineno - f.lineno + 1
            if n > FUNCTION_LINES:
                out.append((f'{p.relative_to(root)}:{f.name}', n))
    return out


def inner_imports(root: Path = ROOT) -> Counter:
    "file -> imports written inside its functions"
    counts = Counter()
    for p in library_files(root) + cli_files(root):
        for f in _functions(p):
            counts[str(p.relative_to(root))] += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(f))
    return +counts


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    "The absolute module an ImportFrom in `module` names"
    if not node.level:
        return node.module or ''
    base = module.split('.') if is_package else module.split('.')[:-1]
    base = base[:len(base) - node.level + 1]
    return '.'.join(base + ([node.module] if node.module else []))


def imports(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    "(module -> the gptkit modules it imports, anywhere in it; each private name one module imports from another)"
    graph, private = defaultdict(set), []
    modules = {module_name(p, root) for p in library_files(root)}
    for p in library_files(root):
        mod = module_name(p, root)
        for node in ast.walk(ast.parse(p.read_text(encoding='utf-8'))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _target(node, mod, p.name == '__init__.py')
            names = [a.name for a in node.names]
            found = [f'{target}.{n}' for n in names if f'{target}.{n}' in modules] or [target]
            graph[mod] |= {t for t in found if t in modules and t != mod}
            if target != mod and target in modules:
                hidden = [n for n in names if n.startswith('_') and not n.startswith('__')]
                private += [f'{mod} imports {target}.{n}' for n in hidden]
    return graph, private


def unresolved_imports(root: Path = ROOT) -> list[str]:
    """'file:line module' for each import of a gptkit module, anywhere in gptkit/ (inside functions too), that names no
    module there: what a move into a subpackage leaves behind"""
    modules = {module_name(p, root) for p in library_files(root)}
    packages = {m.rsplit('.', 1)[0] for m in modules} | {'gptkit'}
    out = []
    for p in library_files(root):
        mod = module_name(p, root)
        for node in ast.walk(ast.parse(p.read_text(encoding='utf-8'))):
            if isinstance(node, ast.ImportFrom):
                targets = [_target(node, mod, p.name == '__init__.py')]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                if t.split('.')[0] == 'gptkit' and t not in modules and t not in packages:
                    out.append(f'{p.relative_to(root)}:{node.lineno} {t}')
    return out


def room_of(module: str) -> str | None:
    "gptkit.data.corpus -> 'data'; a module at the package's top (gptkit.errors) is in no room"
    parts = module.split('.')
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else None


def room_problems(root: Path = ROOT, rooms: tuple = ROOMS, base: tuple = BASE) -> list[str]:
    """Each module in no room (`base` aside), each subpackage not in `rooms` or without a one-line docstring, and each
    import of a higher room: an upward arrow (with the rooms in one order, a circle between rooms is one too)"""
    out, rank = [], {r: i for i, r in enumerate(rooms)}
    for p in library_files(root):
        mod = module_name(p, root)
        room = mod.split('.')[1] if mod.count('.') >= 1 and p.parent != root / 'gptkit' else None
        if room is None and mod not in base and mod != 'gptkit':
            out.append(f'{mod} is in no room: move it into one of {", ".join(rooms)}')
        elif room is not None and room not in rank:
            out.append(f'gptkit.{room} is no room of ROOMS in tools/structure.py: place it in their order')
        elif room is not None and p.name == '__init__.py':
            doc = ast.get_docstring(ast.parse(p.read_text(encoding='utf-8'))) or ''
            if not doc or '\n' in doc.strip():
                out.append(f'gptkit.{room} needs a one-line docstring saying its job')
    graph, _ = imports(root)
    for a, targets in sorted(graph.items()):
        ra = a.split('.')[1] if a.count('.') >= 2 else None
        for b in sorted(targets):
            rb = b.split('.')[1] if b.count('.') >= 2 else None
            if rb in rank and (ra is None or (ra in rank and rank[rb] > rank[ra])):
                out.append(f'{a} imports {b}, from a higher room')
    return out


def _own_callables(tree: ast.Module, mod: str, is_package: bool, modules: set[str]) -> tuple[set[str], set[str]]:
    "(names that call gptkit's own functions or classes in this module, names bound to gptkit modules)"
    names, aliases = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _target(node, mod, is_package)
            for a in node.names:
                bound = a.asname or a.name
                if f'{target}.{a.name}' in modules:
                    aliases.add(bound)
                elif target in modules:
                    names.add(bound)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname and a.name in modules}
    return names, aliases


def _triton_jit(fn: ast.FunctionDef) -> bool:
    "Whether function `fn` is a Triton kernel or device function (`@triton.jit`, gptkit's `@triton_jit`)"
    return any(ast.unparse(d).split('(')[0] in ('triton.jit', 'triton_jit', 'jit') for d in fn.decorator_list)


def many_positional(root: Path = ROOT, most: int = POSITIONAL_MOST) -> list[str]:
    """'file:line callee (n)' for each call of gptkit's own functions or classes, in gptkit/ and cli/, that passes
    more than `most` positional arguments (Triton's aside: a launch, kernel[grid](...), and the calls inside a
    `@triton_jit` function, which Triton's language makes; and autograd's `apply`)"""
    modules = {module_name(p, root) for p in library_files(root)}
    out = []
    for p in library_files(root) + cli_files(root):
        tree = ast.parse(p.read_text(encoding='utf-8'))
        mod = module_name(p, root) if p.is_relative_to(root / 'gptkit') else 'gptkit_cli.' + p.stem
        names, aliases = _own_callables(tree, mod, p.name == '__init__.py', modules)
        triton = {id(n) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _triton_jit(fn)
                  for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) <= most or id(node) in triton:
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in names:
                callee = f.id
            elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases
                  and f.attr != 'apply'):
                callee = f'{f.value.id}.{f.attr}'
            else:
                continue
            out.append(f'{p.relative_to(root)}:{node.lineno} {callee} ({len(node.args)})')
    return out


# modules that implement one interface under the same names: the fused kernels and their plain references
PROTOCOLS = ({'gptkit.kernels.fused', 'gptkit.kernels.reference'},)


def shared_names(root: Path = ROOT, protocols: tuple = PROTOCOLS) -> list[str]:
    "'name: module, module' for each public function or class that two or more modules define (a protocol's aside)"
    owners = defaultdict(list)
    for p in library_files(root):
        for node in ast.parse(p.read_text(encoding='utf-8')).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name[0] != '_':
                owners[node.name].append(module_name(p, root))
    return [f'{name}: {", ".join(mods)}' for name, mods in sorted(owners.items())
            if len(mods) > 1 and not any(set(mods) <= set(group) for group in protocols)]


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    "Each pair of modules that import each other, directly or through others"
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    reached = {m: reach(m) for m in graph}
    return sorted({tuple(sorted((a, b))) for a in graph for b in reached[a] if a != b and a in reached.get(b, ())})


def chapter_outputs(root: Path = ROOT) -> list[tuple[str, int, int]]:
    "(notebook, code cells keeping an output, code cells) of each numbered chapter"
    out = []
    for nb in sorted((root / 'nbs').glob('[0-9]*.ipynb')):
        cells = [c for c in json.loads(nb.read_text(encoding='utf-8'))['cells'] if c['cell_type'] == 'code']
        out.append((nb.name, sum(1 for c in cells if c.get('outputs')), len(cells)))
    return out


def main() -> int:
    graph, private = imports()
    quiet = [(name, kept, n) for name, kept, n in chapter_outputs() if kept < n * OUTPUT_SHARE]
    print(f'modules over {MODULE_LINES} lines: {long_modules() or "none"}')
    print(f'functions over {FUNCTION_LINES} lines: {long_functions() or "none"}')
    print(f'import cycles: {cycles(graph) or "none"}')
    calls = many_positional()
    print(f'calls of gptkit functions with more than {POSITIONAL_MOST} positional arguments: {len(calls)}')
    print(f'public names with two owners: {shared_names() or "none"}')
    print(f'rooms: {" < ".join(ROOMS)}; problems: {room_problems() or "none"}')
    print(f'private names imported across modules: {private or "none"}')
    inner = inner_imports()
    print(f'imports inside functions: {sum(inner.values())} (most: {inner.most_common(5)})')
    print(f'chapters with fewer than a third of their code cells keeping an output: {quiet or "none"}')
    kept = sum(k for _, k, _ in chapter_outputs())
    print(f'code cells keeping an output: {kept} of {sum(n for _, _, n in chapter_outputs())}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
