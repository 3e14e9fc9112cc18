"""The OpenAI-compatible routes. Each request: validate -> tokenize -> Generation -> JSON or SSE."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web

import msgspec

from ferry.shared.errors import FerryError, InvalidRequest, NotFound
from ferry.shared.sampling import SamplingParams
from ferry.services.api import schema, structured
from ferry.services.api.config import ApiConfig
from ferry.services.api.generation import Generation
from ferry.services.api.logprobs import TokenText
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.output_parsers import OutputParser
from ferry.services.api.responses import (
    ChatChoice, ChatFormat, CompletionChoice, CompletionFormat, ResponseFormat, error_body, sse, total_usage,
)  # fmt: skip
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer

log = structlog.get_logger("api.routes")


class OpenAIRoutes:
    def __init__(self, cfg: ApiConfig, client: SchedulerClient, tokenizer: PromptTokenizer, metrics: ApiMetrics):
        self.cfg, self.client, self.tokenizer, self.metrics = cfg, client, tokenizer, metrics
        self.created = int(time.time())
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._token_text = TokenText(tokenizer.hf)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)

    # ---- generation ------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = schema.decode_body(await request.read(), schema.ChatCompletionRequest)
        max_tokens = schema.chat_max_tokens(req)
        self._check_model(req)
        schema.validate_generation(req, max_tokens)
        tools = schema.template_tools(req)
        forced = schema.forced_tools(req)
        # grammars are checked off the event loop, on the tokenizer thread: a large schema takes a while
        fmt_grammar = await self._tokenize(structured.response_format_grammar, req.response_format)
        if forced and fmt_grammar is not None:
            raise InvalidRequest("response_format: cannot be combined with tool_choice required or a named function")
        grammar = fmt_grammar
        if forced:
            grammar = await self._tokenize(lambda f: structured.tool_call_grammar(f, parallel=req.parallel_tool_calls is not False),
                                           forced)  # fmt: skip
        logprobs = schema.chat_logprobs(req)
        sampling = schema.sampling_params(req, self.tokenizer.eos_token_ids, self.tokenizer.vocab_size,
                                          logprobs=logprobs, grammar=grammar)  # fmt: skip
        messages = schema.chat_messages(req)
        kwargs = schema.template_kwargs(req, forced=grammar is not None)
        text = await self._tokenize(lambda a: self.tokenizer.chat_text(*a[:2], **a[2]), (messages, tools, kwargs))
        prompt = await self._tokenize(self.tokenizer.encode, text)
        fmt = ChatFormat(self.cfg.served_model_name)
        reasoning = self.cfg.reasoning_parser if req.separate_reasoning else "none"
        token_text = self._token_text if logprobs is not None else None
        schemas = schema.tool_schemas(req) if tools is not None else None
        choices = [ChatChoice(j, OutputParser(reasoning, self.cfg.tool_call_parser, schemas, prompt_text=text),
                              token_text, single_call=req.parallel_tool_calls is False) for j in range(req.n)]  # fmt: skip
        runs = [(prompt, _seeded(sampling, j)) for j in range(req.n)]
        return await self._generate(request, req, "chat", runs, max_tokens, fmt, choices)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = schema.decode_body(await request.read(), schema.CompletionRequest)
        self._check_model(req)
        schema.validate_generation(req, req.max_tokens, allow_zero=True)
        logprobs = schema.completion_logprobs(req)
        prompts = schema.completion_prompts(req)
        _check_choices(len(prompts) * req.n)
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens must be at least 1 (0 only scores the prompt, with echo), got 0")
        sampling = schema.sampling_params(req, self.tokenizer.eos_token_ids, self.tokenizer.vocab_size, logprobs=logprobs,
                                          prompt_logprobs=logprobs if req.echo else None)  # fmt: skip
        ids = [await self._tokenize(self.tokenizer.text_prompt, p) for p in prompts]
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
            raise NotFound(f"the model {req.model!r} does not exist here; this server serves {self.cfg.served_model_name!r}")

    async def _tokenize(self, fn, arg):
        """Off the event loop (a prompt near the body limit takes long enough to stall every stream),
        on one thread (a fast tokenizer is not meant to encode from several threads at once)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, arg)

    async def _generate(self, request: web.Request, req, route: str, runs: list, max_tokens: int | None,
                        fmt: ResponseFormat, choices: list) -> web.StreamResponse:  # fmt: skip
        """Run every choice's generation at once; one JSON body, or one SSE stream of all their chunks."""
        structlog.contextvars.bind_contextvars(request_id=fmt.id)
        stops = schema.stop_strings(req)
        gens = [Generation(self.client, self.tokenizer.hf, self.metrics, route, prompt, sampling, max_tokens, stops)
                for prompt, sampling in runs]  # fmt: skip
        if route == "completions":
            choices = [CompletionChoice(i, g, echo, tt) for i, (g, (echo, tt)) in enumerate(zip(gens, choices))]
        async with contextlib.AsyncExitStack() as stack:
            deltas = [await stack.enter_async_context(contextlib.aclosing(g.deltas())) for g in gens]
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
                async with contextlib.aclosing(_merged(deltas, firsts)) as merged:
                    async for i, d in merged:
                        if (choice := choices[i].apply(d)) is not None:
                            await response.write(sse(fmt.chunk(choice, with_usage)))
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
        return {"id": self.cfg.served_model_name, "object": "model", "created": self.created, "owned_by": "ferry",
                "max_model_len": status.max_model_len if status and status.ready else None}  # fmt: skip

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card (client.models.retrieve), else a 404."""
        model_id = request.match_info["model_id"]
        if model_id != self.cfg.served_model_name:
            raise NotFound(f"the model {model_id!r} does not exist here; this server serves {self.cfg.served_model_name!r}")
        return web.json_response(self._card())

    async def health(self, request: web.Request) -> web.Response:
        ready, reason = self.client.readiness()
        if ready:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)

    async def prometheus(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        self.metrics.refresh_from(self.client.status, self.client.readiness()[0])
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})



def _seeded(sampling: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: a request's seed s gives choice j the seed s + j, so seeded choices differ and repeat."""
    if j == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=sampling.seed + j)


def _check_choices(count: int) -> None:
    if count > schema.MAX_PROMPTS:
        raise InvalidRequest(f"n times the number of prompts is {count}: at most {schema.MAX_PROMPTS} choices per request")


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
