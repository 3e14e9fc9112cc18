"""`python -m ferry.services.healthcheck`: the image's HEALTHCHECK, for whichever Ferry command the
container runs: GET /health on this container's own port (FERRY_HEALTH_PORT for the scheduler and
the worker, FERRY_PORT for the api and serve, else 8000); exit 0 when it answers 200. Standard
library only: it runs every few seconds and must start fast."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def health_url(environ=os.environ) -> str:
    port = environ.get("FERRY_HEALTH_PORT") or environ.get("FERRY_PORT") or "8000"
    return f"http://127.0.0.1:{port}/health"


def main() -> int:
    url = health_url()
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
