"""The API's JSON depth check and decode (services/api/json_limits.py, schema.decode_body) timed on 4 MiB
bodies of the shapes that cost a scanner most (tests/unit/test_api_http_edge.py's adversarial_bodies):
the check is linear in the body whatever its shape, so each should take well under a second (a regular
expression of old took 18 s on a few hundred KB). The unit tests check the counts; the times are here.

    python3 bench/json_depth.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.services.api import json_limits, schema  # noqa: E402
from ferry.shared.errors import InvalidRequest  # noqa: E402
from tests.unit.test_api_http_edge import adversarial_bodies  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per shape; the best is reported")
    args = ap.parse_args()
    results = {}
    for shape, body in adversarial_bodies().items():
        depth_s = decode_s = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            json_limits.json_depth(body)
            depth_s = min(depth_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            try:
                schema.decode_body(body, schema.ChatCompletionRequest)
            except InvalidRequest:
                pass
            decode_s = min(decode_s, time.perf_counter() - t0)
        results[shape] = {"bytes": len(body), "depth_s": round(depth_s, 4), "check_and_decode_s": round(decode_s, 4)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
