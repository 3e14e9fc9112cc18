"""The OpenAI-compatible routes. Each request: validate -> tokenize -> Generation -> JSON or SSE."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web

from ferry.shared.errors import FerryError, NotFound, ServiceUnavailable
from ferry.shared.sampling import SamplingParams
from ferry.services.api import schema
from ferry.services.api.config import ApiConfig
from ferry.services.api.generation import Generation
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.responses import ChatFormat, CompletionFormat, ResponseFormat, error_body, sse
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer, TooLong

log = structlog.get_logger("api.routes")

# Two tokenizer threads, each with its own tokenizer (a fast tokenizer is not meant to encode from
# several threads at once): bodies up to LONG_BODY_BYTES on one, larger ones on the other, so a short
# prompt never waits behind a long one. Each lane takes at most so many prompts waiting or running;
# more are refused with a 503 and Retry-After. With the character limit (PromptTokenizer.check_chars)
# this bounds the work and the memory queued behind the tokenizer.
LONG_BODY_BYTES = 256 * 1024
MAX_TOKENIZATIONS = {"short": 256, "long": 4}


class TokenizerBusy(ServiceUnavailable):
    retry_after = 1


class OpenAIRoutes:
    def __init__(self, cfg: ApiConfig, client: SchedulerClient, tokenizer: PromptTokenizer, metrics: ApiMetrics,
                 drain=None):  # fmt: skip
        self.cfg, self.client, self.tokenizer, self.metrics = cfg, client, tokenizer, metrics
        self.drain = drain
        self.created = int(time.time())
        self._lanes = {"short": (ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer"), tokenizer),
                       "long": (ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-long"), None)}  # fmt: skip
        self._tokenizations = {"short": 0, "long": 0}

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)

    # ---- generation ------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = schema.decode_body(await request.read(), schema.ChatCompletionRequest)
        max_tokens = schema.chat_max_tokens(req)
        sampling = self._check_common(req, max_tokens)
        messages = schema.chat_messages(req)
        self._check_chars(sum(len(m["content"]) for m in messages))
        prompt = await self._tokenize(PromptTokenizer.chat_prompt, messages, request.content_length)
        fmt = ChatFormat(self.cfg.served_model_name)
        return await self._generate(request, req, "chat", prompt, sampling, max_tokens, fmt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = schema.decode_body(await request.read(), schema.CompletionRequest)
        sampling = self._check_common(req, req.max_tokens)
        text = schema.completion_prompt(req)
        if isinstance(text, str):
            self._check_chars(len(text))
        prompt = await self._tokenize(PromptTokenizer.text_prompt, text, request.content_length)
        fmt = CompletionFormat(self.cfg.served_model_name)
        return await self._generate(request, req, "completions", prompt, sampling, req.max_tokens, fmt)

    def _check_chars(self, n: int) -> None:
        """On the event loop, before anything is queued for the tokenizer: a prompt too long in
        characters alone to fit the model length is refused at once."""
        self._update_model_len()
        try:
            self.tokenizer.check_chars(n)
        except TooLong:
            self.metrics.tokenize_refused.labels("too_long").inc()
            raise

    def _update_model_len(self) -> None:
        status = self.client.status
        if status is not None and status.ready and status.max_model_len:
            for _, tokenizer in self._lanes.values():
                if tokenizer is not None:
                    tokenizer.max_model_len = status.max_model_len

    async def _tokenize(self, fn, arg, body_bytes: int | None):
        """fn(tokenizer, arg) off the event loop (a prompt near the body limit takes long enough to stall
        every stream), in the lane of the body's size, at most MAX_TOKENIZATIONS[lane] prompts queued
        or running there (more: 503 with Retry-After)."""
        self._update_model_len()
        lane = "long" if (body_bytes or 0) > LONG_BODY_BYTES else "short"
        if self._tokenizations[lane] >= MAX_TOKENIZATIONS[lane]:
            self.metrics.tokenize_refused.labels("busy").inc()
            raise TokenizerBusy(f"{self._tokenizations[lane]} prompts are waiting for the tokenizer; retry shortly")
        thread, tokenizer = self._lanes[lane]
        if tokenizer is None:  # the long lane's own copy, made on first use
            tokenizer = self.tokenizer.copy()
            self._lanes[lane] = (thread, tokenizer)
        self._tokenizations[lane] += 1
        self.metrics.tokenizing.inc()
        t0 = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(thread, fn, tokenizer, arg)
        except TooLong:
            self.metrics.tokenize_refused.labels("too_long").inc()
            raise
        finally:
            self._tokenizations[lane] -= 1
            self.metrics.tokenizing.dec()
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)

    def _check_common(self, req, max_tokens: int | None) -> SamplingParams:
        """Everything about the body that can be refused before tokenizing; the request's sampling."""
        if req.model is not None and req.model != self.cfg.served_model_name:
            raise NotFound(f"the model {req.model!r} does not exist here; this server serves {self.cfg.served_model_name!r}")
        schema.validate_generation(req, max_tokens)
        return schema.sampling_params(req, self.tokenizer.eos_token_ids)

    async def _generate(self, request: web.Request, req, route: str, prompt: list[int], sampling: SamplingParams,
                        max_tokens: int | None, fmt: ResponseFormat) -> web.StreamResponse:  # fmt: skip
        structlog.contextvars.bind_contextvars(request_id=fmt.id)
        gen = Generation(self.client, self.tokenizer.hf, self.metrics, route, prompt, sampling, max_tokens,
                         schema.stop_strings(req))  # fmt: skip
        async with contextlib.aclosing(gen.deltas()) as deltas:
            if not req.stream:
                parts, reason = [], None
                async for d in deltas:
                    parts.append(d.text)
                    reason = d.finish_reason
                return web.json_response(fmt.full("".join(parts), reason, gen.usage))
            with_usage = bool(req.stream_options and req.stream_options.include_usage)
            first = await anext(deltas)  # a rejection raises here, before any header: a plain 4xx/5xx
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                for chunk in fmt.opening_chunks(with_usage):
                    await response.write(sse(chunk))
                d = first
                while True:
                    if d.text or d.finish_reason:
                        await response.write(sse(fmt.chunk(d.text, d.finish_reason, with_usage)))
                    if d.finish_reason:
                        break
                    d = await anext(deltas)
                if with_usage:
                    await response.write(sse(fmt.usage_chunk(gen.usage)))
                await response.write(sse("[DONE]"))
            except FerryError as exc:  # lost mid-stream: headers are gone, so the error travels as an event
                await response.write(sse(error_body(exc.http_status, exc.error_type, str(exc))))
            except ConnectionResetError:
                log.info("client_disconnected")  # leaving the `async with` aborts the request
            return response

    # ---- info --------------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        status = self.client.status
        card = {"id": self.cfg.served_model_name, "object": "model", "created": self.created, "owned_by": "ferry",
                "max_model_len": status.max_model_len if status and status.ready else None}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        ready, reason = self.client.readiness()
        if self.drain is not None and self.drain.draining:
            ready, reason = False, f"draining: {self.drain.in_flight} requests in flight, no new ones admitted"
        status = self.client.status
        peers = {"scheduler": "ready" if self.client.scheduler.alive() else "silent",
                 "worker": "ready" if status is not None and status.ready else "not ready"}  # fmt: skip
        if ready:
            return web.json_response({"status": "ready", "peers": peers})
        return web.json_response({"status": "unavailable", "reason": reason, "peers": peers}, status=503)

    async def prometheus(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        self.metrics.refresh_from(self.client.status, self.client.readiness()[0])
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

