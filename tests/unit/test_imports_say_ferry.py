"""Code is imported as ferry.…, never by its folder's name: `shared`, `services`, `kernels` and `plan`
are folders beside pyproject.toml, not packages (an installed Ferry has none of them, and the
suite's `pythonpath = ["."]` must not hide a stray `import shared`). Imports, module paths in
strings (`-m ferry.services.cli`, "ferry.services.worker.boot:boot_worker", monkeypatch targets)
and the deployment files are all checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "services", "kernels", "plan")
MODULE_PATH = re.compile(rf"^({'|'.join(FOLDERS)})(\.[a-z_][a-z0-9_]*)+(:[A-Za-z_]\w*)?$")
MINUS_M = re.compile(rf"-m\s+({'|'.join(FOLDERS)})\.")
SKIP = {".venv", ".git", "data", "build", "dist", "__pycache__", "out"}


def python_files() -> list[Path]:
    return [
        p
        for p in REPO.rglob("*.py")
        if not SKIP.intersection(p.relative_to(REPO).parts[:-1])
        and not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    ]


def non_ferry_references(path: Path) -> list[str]:
    label, found = path.relative_to(REPO) if path.is_relative_to(REPO) else path, []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if MODULE_PATH.match(node.value) else []
        else:
            continue
        found += [f"{label}:{node.lineno}: {n}" for n in names if n.split(".")[0].split(":")[0] in FOLDERS]
    return found


def test_the_scan_sees_the_whole_tree():
    files = {str(p.relative_to(REPO)) for p in python_files()}
    assert {
        "ferry/__init__.py",
        "plan/planner.py",
        "services/cli.py",
        "tests/conftest.py",
        "tools/gpu_check.py",
    } <= files
    assert not [f for f in files if f.startswith((".venv/", "tests/data/"))]


def test_the_scan_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import shared.wire\nfrom services.cli import main\n"
        'X = ["-m", "services.cli", "services.worker.boot:boot_worker"]\n'
    )
    assert len(non_ferry_references(bad)) == 4


def test_every_python_import_and_module_path_says_ferry():
    found = [hit for path in python_files() for hit in non_ferry_references(path)]
    assert not found, "\n".join(found)


def test_scripts_and_deployment_files_run_ferry():
    texts = [REPO / n for n in ("Makefile", "Dockerfile", "compose.yaml", "README.md", "pyproject.toml")]
    texts += sorted((REPO / "tools").glob("*.sh")) + sorted((REPO / ".ci").iterdir())
    found = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in texts for m in MINUS_M.finditer(p.read_text())]
    assert not found, found
    script = re.search(r'^ferry = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert script and script.group(1) == "ferry.services.cli:main"
