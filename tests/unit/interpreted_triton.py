"""Run Triton kernels on CPU through TRITON_INTERPRET=1, in a separate Python process.

The interpreter must be chosen before `triton` is first imported: triton.language's own helpers
(tl.sum, tl.max...) are jit functions decorated at import, compiled or interpreted once and for
all. In a test session something (transformers, torch) may already have imported triton in
compiled mode, so the interpreted calls run in a child process with the variable set from the start.
Inputs and outputs cross as a torch.save file.

The child stays up and takes the next batch of calls (one child a test process and FERRY_* environment):
starting Python, torch and triton again for each batch cost the suite about two seconds a batch."""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # one batch of calls; the interpreter is slow, a loaded 2-core runner more so

# Reads "module<TAB>function<TAB>path" lines; for each, saves the results to path.out (or the traceback to
# path.err) and answers "done" on the reply pipe (its fd is argv[1]; stdout is the kernels' own).
_SCRIPT = """
import importlib, os, sys, traceback, torch
from tests.triton_interpreter_patch import install
install()
reply = os.fdopen(int(sys.argv[1]), "w")
for line in sys.stdin:
    module, function, path = line.rstrip("\\n").split("\\t")
    try:
        fn = getattr(importlib.import_module(module), function)
        calls = torch.load(path)
        torch.save([fn(*args, **kwargs) for args, kwargs in calls], path + ".out")
    except BaseException:
        with open(path + ".err", "w") as err:
            err.write(traceback.format_exc())
    reply.write("done\\n")
    reply.flush()
"""


class _Interpreter:
    """One child process under TRITON_INTERPRET=1 with this process's environment at its start."""

    def __init__(self) -> None:
        python_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path)
        self.stderr = tempfile.TemporaryFile()
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(write_fd)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            pass_fds=(write_fd,),
            text=True,
        )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)

    def run(self, module: str, function: str, path: str) -> None:
        """Runs one batch; raises with the child's traceback, or its stderr if it died."""
        try:
            self.proc.stdin.write(f"{module}\t{function}\t{path}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the reply pipe says so below
        ready, _, _ = select.select([self.replies], [], [], TIMEOUT_S)
        answered = bool(ready) and self.replies.readline() == "done\n"
        if not answered:
            self.close()
            self.stderr.seek(0)
            tail = self.stderr.read()[-4000:].decode(errors="replace")
            raise RuntimeError(
                f"interpreted {module}.{function}: the child {'died' if ready else 'timed out'}:\n{tail}"
            )
        if os.path.exists(path + ".err"):
            raise RuntimeError(f"interpreted {module}.{function} failed:\n{Path(path + '.err').read_text()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.replies.close()


_interpreters: dict[tuple, _Interpreter] = {}


@atexit.register
def _close_all() -> None:
    for interpreter in _interpreters.values():
        interpreter.close()


def run_interpreted(module: str, function: str, calls: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
    """[module.function(*args, **kwargs) for each call], computed by the Triton interpreter."""
    # FERRY_* variables steer the dispatch (FERRY_TRITON_ON_CPU...): a child serves one setting of them
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FERRY_")))
    interpreter = _interpreters.get(key)
    if interpreter is None or not interpreter.alive():
        interpreter = _interpreters[key] = _Interpreter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calls.pt")
        torch.save(calls, path)
        interpreter.run(module, function, path)
        return torch.load(path + ".out")
