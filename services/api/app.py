"""The api replica's aiohttp application and its lifecycle (on uvloop).

HTTP limits (docs/ARCHITECTURE.md §1, "Trust"): a body over --max-body-size is a 413; headers must
arrive within --read-timeout (aiohttp's keep-alive timer also closes a connection that has not sent a
whole request by then) and the body within as long again (408); a request aiohttp cannot parse is
answered with an OpenAI error object, not its plain-text page. On SIGTERM the replica drains: new
requests get a 503 with Retry-After, and those in flight have --drain-timeout to finish.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import time

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from ferry.shared.defaults import is_loopback
from ferry.shared.errors import ConfigError, ServiceUnavailable
from ferry.shared.wire_keys import WireKeys
from ferry.services.api.config import ApiConfig
from ferry.services.api.anthropic_routes import AnthropicRoutes
from ferry.services.api.http_errors import api_key_check, error_responses, error_response, _TYPE_BY_STATUS
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.responses_api import ResponsesRoutes
from ferry.services.api.routes import OpenAIRoutes
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer

log = structlog.get_logger("api")

DRAIN_RETRY_AFTER_S = 5


class Draining(ServiceUnavailable):
    retry_after = DRAIN_RETRY_AFTER_S


class Drain:
    """Requests in flight on /v1/*, and whether the replica still admits new ones."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

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
        """Stop admitting; True when every request in flight finished within `timeout`."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def body_timeout(seconds: float):
    """Reads a request's body within `seconds` (aiohttp keeps it: the handler's read() returns it)."""

    @web.middleware
    async def read_in_time(request: web.Request, handler):
        if request.body_exists:
            try:
                await asyncio.wait_for(request.read(), seconds)
            except asyncio.TimeoutError:
                response = error_response(408, "invalid_request_error",
                                          f"the request body did not arrive within {seconds:g}s", request)  # fmt: skip
                response.force_close()
                return response
        return await handler(request)

    return read_in_time


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what it cannot parse (a bad request line, broken
    headers or chunking) with an OpenAI error object instead of a plain-text page."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        text = message or (str(exc) if exc is not None else "bad request")
        response = error_response(status, _TYPE_BY_STATUS.get(status, "invalid_request_error"),
                                  f"malformed HTTP request: {text}")  # fmt: skip
        response.force_close()
        return response


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same state, our connection handler
        return server


def build_app(cfg: ApiConfig, tokenizer: PromptTokenizer, drain: Drain | None = None) -> web.Application:
    metrics = ApiMetrics(cfg.served_model_name)
    metrics.watch_segment_cache(tokenizer.segments)
    drain = drain or Drain()
    # error mapping outermost, so that auth failures, drain refusals and oversized or late bodies become
    # error objects too; the key is checked before a body is read
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[error_responses(metrics), api_key_check(cfg.api_key), drain.middleware(),
                                       body_timeout(cfg.read_timeout_s)])  # fmt: skip
    secure = WireKeys(cfg.wire_keys, "api").client() if cfg.wire_keys else None
    # token ids are checked for shape and sign only: a model's vocabulary may be larger than its tokenizer's
    client = SchedulerClient(cfg.scheduler_addr, cfg.identity, secure)
    openai_routes = OpenAIRoutes(cfg, client, tokenizer, metrics, drain)
    openai_routes.add_to(app)
    AnthropicRoutes(cfg, client, tokenizer, metrics, openai_routes._tokenize).add_to(app)
    ResponsesRoutes(cfg, client, tokenizer, metrics, openai_routes._tokenize).add_to(app)

    async def lifecycle(app: web.Application):
        await client.start()
        yield
        await client.close()

    app.cleanup_ctx.append(lifecycle)
    return app


async def serve(cfg: ApiConfig) -> None:
    tokenizer = PromptTokenizer(cfg.tokenizer)
    drain = Drain()
    app = build_app(cfg, tokenizer, drain)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    # keepalive_timeout: aiohttp closes a connection that has not sent a whole request within it (from
    # the connection's start, or since its last response), which bounds slow or incomplete headers.
    # lingering_time: how long aiohttp still reads an unread body after answering (a late body's 408)
    runner = _Runner(app, handler_cancellation=True, access_log=None, keepalive_timeout=cfg.read_timeout_s,
                     lingering_time=1.0, shutdown_timeout=1.0)  # fmt: skip
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
    except OSError as exc:
        await runner.cleanup()
        why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror})"
        raise ConfigError(f"--port {cfg.port} on {cfg.host} {why}: stop what listens there or choose another --port") from None
    log.info("api_listening", host=cfg.host, port=cfg.port, scheduler_addr=cfg.scheduler_addr,
             model=cfg.served_model_name, auth=cfg.api_key is not None, wire_keys=cfg.wire_keys is not None)  # fmt: skip
    if cfg.api_key is None and not is_loopback(cfg.host):
        log.warning("no_api_key", host=cfg.host,
                    message=f"listening on {cfg.host} without an API key: whoever reaches port {cfg.port} can use "
                            "the model; set FERRY_API_KEY or --api-key-file")  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    t0 = time.monotonic()
    log.info("api_draining", in_flight=drain.in_flight, drain_timeout_s=cfg.drain_timeout_s)
    drained = await drain.drain(cfg.drain_timeout_s)
    log.info("api_stopping", drained=drained, in_flight=drain.in_flight, waited_s=round(time.monotonic() - t0, 3))
    await runner.cleanup()


__all__ = ["build_app", "serve", "Drain"]
