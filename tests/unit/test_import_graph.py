"""The graph of which ferry module imports which, read from the source with `ast`: no import cycles, no
arrow from kernels/ up into services/, and no top-level import path from the torch-free modules
(tests/unit/test_torch_free.py's list) to a module that imports torch at load.

Every `import` and `from ... import` of a `ferry.` name counts, at the top of a module and inside functions
alike: a cycle closed by an import inside a function still ties its modules together (each needs the
other to work), and only hides from the interpreter. Imports under `if TYPE_CHECKING:` never run and are
left out. `from ferry.a import b` is an arrow to the module `ferry.a.b` where b is a module, else to
`ferry.a`. Loading `ferry.a.b` also runs `ferry.a`'s `__init__`: the torch check follows that, the cycle
check does not (a package whose `__init__` imports its own modules is not a cycle of two concepts).
Imports by a name computed at run time (`importlib.import_module`: the command line's commands) are not
in the graph.
The torch check reads this tree only; a third-party package that loads torch (transformers) is
test_torch_free.py's to catch, which imports the modules."""

from __future__ import annotations

import ast
import tomllib
from collections import deque
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.unit.test_torch_free import LIGHT_WORKER_MODULES, torch_free_modules

REPO = Path(__file__).resolve().parents[2]


class Arrow(NamedTuple):
    source: str  # the importing module
    target: str  # a ferry module of this tree, or the dotted name outside it ("torch.nn", "safetensors.torch.x")
    where: str  # file:line, the file relative to the tree
    lazy: bool  # inside a function: runs when the function is called, not when the module loads


class ImportGraph(NamedTuple):
    modules: dict[str, Path]
    arrows: dict[str, list[Arrow]]  # module -> its imports, each once a line

    def inside(self, module: str) -> list[Arrow]:
        """Arrows to modules of this tree."""
        return [a for a in self.arrows[module] if a.target in self.modules]


def module_files(root: Path) -> dict[str, Path]:
    """ferry module name -> its file, through pyproject.toml's package-dir (the folders mapped into ferry)."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in package_dir.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, lazy: bool = False):
    """(node, lazy) for every import statement, walking into function bodies (lazy) and past TYPE_CHECKING blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        elif isinstance(node, ast.If) and _type_checking(node):
            yield from _imports(ast.Module(body=node.orelse, type_ignores=[]), lazy)
        else:
            yield from _imports(node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module a dotted import name loads: the longest prefix that is a module here (`ferry.a.b.attr` ->
    `ferry.a.b`), else the name as written (outside this tree)."""
    probe = name
    while probe:
        if probe in modules:
            return probe
        probe = probe.rpartition(".")[0]
    return name


def _is_torch(name: str) -> bool:
    """torch itself, or a package's torch part that imports it (`safetensors.torch`)."""
    return "torch" in name.split(".")


def import_graph(root: Path) -> ImportGraph:
    modules = module_files(root)
    arrows: dict[str, list[Arrow]] = {}
    for module, path in modules.items():
        found: dict[tuple[str, int], Arrow] = {}
        for node, lazy in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per dot past the first
                    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = _resolve(name, modules)
                if target != module:
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.setdefault((target, node.lineno), Arrow(module, target, where, lazy))
        arrows[module] = list(found.values())
    return ImportGraph(modules, arrows)


def _said(arrow: Arrow) -> str:
    return f"{arrow.where}{' (inside a function)' if arrow.lazy else ''}"


def cycles(graph: ImportGraph) -> list[list[Arrow]]:
    """One cycle through each strongly connected group of modules (Tarjan's), as the arrows that close it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for a in graph.inside(v):
            w = a.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    found = []
    for group in groups:
        start = min(group)
        # the shortest way from start back to itself inside the group
        came: dict[str, Arrow] = {}
        queue = deque([start])
        while queue and start not in came:
            v = queue.popleft()
            for a in graph.inside(v):
                if a.target in group and a.target not in came:
                    came[a.target] = a
                    queue.append(a.target)
        cycle = [came[start]]
        while cycle[-1].source != start:
            cycle.append(came[cycle[-1].source])
        found.append(cycle[::-1])
    return found


def describe(cycle: list[Arrow]) -> str:
    return "\n    ".join(f"{a.source} imports {a.target} ({_said(a)})" for a in cycle)


def arrows_up(graph: ImportGraph, lower: str, upper: str) -> list[str]:
    """Imports (anywhere in a module) from the package `lower` into the package `upper`."""
    return [
        f"{_said(a)}: {m} imports {a.target}"
        for m in sorted(graph.modules)
        if m.startswith(lower + ".")
        for a in graph.inside(m)
        if a.target == upper or a.target.startswith(upper + ".")
    ]


def loads(graph: ImportGraph, module: str) -> list[tuple[str, Arrow | None]]:
    """What loading `module` runs next: its top-level imports, and its package's __init__ (the nearest one:
    kernels/ has none, `ferry` is next)."""
    nexts: list[tuple[str, Arrow | None]] = [(a.target, a) for a in graph.arrows[module] if not a.lazy]
    package = module.rpartition(".")[0]
    while package and package not in graph.modules:
        package = package.rpartition(".")[0]
    if package:
        nexts.append((package, None))
    return nexts


def path_to_torch(graph: ImportGraph, start: str) -> list[str] | None:
    """The load path from `start` to a top-level `import torch`, one line a step, or None where there is none."""
    came: dict[str, tuple[str, Arrow | None]] = {}  # module -> (the module whose load runs it, the import)
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for target, arrow in loads(graph, v):
            if _is_torch(target):
                steps = []
                while True:
                    steps.append(f"{v} imports {target} ({arrow.where})" if arrow else f"{v} runs its package {target}")
                    if v == start:
                        return steps[::-1]
                    target, (v, arrow) = v, came[v]
            if target in graph.modules and target != start and target not in came:
                came[target] = (v, arrow)
                queue.append(target)
    return None


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return import_graph(REPO)


def test_the_graph_sees_every_folder_and_both_kinds_of_import(graph):
    assert {
        "ferry",
        "ferry.shared.wire",
        "ferry.plan.planner",
        "ferry.services.cli",
        "ferry.kernels.dispatch",
        "ferry.services.worker.models",
    } <= set(graph.modules)
    assert graph.modules["ferry.services.worker.models"].name == "__init__.py"
    arrows = graph.arrows["ferry.kernels.grouped_expert_gemm"]
    targets = {a.target for a in arrows}
    assert {"torch", "triton.language", "ferry.kernels.dispatch", "ferry.kernels.expert_pair_gemv"} <= targets
    assert any(a.lazy for m in graph.modules for a in graph.inside(m)), "no import inside a function found"
    assert path_to_torch(graph, "ferry.services.worker.boot") and not path_to_torch(graph, "ferry.shared.wire")


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A small tree with a cycle closed inside a function, a kernel importing a service, and a control
    module that reaches torch through two modules and a package __init__."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\nferry = "ferry"\n"ferry.kernels" = "kernels"\n"ferry.services" = "services"\n'
    )
    files = {
        "ferry/__init__.py": "",
        "kernels/a.py": "from ferry.kernels.b import f\n",
        "kernels/b.py": "def f():\n    from ferry.kernels import a\n",
        "kernels/c.py": "import torch\nfrom ferry.services.worker.norms import g\n",
        "services/__init__.py": "",
        "services/api.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "from . import plan\n",
        "services/plan.py": "def later():\n    import torch\nfrom ferry.services.worker.norms import g\n",
        "services/worker/__init__.py": "import torch.nn\n",
        "services/worker/norms.py": "g = 1\n",
        "services/weights.py": "from safetensors.torch import load_file\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    small = import_graph(tmp_path)
    (cycle,) = cycles(small)
    assert [(a.source, a.target, a.where, a.lazy) for a in cycle] == [
        ("ferry.kernels.a", "ferry.kernels.b", "kernels/a.py:1", False),
        ("ferry.kernels.b", "ferry.kernels.a", "kernels/b.py:2", True),
    ]
    assert arrows_up(small, "ferry.kernels", "ferry.services") == [
        "kernels/c.py:2: ferry.kernels.c imports ferry.services.worker.norms"
    ]
    assert path_to_torch(small, "ferry.services.api") == [
        "ferry.services.api imports ferry.services.plan (services/api.py:4)",
        "ferry.services.plan imports ferry.services.worker.norms (services/plan.py:3)",
        "ferry.services.worker.norms runs its package ferry.services.worker",
        "ferry.services.worker imports torch.nn (services/worker/__init__.py:1)",
    ]
    assert path_to_torch(small, "ferry.services.weights") == [
        "ferry.services.weights imports safetensors.torch.load_file (services/weights.py:1)"
    ]
    assert path_to_torch(small, "ferry.services.worker.norms") is not None
    assert path_to_torch(small, "ferry.kernels.a") is None


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join("  " + describe(c) for c in found)


def test_kernels_import_nothing_from_services(graph):
    """kernels/ sit below the worker: what a kernel and its twin need lives in kernels/ (or shared/, plan/)."""
    up = arrows_up(graph, "ferry.kernels", "ferry.services")
    assert not up, "\n".join(up)


def test_no_torch_free_module_loads_a_module_that_imports_torch(graph):
    names = [*torch_free_modules(), *LIGHT_WORKER_MODULES]
    assert set(names) <= set(graph.modules), set(names) - set(graph.modules)
    assert "ferry.services.api.app" in names and "ferry.services.scheduler.service" in names
    reaching = {name: path_to_torch(graph, name) for name in names}
    reaching = {name: steps for name, steps in reaching.items() if steps}
    assert not reaching, "\n".join(f"{name}:\n  " + "\n  ".join(steps) for name, steps in reaching.items())
