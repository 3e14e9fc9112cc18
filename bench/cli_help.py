"""`ferry [COMMAND] --help` timed for every command (a fresh interpreter each, the best of --repeats): it
should print well under a second, since it imports nothing heavy. The unit test
(tests/unit/test_cli_flags.py) checks the imports; the times, which depend on the machine, are here.

    python3 bench/cli_help.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ferry.services.cli import COMMANDS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per command; the best is reported")
    args = ap.parse_args()
    results = {}
    for command in ["", *COMMANDS]:
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "ferry.services.cli", *([command] if command else []), "--help"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            )
            best = min(best, time.perf_counter() - t0)
        results[command or "(none)"] = round(best, 3)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
