"""The api's HTTP connections: aiohttp's connection handler, with the limits a client cannot get past
before a request reaches a route (README, "HTTP limits"):

- open connections: past --max-connections a new connection gets a 503 and is closed at once, unread;
- header bytes: a request whose request line and headers pass --max-header-size gets a 431 and is closed
  (aiohttp checks each line, 8,190 bytes, and the count of lines, not their sum);
- header time: a request's headers (or, on a new connection, its first byte) must arrive within
  --header-timeout, else a 408 (or, with nothing sent, a plain close);
- framing: a transfer-coding other than chunked is a 501 naming it (aiohttp would read the body as
  chunked and ignore the rest); a request asking to switch protocols (Upgrade: h2c) is answered over
  HTTP/1.1 and then closed, since aiohttp's parser drops what was pipelined behind it;
- anything aiohttp cannot parse is answered with an OpenAI error object, not its plain-text page.

A refusal that follows requests of the same connection still in progress is queued behind them, so
responses never interleave. Memory: the headers of a flood are freed when its connections close, but
glibc keeps the freed pages; after enough closed connections malloc_trim hands them back.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import resource
from dataclasses import dataclass

import structlog
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_server import Server

from ferry.services.api.http_errors import _TYPE_BY_STATUS, error_response
from ferry.services.api.responses import error_body

log = structlog.get_logger("api.connection")

REFUSED_LOG_INTERVAL_S = 10.0  # at most one log line of refused connections this often (a flood's)
TRIM_AFTER_CLOSED = 64  # connections closed since the last malloc_trim before the next
TRIM_INTERVAL_S = 2.0  # and at most one malloc_trim this often (it walks the whole heap)
FD_RESERVE = 128  # descriptors besides the connections: the scheduler's sockets, the tokenizer's files, logs


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int
    max_connections: int
    header_timeout_s: float


class _Trim:
    """glibc's malloc_trim(0) (absent elsewhere: nothing is done), which returns the free pages of every
    arena to the system: once TRIM_AFTER_CLOSED connections closed, at most every TRIM_INTERVAL_S."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        libc = ctypes.util.find_library("c")
        self._fn = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
        self._loop = loop
        self._closed = 0
        self._last = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    def connection_closed(self) -> None:
        self._closed += 1
        if self._closed >= TRIM_AFTER_CLOSED and self._pending is None and self._fn is not None:
            delay = max(0.0, self._last + TRIM_INTERVAL_S - self._loop.time())
            self._pending = self._loop.call_later(delay, self._trim)

    def _trim(self) -> None:
        self._pending = None
        self._closed = 0
        self._last = self._loop.time()
        # it walks the whole heap: off the event loop (ctypes lets go of the GIL for the call)
        self._loop.run_in_executor(None, self._fn, 0)


def _refusal(status: int, reason: str, message: str, headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, written before any request was read."""
    body = json.dumps(
        error_body(status, "service_unavailable" if status == 503 else "invalid_request_error", message)
    ).encode()
    head = "".join(
        f"{k}: {v}\r\n"
        for k, v in {
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Connection": "close",
            **headers,
        }.items()
    )
    return f"HTTP/1.1 {status} {reason}\r\n{head}\r\n".encode() + body


class ApiConnection(RequestHandler):
    """One client connection (see the module's docstring)."""

    def __init__(self, manager: "ApiServer", **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._server = manager
        self.limits = manager.limits
        self._header_bytes = 0  # bytes of the request being read, before its headers ended
        self._body = None  # the last request's body stream (None before the first request)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._refused = False  # an error is queued: nothing more is parsed
        self._admitted = False  # under the connection cap (a refused one allocated nothing to trim)

    # ---- connections ------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        server = self._server
        if len(server._connections) >= self.limits.max_connections:
            self._manager = None  # never registered: connection_lost has nothing to undo
            self._force_close = True
            server.refused_connection()
            transport.write(server.too_many_connections)
            transport.close()
            return
        super().connection_made(transport)
        self._admitted = True
        self._arm_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)
        if self._admitted:
            self._server.trim.connection_closed()

    # ---- requests' heads --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused or self._force_close or self._close:
            return
        reading_head = self._body is None or self._body.is_eof()
        if reading_head and data:
            if self._header_deadline is None:
                self._arm_header_deadline()
            self._header_bytes += len(data)
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:  # heads ended: check them, and start counting the next one afresh
            self._header_bytes = 0
            self._disarm_header_deadline()
            self._body = self._messages[-1][1]
            for i in range(queued, len(self._messages)):
                self._check(i)
        elif reading_head and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(
                431, f"the request's line and headers exceed {self.limits.max_header_bytes} bytes", "header_bytes"
            )

    def _check(self, i: int) -> None:
        """The framing of the i-th queued request: a transfer-coding other than chunked is refused; a
        protocol switch is answered, and the connection closed after it."""
        msg, _ = self._messages[i]
        if isinstance(msg, _ErrInfo):
            return
        codings = [c.strip() for v in msg.headers.getall("Transfer-Encoding", ()) for c in v.split(",") if c.strip()]
        unsupported = [c for c in codings if c.lower() != "chunked"]
        if unsupported:
            message = (
                f"Transfer-Encoding {unsupported[0]!r} is not supported: send the body with Content-Length, "
                "or with Transfer-Encoding: chunked alone"
            )
            self._messages[i] = (_ErrInfo(status=501, exc=BadHttpMessage(message), message=message), EMPTY_PAYLOAD)
            self._stop_parsing()  # its answer closes the connection: what follows it is never read
        elif msg.upgrade:
            self._messages[i] = (msg._replace(should_close=True), self._messages[i][1])

    def _refuse(self, status: int, message: str, reason: str) -> None:
        """Answer `status` once the requests before it are answered, then close; parse nothing more."""
        self._stop_parsing()
        self._server.refused(reason)
        self._messages.append((_ErrInfo(status=status, exc=BadHttpMessage(message), message=message), EMPTY_PAYLOAD))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _stop_parsing(self) -> None:
        self._refused = True
        self._disarm_header_deadline()

    # ---- the header deadline ----------------------------------------------------------------------

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self._loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timed_out(self) -> None:
        self._header_deadline = None
        if self._refused or self.transport is None:
            return
        if self._header_bytes == 0:  # a new connection that sent nothing: nothing to answer
            if self._request_count == 0:
                self._server.refused("header_timeout")
                self.force_close()
            return
        self._refuse(
            408, f"the request's headers did not arrive within {self.limits.header_timeout_s:g}s", "header_timeout"
        )

    # ---- errors -----------------------------------------------------------------------------------

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        """An OpenAI error object for what was refused or could not be parsed (a 500: aiohttp's own page,
        which logs the exception)."""
        if status == 500:
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:  # a response is under way: another cannot follow it (aiohttp's rule)
            raise ConnectionError("a response is under way: no error response can follow it")
        text = message or (str(exc) if exc is not None else "bad request")
        if status == 400:
            text = f"malformed HTTP request: {text}"
        response = error_response(status, _TYPE_BY_STATUS.get(status, "invalid_request_error"), text)
        response.force_close()
        return response


class ApiServer(Server):
    """aiohttp's server, making ApiConnections under `limits`, counting what they refuse."""

    limits: HttpLimits
    on_refused = None  # callable(reason): the api's metrics

    def configure(self, limits: HttpLimits, on_refused=None) -> None:
        self.limits = limits
        self.on_refused = on_refused
        self.trim = _Trim(self._loop)
        self.too_many_connections = _refusal(
            503,
            "Service Unavailable",
            f"this server has {limits.max_connections} connections open, its most; retry shortly",
            {"Retry-After": "1"},
        )
        self._refused_since_log = 0
        self._refused_logged_at = float("-inf")

    def __call__(self) -> RequestHandler:
        return ApiConnection(self, loop=self._loop, **self._kwargs)

    def refused(self, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)

    def refused_connection(self) -> None:
        """A connection past the cap; logged at most every REFUSED_LOG_INTERVAL_S (a flood is many)."""
        self.refused("connections")
        self._refused_since_log += 1
        now = self._loop.time()
        if now - self._refused_logged_at >= REFUSED_LOG_INTERVAL_S:
            log.warning(
                "connections_refused",
                refused=self._refused_since_log,
                open=len(self._connections),
                max_connections=self.limits.max_connections,
            )
            self._refused_since_log = 0
            self._refused_logged_at = now


def raise_fd_limit(max_connections: int) -> None:
    """Raise this process's soft limit of open files to hold `max_connections` (up to the hard limit);
    warn, naming the flag, when even the hard limit cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "fd_limit_low",
            open_files=soft,
            max_connections=max_connections,
            message=f"--max-connections {max_connections} needs about {want} open files but this process may "
            f"open {soft}: lower --max-connections or raise the limit (ulimit -n)",
        )
