"""Where the processes meet, and the defaults more than one command shares: each written once here.

`ferry api`, `ferry scheduler` and `ferry worker` started one by one (by hand, by compose with
FERRY_* variables) meet on these tcp addresses unless told otherwise; `ferry serve` puts the same
three sockets in a private directory instead (`ipc_addresses`). Nothing listens beyond loopback
by default (docs/ARCHITECTURE.md, "Processes and the wire")."""

from __future__ import annotations

from pathlib import Path

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine only."""
    host = host.strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
API_ADDR = f"tcp://{LOOPBACK}:5555"  # the scheduler's ROUTER binds here; api replicas connect DEALERs
STEPS_ADDR = f"tcp://{LOOPBACK}:5556"  # the scheduler's ROUTER sends steps from here; the worker connects a DEALER
RESULTS_ADDR = f"tcp://{LOOPBACK}:5557"  # the scheduler PULLs results here; the worker connects PUSHes
STEP_TIMEOUT_S = 300.0  # one worker step running longer than this counts as a hung worker


def ipc_addresses(rundir: Path) -> tuple[str, str, str]:
    """(api, steps, results) as ipc sockets in `rundir` (a private directory of one launch)."""
    return tuple(f"ipc://{rundir}/{name}.sock" for name in ("api", "steps", "results"))  # type: ignore[return-value]
