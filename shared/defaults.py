"""Where the processes meet, and the defaults more than one command shares: each written once here.

`ferry api`, `ferry scheduler` and `ferry worker` started one by one (by hand, by compose with
FERRY_* variables) meet on these tcp addresses unless told otherwise; `ferry serve` puts the same
three sockets in a private directory instead (`ipc_addresses`). Nothing listens beyond loopback
by default (docs/ARCHITECTURE.md, "Processes and the wire")."""

from __future__ import annotations

import ipaddress
from pathlib import Path

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether `host` (a literal address, IPv6 with or without brackets, or `localhost`) is this machine
    only. Any other name is not, whatever it resolves to now: `127.0.0.1.nip.io` is a name that a
    resolver may answer with any address, and a bind cannot use it."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


API_ADDR = f"tcp://{LOOPBACK}:5555"  # the scheduler's ROUTER binds here; api replicas connect DEALERs
STEPS_ADDR = f"tcp://{LOOPBACK}:5556"  # the scheduler's ROUTER sends steps from here; the worker connects a DEALER
RESULTS_ADDR = f"tcp://{LOOPBACK}:5557"  # the scheduler PULLs results here; the worker connects PUSHes
STEP_TIMEOUT_S = 300.0  # one worker step running longer than this counts as a hung worker


# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), its NUL included: a longer ipc path cannot bind
IPC_PATH_MAX = 103
IPC_SOCKET_NAMES = ("api", "steps", "results")
RUNDIR_NAME_LEN = len("ferry-4194304-") + 8  # serve's rundir: ferry-<pid>-<mkdtemp's 8 characters>


def rundir_base(tmp: str, fallbacks: tuple[str, ...] = ("/tmp",)) -> str:
    """Where serve makes its socket directory: `tmp` (TMPDIR) unless the sockets' paths under it would be
    longer than a Unix socket path may be (a deep TMPDIR: CI runners, pytest's tmp_path), then the first
    fallback short enough, which a launch may use as well (its directory is private, mode 0700)."""
    longest = max(len(f"{n}.sock") for n in IPC_SOCKET_NAMES) + RUNDIR_NAME_LEN + 2  # two separators
    for base in (tmp, *fallbacks):
        if len(base.rstrip("/")) + longest <= IPC_PATH_MAX:
            return base
    raise ValueError(
        f"no directory short enough for serve's ipc sockets: TMPDIR {tmp!r} is too deep "
        f"(at most {IPC_PATH_MAX - longest} characters); set TMPDIR to a shorter path"
    )


def ipc_addresses(rundir: Path) -> tuple[str, str, str]:
    """(api, steps, results) as ipc sockets in `rundir` (a private directory of one launch)."""
    return tuple(f"ipc://{rundir}/{name}.sock" for name in IPC_SOCKET_NAMES)  # type: ignore[return-value]
