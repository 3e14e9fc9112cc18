"""The control plane (shared/, services/api/, services/scheduler/) never imports torch, not even
transitively, and with forbid_torch() a tokenizer loads without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

IMPORT_ALL = """
import importlib, pkgutil, sys
import shared, ferry.services.api, ferry.services.scheduler
for pkg in (shared, ferry.services.api, ferry.services.scheduler):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
import ferry.services.cli, ferry.services.serve_command, ferry.services.worker.service, ferry.services.worker.command
loaded = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
assert not loaded, loaded
print("ok")
"""

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
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip


def test_importing_every_control_plane_module_loads_no_torch():
    done = run(IMPORT_ALL)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_api_tokenizer_loads_without_torch(tiny_tokenizer_dir):
    done = run(TOKENIZER, str(tiny_tokenizer_dir))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
