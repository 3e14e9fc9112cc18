"""torch only under the worker and the kernels: every module in every other folder of the package
(shared/, plan/, services/ outside services/worker/) imports without loading torch, not even
transitively; `ferry plan` runs where torch cannot be imported; and with forbid_torch() a tokenizer
loads without it. The folders are walked, so a new module is covered without being listed."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers import cuda_plan_budget

REPO = Path(__file__).resolve().parents[2]
QWEN3_30B = REPO / "tests/data/models/qwen3-30b-a3b"

# folder (beside pyproject.toml) -> its package; every folder mapped into ferry is one of these
TORCH_FREE = {"shared": "ferry.shared", "plan": "ferry.plan", "services": "ferry.services"}
TORCH_ALLOWED = {"services/worker": "ferry.services.worker", "kernels": "ferry.kernels"}
# worker modules the control plane imports to parse the worker's flags and read its plan
LIGHT_WORKER_MODULES = ("ferry.services.worker.command", "ferry.services.worker.service", "ferry.services.worker.flags")


def modules_under(folder: str, package: str) -> list[str]:
    root = REPO / folder
    names = []
    for path in sorted(root.rglob("*.py")):
        if any(path.is_relative_to(REPO / allowed) for allowed in TORCH_ALLOWED):
            continue
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.append(".".join((package, *parts)))
    return names


def torch_free_modules() -> list[str]:
    return [m for folder, package in TORCH_FREE.items() for m in modules_under(folder, package)]


IMPORT_ALL = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
loaded = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
assert not loaded, loaded
print("ok")
"""

# a process where `import torch` raises, installed or not
NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, NoTorch())
"""
# `ferry plan` there, as `python -m ferry.services.cli plan ...` runs it
FERRY_WITHOUT_TORCH = (
    NO_TORCH
    + """
import runpy
sys.argv[0] = "ferry"
runpy.run_module("ferry.services.cli", run_name="__main__")
"""
)

TOKENIZER = """
import sys
from ferry.shared.torch_free import forbid_torch
forbid_torch()
from ferry.services.api.tokenizer import PromptTokenizer
t = PromptTokenizer(sys.argv[1])
assert t.chat_prompt([{"role": "user", "content": "hi"}])
assert not [m for m, v in sys.modules.items() if m.startswith("torch") and v is not None]
print("ok")
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def test_every_folder_of_the_package_is_either_torch_free_or_allowed_torch():
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {folder for name, folder in package_dir.items() if name != "ferry"}
    assert folders == set(TORCH_FREE) | {f for f in TORCH_ALLOWED if "/" not in f}
    for folder, package in {**TORCH_FREE, **TORCH_ALLOWED}.items():
        # kernels/ is a namespace portion on purpose: with an __init__.py it would shadow Hugging Face's
        # `kernels` package, which transformers imports, wherever the tree is on sys.path (kernels/README.md)
        assert (REPO / folder / "__init__.py").is_file() == (folder != "kernels"), folder


def test_the_kernels_folder_does_not_shadow_a_top_level_kernels_package(tmp_path):
    """Where the tree is first on sys.path, `import kernels` must find another `kernels` package
    (transformers >= 5.25 imports Hugging Face's), while `ferry.kernels` stays this folder."""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("WHO = 'the other kernels package'\n")
    code = (
        "import sys; sys.path.insert(1, sys.argv[1]); import kernels, ferry.kernels.dispatch as d; "
        "print(kernels.WHO); print(d.__file__)"
    )
    done = run(code, str(tmp_path))
    assert done.returncode == 0, done.stderr
    who, dispatch = done.stdout.splitlines()
    assert who == "the other kernels package" and Path(dispatch) == REPO / "kernels" / "dispatch.py"


def test_the_walk_finds_the_plan_the_api_and_the_scheduler_but_not_the_worker():
    names = torch_free_modules()
    assert {
        "ferry.plan.planner",
        "ferry.plan.model_config",
        "ferry.services.api.tokenizer",
        "ferry.services.scheduler.batcher",
        "ferry.shared.wire",
        "ferry.services.cli",
    } <= set(names)
    assert not [n for n in names if n.startswith(("ferry.services.worker", "ferry.kernels"))]


def test_importing_every_module_outside_the_worker_and_the_kernels_loads_no_torch():
    done = run(IMPORT_ALL, *torch_free_modules(), *LIGHT_WORKER_MODULES)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_ferry_plan_runs_where_importing_torch_raises():
    blocked = run(NO_TORCH + "import torch")
    assert blocked.returncode != 0 and "torch is blocked in this test" in blocked.stderr
    done = run(
        FERRY_WITHOUT_TORCH, "plan", str(QWEN3_30B), "--gpu-memory", "24GiB", "--host-memory", "128GiB", "--json"
    )
    assert done.returncode == 0 and json.loads(done.stdout)["budget_bytes"] == cuda_plan_budget(24 * 2**30), done.stderr
    # without a budget it asks torch for the GPU's free memory: torch missing reads as "no GPU here"
    done = run(FERRY_WITHOUT_TORCH, "plan", "--model", str(QWEN3_30B))
    assert done.returncode != 0 and "no GPU here" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_api_tokenizer_loads_without_torch(tiny_tokenizer_dir):
    done = run(TOKENIZER, str(tiny_tokenizer_dir))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
