"""Load a fresh copy of a Triton kernel module with TRITON_INTERPRET=1, so its kernels run on CPU.

triton.jit decides between compiling and interpreting when the decorator runs, so a copy loaded
under its own module name is decorated anew, whatever other tests imported before. The launch
itself reads the setting again (lazy imports inside the interpreter), so callers keep
TRITON_INTERPRET=1 set while they run the kernel: use the `interpreted` context manager."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def interpreted(relative_path: str):
    """Yields the module loaded in interpreter mode; TRITON_INTERPRET=1 for the duration."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield _load(relative_path)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _load(relative_path: str) -> ModuleType:
    name = "interpreted_" + relative_path.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]
