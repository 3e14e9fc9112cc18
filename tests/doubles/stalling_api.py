"""`ferry api` whose event loop stalls for STALL_S seconds (default 3.5) at each SIGUSR1: a busy api
replica, reproducibly. The handler sleeps in the main thread, so the loop runs nothing meanwhile while
the process's other threads (and the GIL) stay free, as when the loop is stuck in long work.

    python -m tests.doubles.stalling_api <ferry api flags>
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ferry.services.cli import main


def _stall(stall_s: float) -> None:
    t0 = time.monotonic()
    time.sleep(stall_s)
    print(f"event loop stalled {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)  # for the test to see


if __name__ == "__main__":
    stall_s = float(os.environ.get("STALL_S", "3.5"))
    signal.signal(signal.SIGUSR1, lambda *_: _stall(stall_s))
    sys.exit(main(["api", *sys.argv[1:]]))
