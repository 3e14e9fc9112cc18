"""The api replica's aiohttp application and its lifecycle (on uvloop).

HTTP limits (docs/ARCHITECTURE.md §1, "Trust"; README, "HTTP limits"): a body over --max-body-size is a
413 (at once when its Content-Length says so) and must arrive within --read-timeout (408); what limits a
connection and a request's headers (their size, their time, the connections open, the framing) is
connection.py's. On SIGTERM the replica drains: new requests get a 503 with Retry-After, and those in
flight have --drain-timeout to finish; any still running then ends in an error event (a stream) or a
503, and is aborted at the scheduler.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import time
from collections.abc import Callable

import structlog
from aiohttp import web
from aiohttp.web_server import Server

from ferry.services.api.anthropic_routes import AnthropicRoutes
from ferry.services.api.config import ApiConfig
from ferry.services.api.connection import ApiServer, HttpLimits, raise_fd_limit
from ferry.services.api.http_errors import api_key_check, error_response, error_responses
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.responses_api import ResponsesRoutes
from ferry.services.api.routes import OpenAIRoutes
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer
from ferry.shared.defaults import is_loopback
from ferry.shared.errors import ConfigError, FerryError, ServiceUnavailable
from ferry.shared.startup_heap import freeze_startup_heap
from ferry.shared.wire_keys import WireKeys

log = structlog.get_logger("api")

METRICS_KEY = web.AppKey("ferry_api_metrics", ApiMetrics)

DRAIN_RETRY_AFTER_S = 5
DRAIN_GRACE_S = 3.0  # after the drain timeout: for the stopped requests to send their error and end


class Draining(ServiceUnavailable):
    retry_after = DRAIN_RETRY_AFTER_S


class DrainTimedOut(ServiceUnavailable):
    """A request still running when the drain timeout passed: stopped, and answered with this."""

    retry_after = DRAIN_RETRY_AFTER_S


class Drain:
    """Requests in flight on /v1/*, and whether the replica still admits new ones."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # ends every request in flight with the error given, aborting each at the scheduler (build_app
        # sets it: SchedulerClient.stop_all)
        self.stop_in_flight: Callable[[FerryError], None] | None = None

    def middleware(self):
        @web.middleware
        async def gate(request: web.Request, handler):
            if not request.path.startswith("/v1/"):
                return await handler(request)
            if self.draining:
                raise Draining("this server is shutting down and admits no new requests; retry on another replica")
            self.in_flight += 1
            self._idle.clear()
            try:
                return await handler(request)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._idle.set()

        return gate

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; True when every request in flight finished within `timeout`. Those still
        running then are stopped, each with an error its client reads (a stream's last event, or a 503),
        aborted at the scheduler and counted failed; they have DRAIN_GRACE_S to send it."""
        self.draining = True
        if await self._idle_within(timeout):
            return True
        if self.stop_in_flight is not None:
            log.warning("api_drain_timed_out", in_flight=self.in_flight, drain_timeout_s=timeout)
            self.stop_in_flight(
                DrainTimedOut(
                    f"this server is shutting down and stopped the request: it did "
                    f"not finish within the {timeout:g}s drain timeout; retry on another "
                    "replica"
                )
            )
            await self._idle_within(DRAIN_GRACE_S)
        return False

    async def _idle_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False


def body_limits(max_bytes: int, seconds: float):
    """A body declared larger than `max_bytes` (Content-Length) is a 413 at once, unread; one sent in
    chunks is refused once it passes the limit (aiohttp's read). Else the body must arrive within
    `seconds` (408); aiohttp keeps it: the handler's read() returns it."""

    @web.middleware
    async def within_limits(request: web.Request, handler):
        declared = request.content_length
        if declared is not None and declared > max_bytes:
            response = error_response(
                413,
                "invalid_request_error",
                f"the request body is {declared} bytes (its Content-Length); at most {max_bytes} are accepted",
                request,
            )
            response.force_close()
            return response
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), seconds)
            except asyncio.TimeoutError:
                response = error_response(
                    408, "invalid_request_error", f"the request body did not arrive within {seconds:g}s", request
                )
                response.force_close()
                return response
        return await handler(request)

    return within_limits


class _Runner(web.AppRunner):
    """aiohttp's runner, whose server makes the api's connections (connection.py) under `limits`."""

    def __init__(self, app: web.Application, limits: HttpLimits, on_refused, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._limits, self._on_refused = limits, on_refused

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = ApiServer  # same state, our connections
        server.configure(self._limits, self._on_refused)
        return server


def build_app(cfg: ApiConfig, tokenizer: PromptTokenizer, drain: Drain | None = None) -> web.Application:
    metrics = ApiMetrics(cfg.served_model_name)
    metrics.watch_segment_cache(tokenizer.segments)
    drain = drain or Drain()
    # error mapping outermost, so that auth failures, drain refusals and oversized or late bodies become
    # error objects too; the key is checked before a body is read
    app = web.Application(
        client_max_size=cfg.max_body_bytes,
        middlewares=[
            error_responses(metrics),
            api_key_check(cfg.api_key),
            drain.middleware(),
            body_limits(cfg.max_body_bytes, cfg.read_timeout_s),
        ],
    )
    secure = WireKeys(cfg.wire_keys, "api").client() if cfg.wire_keys else None
    # token ids are checked for shape and sign only: a model's vocabulary may be larger than its tokenizer's
    client = SchedulerClient(cfg.scheduler_addr, cfg.identity, secure)
    drain.stop_in_flight = client.stop_all
    app[METRICS_KEY] = metrics
    openai_routes = OpenAIRoutes(cfg, client, tokenizer, metrics, drain)
    openai_routes.add_to(app)
    AnthropicRoutes(
        cfg, client, tokenizer, metrics, openai_routes._tokenize, openai_routes.grammars, openai_routes.bodies
    ).add_to(app)
    ResponsesRoutes(
        cfg, client, tokenizer, metrics, openai_routes._tokenize, openai_routes.grammars, openai_routes.bodies
    ).add_to(app)

    async def lifecycle(app: web.Application):
        await client.start()
        yield
        await client.close()
        openai_routes.trace.flush()

    app.cleanup_ctx.append(lifecycle)
    return app


async def serve(cfg: ApiConfig) -> None:
    tokenizer = PromptTokenizer(cfg.tokenizer, cfg.chat_format, cfg.tool_call_parser, cfg.reasoning_parser)
    drain = Drain()
    app = build_app(cfg, tokenizer, drain)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    # keepalive_timeout: aiohttp closes a connection idle this long between requests (a request's own
    # headers have --header-timeout: connection.py).
    # lingering_time: how long aiohttp still reads an unread body after answering (a late body's 408)
    metrics = app[METRICS_KEY]
    limits = HttpLimits(cfg.max_header_bytes, cfg.max_connections, cfg.header_timeout_s)
    raise_fd_limit(cfg.max_connections)
    runner = _Runner(
        app,
        limits,
        lambda reason: metrics.http_refused.labels(reason).inc(),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=cfg.read_timeout_s,
        lingering_time=1.0,
        shutdown_timeout=1.0,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
    except OSError as exc:
        await runner.cleanup()
        why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror})"
        raise ConfigError(
            f"--port {cfg.port} on {cfg.host} {why}: stop what listens there or choose another --port"
        ) from None
    log.info(
        "api_listening",
        host=cfg.host,
        port=cfg.port,
        scheduler_addr=cfg.scheduler_addr,
        model=cfg.served_model_name,
        auth=cfg.api_key is not None,
        wire_keys=cfg.wire_keys is not None,
    )
    if cfg.api_key is None and not is_loopback(cfg.host):
        log.warning(
            "no_api_key",
            host=cfg.host,
            message=f"listening on {cfg.host} without an API key: whoever reaches port {cfg.port} can use "
            "the model; set FERRY_API_KEY or --api-key-file",
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap()  # the tokenizer and the modules stay out of every full collection (shared/startup_heap.py)
    await stop.wait()
    t0 = time.monotonic()
    log.info("api_draining", in_flight=drain.in_flight, drain_timeout_s=cfg.drain_timeout_s)
    drained = await drain.drain(cfg.drain_timeout_s)
    log.info("api_stopping", drained=drained, in_flight=drain.in_flight, waited_s=round(time.monotonic() - t0, 3))
    await runner.cleanup()


__all__ = ["build_app", "serve", "Drain"]
