"""The OpenAI-compatible routes. Each request: validate -> tokenize -> Generation -> JSON or SSE."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import structlog
from aiohttp import web

from ferry.services.api import schema, structured
from ferry.services.api.body_decoding import BodyDecoder
from ferry.services.api.chat_prompt import ChatPrompt
from ferry.services.api.config import ApiConfig
from ferry.services.api.generation import Generation
from ferry.services.api.grammar_lanes import GrammarLanes, response_format_schemas, tool_schemas
from ferry.services.api.logprobs import TokenText
from ferry.services.api.metrics import ApiMetrics, mark_counted_by_generations
from ferry.services.api.responses import (
    ChatChoice,
    ChatFormat,
    CompletionChoice,
    CompletionFormat,
    ResponseFormat,
    error_body,
    sse,
    total_usage,
)
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer, TooLong
from ferry.shared.errors import FerryError, InvalidRequest, NotFound, ServiceUnavailable
from ferry.shared.sampling import SamplingParams
from ferry.shared.step_trace import StepTrace

log = structlog.get_logger("api.routes")

# Two tokenizer threads, each with its own tokenizer (a fast tokenizer is not meant to encode from
# several threads at once): bodies up to LONG_BODY_BYTES on one, larger ones on the other, so a short
# prompt never waits behind a long one. Grammars (response_format, a forced tool call) are built on
# lanes of their own (grammar_lanes.py), so no prompt waits behind a schema. Each lane takes at most so
# many jobs waiting or running; more are refused with a 503 and Retry-After. With the character limit
# (PromptTokenizer.check_chars) this bounds the work and the memory queued behind the threads.
LONG_BODY_BYTES = 256 * 1024
MAX_TOKENIZATIONS = {"short": 256, "long": 4}


class TokenizerBusy(ServiceUnavailable):
    retry_after = 1


class OpenAIRoutes:
    def __init__(
        self, cfg: ApiConfig, client: SchedulerClient, tokenizer: PromptTokenizer, metrics: ApiMetrics, drain=None
    ):
        self.cfg, self.client, self.tokenizer, self.metrics = cfg, client, tokenizer, metrics
        self.drain = drain
        self.created = int(time.time())
        self._lanes = {
            "short": (ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer"), tokenizer),
            "long": (ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-long"), None),
        }
        self.grammars = GrammarLanes(metrics)
        self.bodies = BodyDecoder()
        self._tokenizations = {lane: 0 for lane in self._lanes}
        self._token_text = TokenText(tokenizer.hf)
        # FERRY_STEP_TRACE: when each request reached its handler, left its tokenizer lane, wrote its first chunk
        # (bench/ttft_path.py; the scheduler client writes its Submit and first token to the same file)
        self.trace = StepTrace("api")

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)

    # ---- generation ------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.trace.add(handler=time.monotonic(), route="chat")
        body = await request.read()
        req = await self.bodies.decode(body, schema.ChatCompletionRequest)
        max_tokens = schema.chat_max_tokens(req)
        self._check_model(req)
        schema.validate_generation(req, max_tokens)
        tools = schema.template_tools(req)
        forced = schema.forced_tools(req)
        size = len(body)  # the body read, not its Content-Length header: a chunked upload sends none
        if forced and req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequest(
                "response_format: cannot be combined with tool_choice required or a named function",
                param="response_format",
            )
        # grammars are built and checked off the event loop, on the lane of their schemas' size (a large
        # schema takes a while), once per request: its n choices share the one grammar
        grammar = None
        if req.response_format is not None and req.response_format.type != "text":
            grammar = await self.grammars.build(
                structured.response_format_grammar,
                req.response_format,
                response_format_schemas(req.response_format),
                "response_format",
            )
        if forced:
            grammar = await self.grammars.build(
                _tool_call_grammar,
                (self.tokenizer, self.cfg.tool_call_parser, forced, req.parallel_tool_calls is not False),
                tool_schemas(forced, TOOL_FIELD),
                "tools",
            )
        logprobs = schema.chat_logprobs(req)
        sampling = schema.sampling_params(
            req, self.tokenizer.eos_token_ids, self.tokenizer.vocab_size, logprobs=logprobs, grammar=grammar
        )
        messages = schema.chat_messages(req)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        kwargs = schema.template_kwargs(req, forced=grammar is not None)
        chat = await self._tokenize(_chat_prompt, (messages, tools, kwargs), size)
        prompt = chat.ids
        fmt = ChatFormat(self.cfg.served_model_name)
        reasoning = self.cfg.reasoning_parser if req.separate_reasoning else "none"
        token_text = self._token_text if logprobs is not None else None
        schemas = schema.tool_schemas(req) if tools is not None else None
        choices = [
            ChatChoice(
                j,
                self.tokenizer.output_parser(reasoning, self.cfg.tool_call_parser, schemas, chat, bool(forced)),
                token_text,
                single_call=req.parallel_tool_calls is False,
            )
            for j in range(req.n)
        ]
        runs = [(prompt, _seeded(sampling, j)) for j in range(req.n)]
        return await self._generate(request, req, "chat", runs, max_tokens, fmt, choices)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.trace.add(handler=time.monotonic(), route="completions")
        body = await request.read()
        req = await self.bodies.decode(body, schema.CompletionRequest)
        self._check_model(req)
        schema.validate_generation(req, req.max_tokens, allow_zero=True)
        logprobs = schema.completion_logprobs(req)
        prompts = schema.completion_prompts(req)
        _check_choices(len(prompts) * req.n)
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest(
                "max_tokens must be at least 1 (0 only scores the prompt, with echo), got 0", param="max_tokens"
            )
        sampling = schema.sampling_params(
            req,
            self.tokenizer.eos_token_ids,
            self.tokenizer.vocab_size,
            logprobs=logprobs,
            prompt_logprobs=logprobs if req.echo else None,
        )
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            self._check_chars(max(len(t) for t in texts), "prompt")
        # the raw prompt is the client's own whole prompt: special-token text in it is that token (as in vLLM, OpenAI)
        ids = [await self._tokenize(PromptTokenizer.text_prompt, p, len(body)) for p in prompts]
        fmt = CompletionFormat(self.cfg.served_model_name)
        token_text = self._token_text if logprobs is not None else None
        runs, choices = [], []
        for i, (p, prompt_ids) in enumerate(zip(prompts, ids)):
            echo = (p if isinstance(p, str) else self.tokenizer.hf.decode(p)) if req.echo else None
            for j in range(req.n):
                runs.append((prompt_ids, _seeded(sampling, j)))
                choices.append((echo, token_text))
        return await self._generate(request, req, "completions", runs, req.max_tokens, fmt, choices)

    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.cfg.served_model_name:
            raise NotFound(
                f"the model {req.model!r} does not exist here; this server serves {self.cfg.served_model_name!r}",
                param="model",
            )

    def _check_chars(self, n: int, field: str) -> None:
        """On the event loop, before anything is queued for the tokenizer: a prompt too long in
        characters alone to fit the model length is refused at once (naming `field`)."""
        self._update_model_len()
        try:
            self.tokenizer.check_chars(n)
        except TooLong as exc:
            self.metrics.tokenize_refused.labels("too_long").inc()
            exc.param = field
            raise

    def _update_model_len(self) -> None:
        status = self.client.status
        if status is not None and status.ready and status.max_model_len:
            for _, tokenizer in self._lanes.values():
                if tokenizer is not None:
                    tokenizer.max_model_len = status.max_model_len

    async def _tokenize(self, fn, arg, body_bytes: int):
        """fn(tokenizer, arg) off the event loop (a prompt near the body limit takes long enough to stall
        every stream), in the lane of the body's size, at most MAX_TOKENIZATIONS[lane] jobs queued or
        running there (more: 503 with Retry-After)."""
        self._update_model_len()
        lane = "long" if body_bytes > LONG_BODY_BYTES else "short"
        if self._tokenizations[lane] >= MAX_TOKENIZATIONS[lane]:
            self.metrics.tokenize_refused.labels("busy").inc()
            raise TokenizerBusy(f"{self._tokenizations[lane]} prompts are waiting for the tokenizer; retry shortly")
        thread = self._lanes[lane][0]
        self._tokenizations[lane] += 1
        self.metrics.tokenizing.inc()
        t0 = time.perf_counter()
        queued = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(thread, self._in_lane, lane, fn, arg)
        except TooLong:
            self.metrics.tokenize_refused.labels("too_long").inc()
            raise
        finally:
            self._tokenizations[lane] -= 1
            self.metrics.tokenizing.dec()
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
            self.trace.add(tokenize=queued, tokenized=time.monotonic(), lane=lane)

    def _in_lane(self, lane: str, fn, arg):
        """fn(tokenizer, arg) on the lane's own thread. The long lane makes its copy of the tokenizer
        here, on first use: for a large vocabulary that takes a while, which would stall every
        stream on the event loop (the lane has one thread, so it is made once)."""
        thread, tokenizer = self._lanes[lane]
        if tokenizer is None:
            tokenizer = self.tokenizer.copy()
            self._lanes[lane] = (thread, tokenizer)
        return fn(tokenizer, arg)

    async def _generate(
        self,
        request: web.Request,
        req,
        route: str,
        runs: list,
        max_tokens: int | None,
        fmt: ResponseFormat,
        choices: list,
    ) -> web.StreamResponse:
        """Run every choice's generation at once; one JSON body, or one SSE stream of all their chunks."""
        structlog.contextvars.bind_contextvars(request_id=fmt.id)
        stops = schema.stop_strings(req)
        fields = schema.submit_fields(req)
        # a chat choice's parser may be where its text comes from (harmony_format.py); completions read the tokenizer's
        sources = [c.parser.text_source() if isinstance(c, ChatChoice) else None for c in choices]
        gens = [
            Generation(
                self.client, self.tokenizer.hf, self.metrics, route, prompt, sampling, max_tokens, stops, fields, text
            )
            for (prompt, sampling), text in zip(runs, sources)
        ]
        if route == "completions":
            choices = [CompletionChoice(i, g, echo, tt) for i, (g, (echo, tt)) in enumerate(zip(gens, choices))]
        async with contextlib.AsyncExitStack() as stack:
            deltas = [await stack.enter_async_context(contextlib.aclosing(g.deltas())) for g in gens]
            mark_counted_by_generations(request)  # each generation starts below, and counts itself
            if not req.stream:
                await _all(*(_drain(d, c) for d, c in zip(deltas, choices)))
                return web.json_response(fmt.full([c.full() for c in choices], total_usage(gens)))
            with_usage = bool(req.stream_options and req.stream_options.include_usage)
            firsts = await _all(*(anext(d) for d in deltas))  # a rejection raises here, before any header
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                for c in choices:
                    if hasattr(c, "opening"):
                        await response.write(sse(fmt.chunk(c.opening(), with_usage)))
                written = False
                async with contextlib.aclosing(_merged(deltas, firsts)) as merged:
                    async for i, d in merged:
                        if (choice := choices[i].apply(d)) is not None:
                            chunk = sse(fmt.chunk(choice, with_usage))
                            if not written:  # before the write: the client may read it before the write returns
                                self.trace.add(first_write=time.monotonic(), http=fmt.id)
                                written = True
                            await response.write(chunk)
                if with_usage:
                    await response.write(sse(fmt.usage_chunk(total_usage(gens))))
                await response.write(sse("[DONE]"))
            except FerryError as exc:  # lost mid-stream: headers are gone, so the error travels as an event
                await response.write(sse(error_body(exc.http_status, exc.error_type, str(exc))))
            except ConnectionResetError:
                log.info("client_disconnected")  # leaving the `async with` aborts the request
            return response

    # ---- info --------------------------------------------------------------------------------------

    def _card(self) -> dict:
        status = self.client.status
        return {
            "id": self.cfg.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "ferry",
            "max_model_len": status.max_model_len if status and status.ready else None,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card (client.models.retrieve), else a 404."""
        model_id = request.match_info["model_id"]
        if model_id != self.cfg.served_model_name:
            raise NotFound(
                f"the model {model_id!r} does not exist here; this server serves {self.cfg.served_model_name!r}"
            )
        return web.json_response(self._card())

    async def health(self, request: web.Request) -> web.Response:
        ready, reason = self.client.readiness()
        if self.drain is not None and self.drain.draining:
            ready, reason = False, f"draining: {self.drain.in_flight} requests in flight, no new ones admitted"
        status = self.client.status
        peers = {
            "scheduler": "ready" if self.client.scheduler.alive() else "silent",
            "worker": "ready" if status is not None and status.ready else "not ready",
        }
        if ready:
            return web.json_response({"status": "ready", "peers": peers})
        return web.json_response({"status": "unavailable", "reason": reason, "peers": peers}, status=503)

    async def prometheus(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        self.metrics.refresh_from(self.client.status, self.client.readiness()[0])
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# What the tokenizer lanes run: fn(tokenizer, arg) (OpenAIRoutes._tokenize)


def _chat_prompt(tokenizer: PromptTokenizer, arg) -> ChatPrompt:
    messages, tools, kwargs = arg
    return tokenizer.chat_prompt(messages, tools, **kwargs)


# What the grammar lanes run: fn(arg) (GrammarLanes.build)


TOOL_FIELD = "tools[{}].function.parameters"  # where a forced tool's schema is in the request


def _tool_call_grammar(arg) -> str:
    """A forced call in the markup of the model's tool-call parser (PromptTokenizer.tool_call_grammar)."""
    tokenizer, parser, forced, parallel = arg
    return tokenizer.tool_call_grammar(forced, parallel, TOOL_FIELD, parser)


def _seeded(sampling: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: a request's seed s gives choice j the seed s + j, so seeded choices differ and repeat."""
    if j == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + j)


def _check_choices(count: int) -> None:
    if count > schema.MAX_PROMPTS:
        raise InvalidRequest(
            f"n times the number of prompts is {count}: at most {schema.MAX_PROMPTS} choices per request", param="n"
        )


async def _all(*aws):
    """Await them all (none is left running); then raise the first error, if any."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def _drain(deltas, choice) -> None:
    async for d in deltas:
        choice.apply(d)


async def _merged(deltas: list, firsts: list):
    """(choice index, delta) from every choice's stream as they come, each until its last delta."""
    if len(deltas) == 1:  # one choice: straight through
        d = firsts[0]
        while True:
            yield 0, d
            if d.finish_reason:
                return
            d = await anext(deltas[0])
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, d) -> None:
        try:
            while True:
                await queue.put((i, d))
                if d.finish_reason:
                    return
                d = await anext(deltas[i])
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which sends it as an error event
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, d)) for i, d in enumerate(firsts)]
    try:
        left = len(deltas)
        while left:
            i, d = await queue.get()
            if isinstance(d, BaseException):
                raise d
            left -= bool(d.finish_reason)
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
