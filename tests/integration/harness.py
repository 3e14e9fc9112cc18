"""Start the real api, scheduler and worker processes (worker around the PagedHashModel double) on
ipc sockets in a private directory, as compose or `ferry serve` would, and stop them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ferry.shared.defaults import ipc_addresses

REPO = Path(__file__).resolve().parents[2]
FAKE_BOOT = "tests.doubles.fake_worker:boot_paged_hash_model"


_HANDED_PORTS: set[int] = set()
# free_port's ports sit below the kernel's ephemeral range (where bind(0) and every outgoing connection take
# theirs), each test worker in a block of its own, stepped by 3: `ferry serve` puts its scheduler and worker
# on --port + 1 and + 2, which then belong to no one else either (with ports from bind(0), a client's
# connection took a scheduler's port + 1 between its check and its bind)
PORT_STEP = 3
LOWEST_PORT = 10000


def _port_block() -> range | None:
    """This test worker's ports (pytest-xdist's gwN of PYTEST_XDIST_WORKER_COUNT), or None where the ephemeral
    range leaves too few below it."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (ephemeral_low - LOWEST_PORT) // max(workers, 1)
    if size < 300 * PORT_STEP:
        return None
    start = LOWEST_PORT + index * size
    return range(start, start + size - PORT_STEP, PORT_STEP)


_PORT_BLOCK = _port_block()
_next_in_block = 0


def port_free(port: int) -> bool:
    """Whether a loopback port can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port free now, never handed out before by this process, and (where the machine's ephemeral
    range allows: _port_block) in this test worker's own block, with the two after it free too."""
    global _next_in_block
    while _PORT_BLOCK is not None and _next_in_block < len(_PORT_BLOCK):
        port = _PORT_BLOCK[_next_in_block]
        _next_in_block += 1
        if all(port_free(p) for p in range(port, port + PORT_STEP)):
            _HANDED_PORTS.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_PORTS:
            _HANDED_PORTS.add(port)
            return port


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def ascii_word_tokens(tokenizer) -> list[int]:
    """Token ids that decode to letters/digits/spaces only: generated text then round-trips exactly."""
    ids = []
    for i in range(len(tokenizer)):
        s = tokenizer.decode([i])
        if s and s.isascii() and s.strip() and all(c.isalnum() or c == " " for c in s):
            ids.append(i)
    return ids


def make_model_dir(
    tokenizer_dir: Path,
    target: Path,
    tokenizer,
    step_delay_s: float = 0.0,
    linear_state_slots: int = 0,
    script: dict | None = None,
    delayed_steps: int | None = None,
) -> Path:
    """A model directory for the PagedHashModel double (tests/doubles/fake_worker.py): each step sleeps
    step_delay_s (only the first `delayed_steps` steps, where given); `script`:
    {"trigger": text, "token_ids": [...]}, the fixed output of prompts holding the trigger."""
    shutil.copytree(tokenizer_dir, target)
    spec = {
        "vocab": ascii_word_tokens(tokenizer),
        "step_delay_s": step_delay_s,
        "delayed_steps": delayed_steps,
        "linear_state_slots": linear_state_slots,
        "vocab_size": len(tokenizer),
    }
    if script is not None:
        spec["script"] = script
    (target / "paged_hash_model.json").write_text(json.dumps(spec))
    return target


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(base_url: str, name: str) -> float:
    _, text = http_get(base_url + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in /metrics")


@dataclass
class Cluster:
    rundir: Path
    model_dir: Path
    port: int
    scheduler_health_port: int
    worker_health_port: int
    api_addr: str = ""
    sock_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    steps_addr: str = ""
    results_addr: str = ""
    envs: dict[str, dict[str, str]] = field(default_factory=dict)

    def restart(self, name: str) -> subprocess.Popen:
        """Start `name` again with the command and environment it had (what compose's restart policy does)."""
        old = self.procs[name]
        return self.launch(name, list(old.args), self.envs.get(name))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until /health answers 200 (a service that exits fails it at once, with its log). The first boots of a
        fresh clone's suite, three test workers booting theirs side by side on a loaded machine, once took more than
        a minute."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; log: {self.log(name)[-3000:]}")
            if healthy(self.base_url):
                return
            time.sleep(0.1)
        raise TimeoutError("the server did not become ready: " + "".join(self.log(n)[-1500:] for n in self.procs))

    def launch(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.rundir / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen(
            cmd, cwd=REPO, env={**child_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
        return self.procs[name]

    def log(self, name: str) -> str:
        path = self.rundir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)


def tcp_addresses() -> tuple[str, str, str]:
    """(api, steps, results) on loopback ports free now: the tcp layout, as compose wires it."""
    return tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(3))  # type: ignore[return-value]


def start_cluster(
    model_dir: Path,
    rundir: Path,
    worker_flags=(),
    api_flags=(),
    boot: str = FAKE_BOOT,
    scheduler_flags=(),
    worker_env: dict[str, str] | None = None,
    layout: str = "ipc",
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> Cluster:
    """The three processes; `layout` "tcp" puts them on loopback tcp ports (compose's layout), `env`
    goes to all three (FERRY_WIRE_KEYS: the CURVE key directory)."""
    rundir.mkdir(parents=True, exist_ok=True)
    sock_dir = None
    if layout == "tcp":
        api_addr, steps, results = tcp_addresses()
    else:
        sock_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ferry-test-{os.getpid()}-{free_port()}"
        sock_dir.mkdir(mode=0o700)  # ipc paths must stay short (108 bytes), pytest's tmp paths are long
        api_addr, steps, results = ipc_addresses(sock_dir)
    c = Cluster(rundir, model_dir, free_port(), free_port(), free_port(), api_addr, sock_dir)
    c.steps_addr, c.results_addr = steps, results
    ferry = [sys.executable, "-m", "ferry.services.cli"]
    cmds = {
        "scheduler": [
            *ferry,
            "scheduler",
            "--api-addr",
            api_addr,
            "--steps-addr",
            steps,
            "--results-addr",
            results,
            "--health-port",
            str(c.scheduler_health_port),
            *scheduler_flags,
        ],
        "worker": [
            *ferry,
            "worker",
            "--model",
            str(model_dir),
            "--steps-addr",
            steps,
            "--results-addr",
            results,
            "--boot",
            boot,
            "--health-port",
            str(c.worker_health_port),
            *worker_flags,
        ],
        "api": api_command(model_dir, api_addr, c.port, *api_flags),
    }
    for name, cmd in cmds.items():
        c.launch(name, cmd, {**(env or {}), **((worker_env or {}) if name == "worker" else {})})
    c.envs = {name: {**(env or {}), **((worker_env or {}) if name == "worker" else {})} for name in cmds}
    if wait:
        c.wait_ready()
    return c


# The real worker on CPU: torch's intra-op pool defaults to one thread per core, and on a small CI runner
# shared with the api, the scheduler and the test process its threads mostly wait for each other (the
# tiny model's steps run several times slower, and their time varies tenfold with the runner's load).
REAL_WORKER_ENV = {"OMP_NUM_THREADS": "1"}


def api_command(model_dir: Path, scheduler_addr: str, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ferry.services.cli",
        "api",
        "--model",
        str(model_dir),
        "--scheduler-addr",
        scheduler_addr,
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        *flags,
    ]


def eventually(check, timeout: float = 15.0, interval: float = 0.1):
    """Poll `check()` until it returns a truthy value (gauges travel on 0.5 s heartbeats); the default
    timeout is generous for a loaded 2-core machine: a check that holds returns as soon as it does."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def labelled_metric(base_url: str, name: str, **labels: str) -> float:
    """A labelled sample's value (0 when that label set has not been observed yet)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in http_get(base_url + "/metrics")[1].splitlines():
        if line.startswith(name + "{") and want <= set(line[len(name) + 1 : line.index("}")].split(",")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _stream_completion(client, prompt: str, n: int, ignore_eos: bool) -> tuple[str, int | None, str | None]:
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    text, usage, reason = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return "".join(text), usage, reason


def stream_concurrently(
    base_url: str, jobs: list[tuple[str, int]], api_key: str = "x", ignore_eos: bool = True
) -> list[tuple[str, int | None, str | None]]:
    """Stream every (prompt, max_tokens) job at once through the openai AsyncOpenAI client, greedy (with
    ignore_eos unless told otherwise); [(text, usage.completion_tokens, finish_reason)] in the jobs' order."""
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=60)
        try:
            streams = (_stream_completion(client, p, n, ignore_eos) for p, n in jobs)
            return await asyncio.wait_for(asyncio.gather(*streams), 90)
        finally:
            await client.close()

    return asyncio.run(main())


def kill_worker_mid_streams(c: "Cluster", prompt: str, extra_body: dict | None = None) -> None:
    """SIGKILL the worker while four streams and one plain request are generating: every one fails
    within 15 s naming the worker (not at a client's timeout), /health turns 503 and a new request is refused
    at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=60)

    async def one(i: int, started: asyncio.Event):
        try:
            stream = await client.completions.create(
                model="tiny", prompt=f"{prompt} {i}", max_tokens=400, stream=True, extra_body=extra_body
            )
            async for _ in stream:
                started.set()
        except openai.APIError as exc:
            return time.monotonic(), exc
        return time.monotonic(), None

    async def main():
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(one(i, started[i])) for i in range(4)]
        plain = asyncio.create_task(
            client.completions.create(model="tiny", prompt=f"{prompt} too", max_tokens=400, extra_body=extra_body)
        )
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 20)  # all four are generating
        c.procs["worker"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        try:
            await asyncio.wait_for(plain, 30)
            plain_error = None
        except openai.APIStatusError as exc:
            plain_error = exc
        await client.close()
        return killed, results, plain_error

    killed, results, plain_error = asyncio.run(main())
    for ended, err in results:
        assert err is not None, "a stream finished normally although its worker died"
        assert "worker" in str(err) and ended - killed < 15.0
    assert plain_error is not None and plain_error.status_code == 503 and "worker" in plain_error.message
    health_turns_503(c.base_url, "worker")
    assert_new_request_refused(c.base_url)


def health_turns_503(base_url: str, reason: str, timeout: float = 15.0) -> str:
    """Wait for /health to answer 503; returns its body, which must name `reason`."""
    found = eventually(lambda: (lambda r: r if r[0] == 503 else None)(http_get(base_url + "/health")), timeout=timeout)
    status, body = found or (0, "")
    assert status == 503 and reason in body, f"/health did not turn 503 naming {reason!r}: {status} {body[:200]}"
    return body


def assert_new_request_refused(base_url: str, within_s: float = 15.0) -> None:
    """A request sent now gets a 503 at once, not a place in a queue until the client's 30 s timeout."""
    import openai

    t0 = time.monotonic()
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    try:
        client.completions.create(model="tiny", prompt="anyone?", max_tokens=3)
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
    else:
        raise AssertionError("a request succeeded although the server cannot serve")
    assert time.monotonic() - t0 < within_s


@dataclass
class ServedModel:
    """A `ferry serve` child: its process, its url, its log (JSON lines)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]


@contextmanager
def serve_model(
    model_dir: Path,
    tmp: Path,
    env: dict[str, str] | None = None,
    *flags: str,
    device: str | None = "cpu",
    max_model_len: int = 512,
    ready_timeout: float = 180,
    stop_timeout: float = 20,
):
    """`ferry serve MODEL` as a user runs it (the model positional), with `--served-model-name tiny`, until
    the block ends (then SIGTERM). On the CPU unless `device` says otherwise (None: serve's own choice);
    a real model on a GPU may take minutes to load (`ready_timeout`)."""
    port = free_port()
    log_path = tmp / "serve.log"
    placed = ["--device", device] if device is not None else []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ferry.services.cli",
                "serve",
                str(model_dir),
                "--port",
                str(port),
                *placed,
                "--max-model-len",
                str(max_model_len),
                "--served-model-name",
                "tiny",
                *flags,
            ],
            cwd=REPO,
            env={**child_env(), **(env or {}), "TMPDIR": str(tmp)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    served = ServedModel(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        # a serve that exited fails at once, with its log, rather than after the whole ready_timeout
        eventually(lambda: proc.poll() is not None or healthy(served.url), timeout=ready_timeout, interval=0.2)
        assert proc.poll() is None and healthy(served.url), log_path.read_text()[-3000:]
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 (False while it cannot be reached)."""
    try:
        return http_get(url + "/health", timeout=1)[0] == 200
    except OSError:
        return False
