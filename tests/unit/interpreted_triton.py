"""Run Triton kernels on CPU through TRITON_INTERPRET=1, in a fresh Python process.

The interpreter must be chosen before `triton` is first imported: triton.language's own helpers
(tl.sum, tl.max...) are jit functions decorated at import, compiled or interpreted once and for
all. In a test session something (transformers, torch) may already have imported triton in
compiled mode, so the interpreted calls run in a subprocess with the variable set from the start.
Inputs and outputs cross as a torch.save file."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import importlib, sys, torch
module, function, path = sys.argv[1:4]
fn = getattr(importlib.import_module(module), function)
calls = torch.load(path)
torch.save([fn(*args, **kwargs) for args, kwargs in calls], path + ".out")
"""


def run_interpreted(module: str, function: str, calls: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
    """[module.function(*args, **kwargs) for each call], computed by the Triton interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calls.pt")
        torch.save(calls, path)
        python_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path)
        command = [sys.executable, "-c", _SCRIPT, module, function, path]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"interpreted {module}.{function} failed:\n{done.stderr[-4000:]}")
        return torch.load(path + ".out")
