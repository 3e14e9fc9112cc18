"""`pip install .` as a user does it: a wheel built from the source folders, installed into a fresh
venv, gives one import package, `ferry`, with every module of the tree in it, and no top-level
`shared`, `services`, `kernels` or `plan` of its own (a dependency may bring one: Hugging Face's `kernels`). The checks
run from a directory outside the repository, with no PYTHONPATH, so the tree itself cannot be imported by accident. And
with no install at all, PYTHONPATH=<repo root> runs the same modules from the tree (ferry/__init__.py maps the
folders)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.helpers import cuda_plan_budget

REPO = Path(__file__).resolve().parents[2]
QWEN3_30B = REPO / "tests/data/models/qwen3-30b-a3b"

CHECK = """
import importlib.util, json, sys
import ferry, ferry.services.cli, ferry.plan.planner, ferry.shared.wire
print(json.dumps({
    "ferry": ferry.__file__,
    "path": list(ferry.__path__),
    "cli": ferry.services.cli.__file__,
    # where each generic top-level name resolves, if anywhere (a dependency may own one: transformers >= 5.25
    # brings Hugging Face's `kernels`)
    "top_level": {name: (lambda s: s and (list(s.submodule_search_locations or [])[:1] or [s.origin])[0])(
                      importlib.util.find_spec(name)) for name in ("shared", "services", "kernels", "plan")},
}))
"""


def setuptools_is_new_enough() -> bool:
    try:
        return int(version("setuptools").split(".")[0]) >= 77
    except Exception:
        return False


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv with Ferry installed from a wheel of a copy of the source folders."""
    tmp = tmp_path_factory.mktemp("install")
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in package_dir.values():
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    isolation = ["--no-build-isolation"] if setuptools_is_new_enough() else []  # offline and fast when it can
    wheels = tmp / "wheels"
    # -v: the build backend's own output (setuptools' warnings) comes back too, for test_the_build_warns_of_no_package
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", *isolation, "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("ferry-*.whl")

    there = fresh_venv(tmp / "venv")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(there["python"]),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {**there, "build_output": built.stdout + built.stderr}


def fresh_venv(env_dir: Path) -> dict:
    """A venv without Ferry that sees this interpreter's packages (the dependencies) through a .pth
    line (which does not run the .pth files there, such as an editable install's finder)."""
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "outer_dependencies.pth").write_text("\n".join(sorted(outer)) + "\n")
    cwd = env_dir.parent / "elsewhere"
    cwd.mkdir()
    return {"python": python, "bin": env_dir / "bin", "site": Path(site), "cwd": cwd}


def run_there(there: dict, *cmd, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(c) for c in cmd], cwd=there["cwd"], env={**env, **env_extra}, capture_output=True, text=True, timeout=120
    )


def test_installed_ferry_imports_and_the_generic_top_level_names_do_not(installed):
    done = run_there(installed, installed["python"], "-c", CHECK)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    ferry_dir = installed["site"] / "ferry"
    assert Path(seen["ferry"]).parent == ferry_dir and seen["path"] == [str(ferry_dir)], seen
    assert Path(seen["cli"]) == ferry_dir / "services" / "cli.py"
    # none of them from Ferry's install; a dependency's own package of that name is not ours to refuse
    for name, where in seen["top_level"].items():
        assert where is None or not Path(where).is_relative_to(installed["site"]), (name, where)
        assert where is None or not (Path(where) / "dispatch.py").exists(), f"{name} is Ferry's folder: {where}"


def test_the_wheel_holds_every_module_of_the_source_folders(installed):
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dir.items():
        target = installed["site"].joinpath(*name.split("."))
        pattern = "*.py" if name == "ferry" else "**/*.py"  # ferry's subpackages are the other folders
        source = {p.relative_to(REPO / folder) for p in (REPO / folder).glob(pattern)}
        wheel = {p.relative_to(target) for p in target.glob(pattern)}
        assert source == wheel, f"{folder}/ -> {name}: missing {sorted(map(str, source - wheel))}"
    assert not [p.name for p in installed["site"].iterdir() if p.name in ("shared", "services", "kernels", "plan")]


def test_the_build_warns_of_no_package(installed):
    """setuptools took the kernel's C sources folder for a package missing from `packages` and printed 40
    lines at every `pip install .` (issue 56): the wheel carries no package data, so it has none to warn of."""
    out = installed["build_output"]
    assert "Building wheel for ferry" in out, out[-2000:]  # the backend's output is there to look at
    assert "absent from the `packages` configuration" not in out and "Package would be ignored" not in out, out[-4000:]


def test_the_wheel_builds_the_host_expert_kernel(installed):
    """pip compiles the C kernel (pyproject.toml's ext-modules) into ferry.kernels, and it loads: the
    portable rows are on every machine (torch is not needed to load it, only to call it)."""
    (library,) = (installed["site"] / "ferry" / "kernels").glob("_host_experts_c.*")
    done = run_there(
        installed,
        installed["python"],
        "-c",
        f"import ctypes; print(ctypes.CDLL({str(library)!r}).ferry_host_isa_available(1))",
    )
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


def test_the_installed_console_script_plans(installed):
    done = run_there(
        installed,
        installed["bin"] / "ferry",
        "plan",
        QWEN3_30B,
        "--gpu-memory",
        "24GiB",
        "--host-memory",
        "128GiB",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["budget_bytes"] == cuda_plan_budget(24 * 2**30)


def test_run_from_the_tree_without_an_install(tmp_path):
    """How the GPU machine runs it: PYTHONPATH=<repo root>, `python3 -m ferry.services.cli`, no install."""
    there = fresh_venv(tmp_path / "venv")
    bare = run_there(there, there["python"], "-c", "import ferry")
    assert bare.returncode != 0 and "No module named 'ferry'" in bare.stderr, "this venv must not have Ferry"
    done = run_there(there, there["python"], "-c", CHECK, PYTHONPATH=str(REPO))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["path"] == [str(REPO / "ferry"), str(REPO)] and seen["cli"] == str(REPO / "services" / "cli.py")
    done = run_there(
        there,
        there["python"],
        "-m",
        "ferry.services.cli",
        "plan",
        "--model",
        QWEN3_30B,
        "--gpu-memory",
        "24GiB",
        "--host-memory",
        "128GiB",
        "--json",
        PYTHONPATH=str(REPO),
    )
    assert done.returncode == 0 and json.loads(done.stdout)["budget_bytes"] == cuda_plan_budget(24 * 2**30), done.stderr
