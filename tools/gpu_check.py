"""The GPU release check (`make gpu-check`): what CI cannot run, in one command on a CUDA host.

1. the CUDA tests (`tests/gpu`), all of them, with no stop at the first failure, in two processes a file
   to each (`--workers`: so that they fit the device's 600 s call beside step 2);
2. `ferry serve` as a user runs it: default flags except `--model` (a directory with the
   Qwen3-30B-A3B config and a tokenizer of its vocabulary, `ferry make-bench-model`),
   `--load-format dummy --gpu-memory 24GiB` (and `--worker-health-port`, since the worker's
   /metrics is off by default); then the official `openai` client: a streamed chat, a streamed
   completion with `stream_options.include_usage`, 8 concurrent streams; `/health` and the
   worker's `/metrics` scraped; SIGTERM, and a check that serve and its three children exited.

Writes OUT/gpu_check.json (commit, device, test counts, serve_ok, each step, single-stream tok/s)
and OUT/gpu_check.log. Exit status 0 only if every CUDA test passed and serving worked.

    python3 tools/gpu_check.py --out out        # make gpu-check OUT=out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import traceback
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_openai import stream  # noqa: E402
from bench.serve_process import http_get, make_bench_model, start_serve  # noqa: E402

DEFAULT_CONFIG = ROOT / "tests/data/models/qwen3-30b-a3b/config.json"
SLOWEST = 15  # tests whose time the record keeps


class Log:
    """Everything the check prints goes to the terminal and to OUT/gpu_check.log."""

    def __init__(self, path: Path):
        self.file = path.open("a")

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def commit_of_tree() -> tuple[str, bool | None]:
    """(the commit this tree is, whether it has uncommitted changes). FERRY_COMMIT wins when set: a
    copy of the working tree sent to a GPU host may carry no .git, or a stale one."""
    if os.environ.get("FERRY_COMMIT"):
        return os.environ["FERRY_COMMIT"], None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = (
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            != ""
        )
        return head.stdout.strip(), dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def junit_counts(path: Path) -> dict:
    """passed/failed/errors/skipped from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    # the device's time is scarce: the check's record says which tests take it
    timed = sorted(
        ((float(c.get("time") or 0), f"{c.get('classname')}::{c.get('name')}") for c in root.iter("testcase")),
        reverse=True,
    )
    return {
        "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
        "failed": n["failures"] + n["errors"],
        "skipped": n["skipped"],
        "failed_tests": failed,
        "slowest_tests": [[name, round(s, 1)] for s, name in timed[:SLOWEST]],
    }


def host_kernel_up_to_date(root: Path = ROOT) -> bool:
    """The in-place library of each C extension in pyproject.toml is newer than every source and header it lists
    (setuptools' own rule): an editable install, or an earlier check, built it from this very source."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    for ext in setuptools.get("ext-modules", []):
        package, module = ext["name"].rsplit(".", 1)
        library = root / setuptools["package-dir"][package] / (module + sysconfig.get_config_var("EXT_SUFFIX"))
        inputs = [root / f for f in [*ext["sources"], *ext.get("depends", [])]]
        if not library.exists() or any(f.stat().st_mtime > library.stat().st_mtime for f in inputs):
            return False
    return True


def build_host_kernel(out: Path, log: Log) -> bool:
    """The host's C expert kernel built in place, as `pip install` builds it: the tree sent to a GPU host
    is not installed, and without the library the host's share of decode (its graphs' host nodes) is off.
    A library already newer than its sources is kept: compiling it again takes a 2-core runner ten seconds."""
    if host_kernel_up_to_date():
        log("host kernel build: up to date")
        return True
    cmd = [
        sys.executable,
        "-c",
        "import sys; from setuptools import setup; sys.argv = ['setup.py', 'build_ext', '--inplace', '-q']; setup()",
    ]
    with (out / "host_kernel_build.log").open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    log(f"host kernel build: rc {rc}")
    return rc == 0


def run_cuda_tests(out: Path, log: Log, tests: str, timeout: float, workers: int = 1) -> dict:
    xml = out / "gpu_tests.xml"
    # -v: each test's verdict is in the log as it runs, so a run cut by the timeout still says which failed;
    # a test past 150 s has every thread's stack written there (pytest's faulthandler), so a hang says where
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        "-o",
        "faulthandler_timeout=150",
        tests,
        f"--junitxml={xml}",
    ]
    if workers > 1:  # pytest-xdist, a file to a process: each file's tests still run in order in one process
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    log("$", " ".join(cmd))
    t0 = time.monotonic()
    with (out / "gpu_tests.log").open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    counts = (
        junit_counts(xml)
        if xml.is_file()
        else {
            "passed": 0,
            "failed": 1,
            "skipped": 0,
            "slowest_tests": [],
            "failed_tests": [f"pytest did not finish (rc {rc})"],
        }
    )
    counts.update(rc=rc, seconds=round(time.monotonic() - t0, 1))
    log(
        f"CUDA tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
        f"in {counts['seconds']} s (rc {rc})"
    )
    for name in counts["failed_tests"]:
        log("  FAILED", name)
    log("slowest:", ", ".join(f"{name} {s} s" for name, s in counts["slowest_tests"][:5]))
    return counts


def stream_completion(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streamed completion that must carry its usage and exactly `max_tokens` tokens."""
    got = stream(client, model, prompt, max_tokens, temperature=0.0)
    if got["usage"] is None:
        raise AssertionError("the stream ended without a usage chunk (stream_options.include_usage)")
    if got["tokens"] != max_tokens:
        raise AssertionError(f"completion_tokens {got['tokens']}, expected {max_tokens} (ignore_eos)")
    if got["chunks"] < 2:
        raise AssertionError(f"only {got['chunks']} text chunks arrived")
    return {
        "completion_tokens": got["tokens"],
        "prompt_tokens": got["usage"].prompt_tokens,
        "chunks": got["chunks"],
        "ttft_s": got["ttft_s"],
        "decode_s": got["last_s"] - got["first_s"],
        "tok_s": got["tok_s"],
        "text_head": got["text"][:80],
    }


def check_serve(out: Path, log: Log, config: Path, serve_args: list[str], ready_timeout: float, tokens: int) -> dict:
    """`ferry serve` + the openai client; every step's outcome under "steps"."""
    from openai import OpenAI

    steps: dict = {}
    result: dict = {"steps": steps}
    model_dir = make_bench_model(Path(tempfile.mkdtemp(prefix="ferry-gpu-check-")) / config.parent.name, config)
    served = start_serve(model_dir, serve_args, out / "serve.log")
    result["command"] = served.command
    log("$", served.command)
    try:
        result["ready_s"] = round(served.wait_ready(ready_timeout), 1)
        log(f"ready in {result['ready_s']} s")
        client = OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id

        def step(name, fn):
            try:
                steps[name] = {"ok": True, **(fn() or {})}
            except Exception as exc:  # noqa: BLE001 - every step is reported, the check goes on
                steps[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                log(traceback.format_exc())
            log(f"{name}: {json.dumps(steps[name])[:400]}")

        def chat():
            t = time.perf_counter()
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=32, stream=True
            )
            chunks = [c for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            if not text or reasons not in (["stop"], ["length"]):
                raise AssertionError(f"chat stream gave text {text!r}, finish reasons {reasons}")
            return {"chunks": len(chunks), "finish_reason": reasons[0], "seconds": round(time.perf_counter() - t, 3)}

        step("streamed_chat", chat)
        step("streamed_completion", lambda: stream_completion(client, model, "The ferry leaves at", tokens))

        def concurrent():
            t = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                runs = list(
                    pool.map(lambda i: stream_completion(client, model, f"Stream {i} starts", tokens), range(8))
                )
            wall = time.perf_counter() - t
            return {
                "streams": 8,
                "wall_s": round(wall, 3),
                "aggregate_tok_s": round(8 * tokens / wall, 2),
                "per_stream_tok_s": [round(r["tok_s"], 2) for r in runs],
            }

        step("eight_concurrent_streams", concurrent)

        def health():
            code, body = http_get(served.base + "/health")
            if code != 200:
                raise AssertionError(f"/health answered {code}: {body[:200]}")
            return {"status": code}

        def worker_metrics():
            code, body = http_get(served.worker_metrics)
            needed = ("ferry_worker_expert_hits_total", "ferry_worker_expert_misses_total")
            missing = [m for m in needed if m not in body]
            if code != 200 or missing:
                raise AssertionError(f"worker /metrics answered {code}, missing {missing}")
            return {"status": code, "series": sum(1 for line in body.splitlines() if line and not line.startswith("#"))}

        step("health", health)
        step("worker_metrics", worker_metrics)
    except Exception as exc:  # noqa: BLE001
        steps["boot"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        log(f"boot: {steps['boot']}")
    finally:
        stopped = served.stop()
        steps["sigterm"] = {
            "ok": stopped["exit_status"] == 0 and not stopped["children_left"] and stopped["children"] == 3,
            **stopped,
        }
        log(f"sigterm: {steps['sigterm']}")
    result["serve_ok"] = "boot" not in steps and all(s["ok"] for s in steps.values()) and len(steps) == 6
    completion = steps.get("streamed_completion", {})
    result["single_stream_tok_s"] = round(completion["tok_s"], 2) if completion.get("ok") else None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for gpu_check.json and the logs")
    parser.add_argument("--tests", default="tests/gpu", help="the CUDA tests (a pytest path)")
    parser.add_argument("--skip-tests", action="store_true", help="serve only (counts as failed tests: 0 run)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the served model's config.json")
    parser.add_argument(
        "--serve-args",
        default="--load-format dummy --gpu-memory 24GiB",
        help="flags for ferry serve beyond --model, --port and --worker-health-port",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed completion")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    # 109 CUDA tests took ~310 s on the H200 (262 s for 91), 217 took 428 s (6dd9cdd) against this 440: the whole
    # check must fit one 600 s device call, so the tests run in two processes, a file to each at a time (the
    # GPU has room for both; their files took 142 s at most). --workers 1 runs them in one, as before.
    parser.add_argument("--tests-timeout", type=float, default=440.0)
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist processes for the CUDA tests")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check.log")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    commit, dirty = commit_of_tree()
    import torch

    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)"
    log(f"gpu check of {commit}{' (uncommitted changes)' if dirty else ''} on {device_name}")
    result = {
        "commit": commit,
        "dirty": dirty,
        "device_name": device_name,
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    t0 = time.monotonic()
    result["host_kernel_built"] = build_host_kernel(out, log)
    if args.skip_tests:
        tests = {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": [], "rc": "skipped"}
    else:
        tests = run_cuda_tests(out, log, args.tests, args.tests_timeout, args.workers)
    result.update(
        cuda_tests_passed=tests["passed"],
        cuda_tests_failed=tests["failed"],
        cuda_tests_skipped=tests["skipped"],
        cuda_tests=tests,
        cuda_test_workers=args.workers,
    )
    serve = check_serve(out, log, args.config, args.serve_args.split(), args.ready_timeout, args.tokens)
    result.update(
        serve_ok=serve["serve_ok"],
        single_stream_tok_s=serve["single_stream_tok_s"],
        serve=serve,
        seconds=round(time.monotonic() - t0, 1),
    )
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    ok = tests["failed"] == 0 and (args.skip_tests or tests["passed"] > 0) and serve["serve_ok"]
    log(
        f"gpu check {'PASSED' if ok else 'FAILED'}: {tests['passed']} CUDA tests passed, {tests['failed']} failed; "
        f"serve_ok {serve['serve_ok']}; single stream {serve['single_stream_tok_s']} tok/s; {result['seconds']} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
