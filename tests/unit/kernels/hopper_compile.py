"""Compile Triton kernels for Hopper (sm_90, the H200) on a machine without a GPU, so a kernel that
would not compile on the target fails on CPU CI, not first on the GPU machine.

Both sides live here: a test calls `compile_in_child(script)`, which runs one of the compile_*.py
scripts beside this file in a child process with TRITON_INTERPRET unset (this process may already
interpret); the script lists its kernels' signatures and prints `compile_each(...)` as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def compile_in_child(script: str, *args: str) -> dict:
    """{kernel name: {"cubin": bool, "shared": bytes, "stack": spilled bytes a thread or None} or
    {"error": text}} from compile_<script>.py, run with `args`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spilled_bytes(cubin: bytes) -> int | None:
    """The stack frame a thread of the compiled kernel uses (registers spilled past the 255 a thread has),
    from triton's own cuobjdump -res-usage; None where that tool is missing."""
    import re
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    stacks = [int(m) for m in re.findall(r"STACK:(\d+)", usage)]
    return max(stacks) if stacks else None


def compile_each(signatures: list) -> dict:
    """Compile every (name, jit function, signature, constexprs[, options]) for sm_90 (child side)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    hopper = GPUTarget("cuda", 90, 32)
    results = {}
    for name, fn, sig, consts, *options in signatures:
        try:
            src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
            compiled = triton.compile(src, target=hopper, options=options[0] if options else None)
            results[name] = {
                "cubin": "cubin" in compiled.asm,
                "shared": compiled.metadata.shared,
                "stack": spilled_bytes(compiled.asm["cubin"]),
            }
        except Exception as exc:  # noqa: BLE001 - reported to the parent test
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    return results


def print_results(signatures_of) -> None:
    """A compile script's main: both dtypes, JSON on stdout."""
    print(json.dumps(compile_each([s for dtype in ("bf16", "fp32") for s in signatures_of(dtype)])))
