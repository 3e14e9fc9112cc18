"""Children that die with their parent (ferry serve's processes, an expert-parallel worker's ranks)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int):
    """A child's pre-exec step: the kernel sends it SIGKILL when its parent (`parent`: serve, or an
    expert-parallel worker's rank 0) dies, however it dies (kill -9 included), so no child outlives it
    under PID 1. SIGKILL, not SIGTERM: a stopped child (kill -STOP,
    a debugger) does not act on SIGTERM until it is continued, and would stay behind in state T; SIGKILL
    ends a stopped process too. Serve's own stop (SIGTERM, SIGINT) still stops its children gracefully
    (_stop_all): this is only for a serve that could not. Linux only; elsewhere a no-op."""

    def set_pdeathsig() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # serve died before the prctl took effect
            os._exit(1)

    return set_pdeathsig
