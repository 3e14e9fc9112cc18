"""The Anthropic Messages API: POST /v1/messages (streamed or not) and /v1/messages/count_tokens.

A request: validate -> render the conversation and its tools through the model's chat template ->
Generation (the same path as the OpenAI routes: scheduler, detokenizer, stop strings) -> the output
parser (reasoning, text, tool calls) -> a message, or its event stream. Authentication (x-api-key or
a bearer token) and the error shapes are the middlewares' (http_errors.py).

tool_choice any / tool (a forced call): as on the OpenAI route (tool_choice required / a named
function), a grammar holds the output to one or more `<tool_call>` blocks (one with
disable_parallel_tool_use) whose arguments match the tool's input_schema (structured.py), so even a
model that would not call writes a call that validates; they come back as tool_use blocks with
stop_reason tool_use. Otherwise (auto, or no tool_choice) the model's own `<tool_call>` markup is
parsed into tool_use blocks. output_config.format (structured outputs): as the OpenAI route's
response_format json_schema, a grammar holds the answer's text to the schema.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from aiohttp import web

from ferry.services.api import anthropic_schema as schema
from ferry.services.api import structured
from ferry.services.api.anthropic_responses import PING, MessageBuilder, error_body, sse_event
from ferry.services.api.body_decoding import BodyDecoder
from ferry.services.api.chat_prompt import ChatPrompt
from ferry.services.api.config import ApiConfig
from ferry.services.api.generation import Generation
from ferry.services.api.grammar_lanes import GrammarLanes, tool_schemas
from ferry.services.api.metrics import ApiMetrics, mark_counted_by_generations
from ferry.services.api.reasoning_parser import prompt_opens_reasoning
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer
from ferry.shared.errors import FerryError, NotFound

log = structlog.get_logger("api.anthropic")

PING_INTERVAL_S = 10.0  # a ping when no other event went out for this long (proxies close idle streams)


def forced_prompt_suffix(req: schema.CountTokensRequest, prompt_text: str) -> str:
    """What a forced call (tool_choice any / tool) or an output format adds to the prompt: the closing of
    a reasoning the template always opens (the grammar starts the answer at once, so the model cannot
    close it itself)."""
    return "</think>\n\n" if schema.constrained(req) and prompt_opens_reasoning(prompt_text) else ""


class AnthropicRoutes:
    def __init__(
        self,
        cfg: ApiConfig,
        client: SchedulerClient,
        tokenizer: PromptTokenizer,
        metrics: ApiMetrics,
        tokenize,
        grammars: GrammarLanes,
        bodies: BodyDecoder,
    ):
        """`tokenize(fn, arg, body_bytes)`: runs fn(tokenizer, arg) on a tokenizer thread (OpenAIRoutes._tokenize);
        `grammars` builds grammars and `bodies` decodes bodies: all three shared with the OpenAI routes."""
        self.cfg, self.client, self.tokenizer, self.metrics = cfg, client, tokenizer, metrics
        self._tokenize, self.grammars, self.bodies = tokenize, grammars, bodies

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    # ---- prompt ----------------------------------------------------------------------------------

    def _prompt(self, tokenizer: PromptTokenizer, req: schema.CountTokensRequest) -> ChatPrompt:
        """On a tokenizer thread, with that thread's tokenizer: render (messages, tools, template
        variables) and encode (client text as text: tokenizer.py's chat_prompt)."""
        messages = schema.template_messages(req)
        continue_final = messages[-1]["role"] == "assistant"  # a prefilled answer: the model continues it
        chat = tokenizer.render_chat(
            messages, tools=schema.template_tools(req), continue_final=continue_final, **schema.template_kwargs(req)
        )
        chat = chat.plus(forced_prompt_suffix(req, chat.text))
        return ChatPrompt(tokenizer.encode_chat(chat), chat.text)

    def _check_model(self, req: schema.CountTokensRequest) -> None:
        if req.model != self.cfg.served_model_name:
            raise NotFound(
                f"the model {req.model!r} does not exist here; this server serves {self.cfg.served_model_name!r}"
            )

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await request.read()
        req = await self.bodies.decode(body, schema.CountTokensRequest)
        self._check_model(req)
        schema.output_format(req)  # checked as on /v1/messages; its grammar adds no token to the prompt
        prompt = await self._tokenize(self._prompt, req, len(body))
        return web.json_response({"input_tokens": len(prompt.ids)})

    # ---- messages --------------------------------------------------------------------------------

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        req = await self.bodies.decode(body, schema.MessagesRequest)
        self._check_model(req)
        schema.validate(req)
        fmt = schema.output_format(req)
        prompt = await self._tokenize(self._prompt, req, len(body))  # checks the tools and tool_choice too
        grammar = None
        if (forced := schema.forced_tools(req)) is not None:  # built off the event loop, on the lane of its size
            grammar = await self.grammars.build(
                _tool_call_grammar,
                (self.tokenizer, self.cfg.tool_call_parser, forced, schema.parallel_calls(req)),
                tool_schemas(forced, TOOL_FIELD),
                "tools",
            )
        elif fmt is not None:
            json_schema, field = fmt
            grammar = await self.grammars.build(_output_format_grammar, fmt, [(field, json_schema)], field)
        builder = MessageBuilder(self.cfg.served_model_name, single_tool_call=not schema.parallel_calls(req))
        structlog.contextvars.bind_contextvars(request_id=builder.id)
        tools = schema.tool_schemas(req) if fmt is None else None  # an output format leaves no room for a call
        parser = self.tokenizer.output_parser(
            self.cfg.reasoning_parser, self.cfg.tool_call_parser, tools, prompt, forced is not None
        )
        gen = Generation(
            self.client,
            self.tokenizer.hf,
            self.metrics,
            "messages",
            prompt.ids,
            schema.sampling_params(req, self.tokenizer.eos_token_ids, grammar),
            req.max_tokens,
            list(req.stop_sequences or []),
            text=parser.text_source(),
        )
        headers = {"request-id": builder.id}
        async with contextlib.aclosing(gen.deltas()) as deltas:
            mark_counted_by_generations(request)  # it starts below, and counts itself
            if not req.stream:
                reason = None
                async for d in deltas:
                    builder.apply(parser.events(d))
                    reason = d.finish_reason
                return web.json_response(builder.message(reason, gen.stop_sequence, gen.usage), headers=headers)
            first = await anext(deltas)  # a rejection raises here, before any header: a plain 4xx/5xx
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
            )
            await response.prepare(request)
            try:
                await _write(response, builder.start(len(prompt.ids)))
                d = first
                while True:
                    await _write(response, builder.apply(parser.events(d)))
                    if d.finish_reason:
                        break
                    d = await _next_with_pings(deltas, response)
                await _write(response, builder.finish(d.finish_reason, gen.stop_sequence, gen.usage))
            except FerryError as exc:  # lost mid-stream: headers are gone, so the error travels as an event
                await response.write(sse_event(error_body(exc.http_status, str(exc))))
            except ConnectionResetError:
                pass  # the client left: leaving the `async with` aborts the request, and Generation logs it
            return response


TOOL_FIELD = "tools[{}].input_schema"  # where a forced tool's schema is in the request


def _tool_call_grammar(arg) -> str:
    """A forced call in the markup of the model's tool-call parser (PromptTokenizer.tool_call_grammar)."""
    tokenizer, parser, forced, parallel = arg
    return tokenizer.tool_call_grammar(forced, parallel, TOOL_FIELD, parser)


def _output_format_grammar(fmt: tuple[dict, str]) -> str:
    json_schema, field = fmt
    return structured.json_schema_grammar(json_schema, field)


async def _write(response: web.StreamResponse, events: list[dict]) -> None:
    if events:
        await response.write(b"".join(sse_event(e) for e in events))


async def _next_with_pings(deltas, response: web.StreamResponse):
    """The next delta; a ping goes out every PING_INTERVAL_S while none comes (a queued or preempted
    request). If the handler is cancelled (the client left), the pending step is cancelled too and
    awaited, so the generator has run its cleanup (abort, log) before it is closed."""
    step = asyncio.ensure_future(anext(deltas))
    try:
        while True:
            done, _ = await asyncio.wait({step}, timeout=PING_INTERVAL_S)
            if done:
                return step.result()
            await response.write(sse_event(PING))
    finally:
        if not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
