"""The api replica's aiohttp application and its lifecycle (on uvloop)."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from ferry.services.api.config import ApiConfig
from ferry.services.api.anthropic_routes import AnthropicRoutes
from ferry.services.api.http_errors import api_key_check, error_responses
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.routes import OpenAIRoutes
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer

log = structlog.get_logger("api")


def build_app(cfg: ApiConfig, tokenizer: PromptTokenizer) -> web.Application:
    metrics = ApiMetrics(cfg.served_model_name)
    # error mapping outermost, so that auth failures and oversized bodies become error objects too
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[error_responses(metrics), api_key_check(cfg.api_key)])  # fmt: skip
    client = SchedulerClient(cfg.scheduler_addr, cfg.identity)
    openai_routes = OpenAIRoutes(cfg, client, tokenizer, metrics)
    openai_routes.add_to(app)
    AnthropicRoutes(cfg, client, tokenizer, metrics, openai_routes._tokenize).add_to(app)

    async def lifecycle(app: web.Application):
        await client.start()
        yield
        await client.close()

    app.cleanup_ctx.append(lifecycle)
    return app


async def serve(cfg: ApiConfig) -> None:
    tokenizer = PromptTokenizer(cfg.tokenizer)
    app = build_app(cfg, tokenizer)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    log.info("api_listening", host=cfg.host, port=cfg.port, scheduler_addr=cfg.scheduler_addr,
             model=cfg.served_model_name, auth=cfg.api_key is not None)  # fmt: skip
    if cfg.api_key is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no_api_key", host=cfg.host,
                    message=f"listening on {cfg.host} without an API key: whoever reaches port {cfg.port} can use "
                            "the model; set FERRY_API_KEY or --api-key-file")  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("api_stopping")
    await runner.cleanup()
