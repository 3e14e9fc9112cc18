"""The built-in tiny demo model `ferry serve` uses without --model: generated once by
`ferry make-tiny-model` (deterministic: fixed seeds) into a cache directory, then reused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ferry.shared.errors import ModelLoadError

DEMO_ARCH = "qwen3_moe"


def demo_model_dir() -> Path:
    root = os.environ.get("FERRY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ferry")
    return Path(root) / f"tiny-{DEMO_ARCH.replace('_', '-')}"


def ensure_demo_model() -> Path:
    target = demo_model_dir()
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))  # same filesystem: rename is atomic
    except OSError as exc:
        raise ModelLoadError(_not_writable(target.parent, exc)) from exc
    cmd = [sys.executable, "-m", "ferry.services.cli", "make-tiny-model", str(staging), "--arch", DEMO_ARCH]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(f"could not generate the demo model ({' '.join(cmd[2:])}): {done.stderr.strip()[-2000:]}")
    try:
        staging.rename(target)
    except OSError:  # another `ferry serve` made it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _not_writable(cache: Path, exc: OSError) -> str:
    """What to do when the cache cannot take the demo model: most often a compose volume that Docker
    made root-owned (an image older than the one that creates its mount point) for uid 10001."""
    return (
        f"the demo model cannot be written to its cache {cache}: {exc.strerror or exc} (this process runs as uid "
        f"{os.getuid()}). Give a writable directory with FERRY_CACHE_DIR, or serve a model with --model DIR. "
        "Under compose, a demo-cache volume made by an older image is root-owned: remove it "
        "(`docker compose --profile cpu down -v`, or `docker volume rm ferry_demo-cache`) and start again"
    )
