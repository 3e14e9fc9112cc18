"""The scheduler's and the worker's own `/health` and `/metrics`, on a side port, in a daemon thread.

Plain stdlib HTTP: these processes run a ZeroMQ loop (or a model), not an asyncio server, and the
endpoints only read a snapshot the main loop keeps current.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ferry.shared.defaults import LOOPBACK
from ferry.shared.port_flag import port_number

HealthProbe = Callable[[], tuple[bool, dict]]  # (ready, body)


def add_side_http_flags(group) -> None:
    """`--health-host` and `--health-port`, for a parser or an argument group."""
    group.add_argument("--health-host", default=LOOPBACK, help="interface for /health and /metrics")
    group.add_argument(
        "--health-port", type=port_number, default=None, help="port for /health and /metrics (default: none)"
    )


def serve_side_http(host: str, port: int, health: HealthProbe, registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Start serving; returns the server (server.server_address[1] is the bound port, for port 0)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                ready, body = health()
                self._reply(200 if ready else 503, "application/json", json.dumps(body).encode())
            elif self.path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            else:
                self._reply(404, "application/json", b'{"error": "not found; try /health or /metrics"}')

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # health probes every few seconds would flood the log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="side-http", daemon=True).start()
    return server
