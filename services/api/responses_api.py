"""The OpenAI Responses API: POST /v1/responses (streamed or not), GET and DELETE /v1/responses/{id}.

A request: validate -> the conversation (the stored turns of previous_response_id, then `input`)
rendered with `instructions` and the tools through the model's chat template -> Generation (the
same path as the chat route: scheduler, detokenizer) -> the output parser (reasoning, text, tool
calls) -> a response object, or its event stream (responses_output.py). A finished response is
kept in the replica's bounded store (responses_store.py) unless `store: false`, so the next
request can continue it by previous_response_id; its `instructions` are not carried over (OpenAI's
rule: each request sends its own).

tool_choice required / a function and text.format json_schema / json_object are grammars, as on the
chat route (structured.py): built off the event loop on the grammar lane of their size (grammar_lanes.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import structlog
from aiohttp import web

from ferry.services.api import responses_schema as schema
from ferry.services.api import structured
from ferry.services.api.anthropic_responses import sse_event
from ferry.services.api.body_decoding import BodyDecoder
from ferry.services.api.config import ApiConfig
from ferry.services.api.generation import Generation
from ferry.services.api.grammar_lanes import GrammarLanes, tool_schemas
from ferry.services.api.metrics import ApiMetrics, mark_counted_by_generations
from ferry.services.api.reasoning_parser import prompt_opens_reasoning
from ferry.services.api.responses_output import ResponseBuilder
from ferry.services.api.responses_store import ResponseStore
from ferry.services.api.scheduler_client import SchedulerClient
from ferry.services.api.tokenizer import PromptTokenizer
from ferry.shared.errors import FerryError, InvalidRequest, NotFound

log = structlog.get_logger("api.responses")


@dataclass
class Prompt:
    ids: list[int]
    text: str


class ResponsesRoutes:
    def __init__(
        self,
        cfg: ApiConfig,
        client: SchedulerClient,
        tokenizer: PromptTokenizer,
        metrics: ApiMetrics,
        tokenize,
        grammars: GrammarLanes,
        bodies: BodyDecoder,
        store: ResponseStore | None = None,
    ):
        """`tokenize(fn, arg, body_bytes)`: runs fn(tokenizer, arg) on a tokenizer thread (OpenAIRoutes._tokenize);
        `grammars` builds grammars and `bodies` decodes bodies: all three shared with the other routes."""
        self.cfg, self.client, self.tokenizer, self.metrics = cfg, client, tokenizer, metrics
        self._tokenize, self.grammars, self.bodies = tokenize, grammars, bodies
        self.store = store if store is not None else ResponseStore()

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    # ---- stored responses ------------------------------------------------------------------------

    def _stored(self, response_id: str, param: str | None):
        stored = self.store.get(response_id)
        if stored is None:
            raise NotFound(
                f"no response {response_id!r} is kept here: it was never stored (store: false), was "
                f"dropped to bound the store (the least recently used go first), or another api "
                f"replica answered it; send the whole conversation as input instead",
                param=param,
            )
        return stored

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self._stored(request.match_info["response_id"], None).response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        self._stored(response_id, None)
        self.store.pop(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    # ---- create ----------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        req = await self.bodies.decode(body, schema.ResponsesRequest)
        if req.model is not None and req.model != self.cfg.served_model_name:
            raise NotFound(
                f"the model {req.model!r} does not exist here; this server serves {self.cfg.served_model_name!r}",
                param="model",
            )
        schema.validate(req)
        earlier = (
            self._stored(req.previous_response_id, "previous_response_id").conversation
            if req.previous_response_id is not None
            else []
        )
        items = earlier + schema.input_items(req)
        messages = schema.template_messages(req.instructions, items, first=len(earlier))
        tools = schema.template_tools(req)
        forced = schema.forced_tools(req)
        json_schema = schema.text_format_schema(req)
        if forced and json_schema is not None:
            raise InvalidRequest(
                "text.format: cannot be combined with tool_choice required or a function", param="text.format"
            )
        grammar = None  # built off the event loop, on the lane of its size: a large schema takes a while
        if forced:
            grammar = await self.grammars.build(
                _tool_call_grammar,
                (self.tokenizer, self.cfg.tool_call_parser, forced, schema.parallel_calls(req)),
                tool_schemas(forced, TOOL_FIELD),
                "tools",
            )
        elif json_schema is not None:
            grammar = await self.grammars.build(
                _text_format_grammar, json_schema, [(FORMAT_FIELD, json_schema)], "text.format"
            )
        sampling = schema.sampling_params(req, self.tokenizer.eos_token_ids, grammar)
        kwargs = schema.template_kwargs(req, constrained=grammar is not None)
        # the tokenizer lane goes by the prompt's size: a short body may continue a long stored conversation
        size = max(len(body), sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages))
        prompt = await self._tokenize(_prompt, (messages, tools, kwargs, grammar is not None), size)
        echo = self._echo(req, sampling)
        builder = ResponseBuilder(
            echo,
            max_calls=None if schema.parallel_calls(req) else 1,
            encrypted_reasoning=schema.ENCRYPTED_REASONING in (req.include or ()),
        )
        structlog.contextvars.bind_contextvars(request_id=builder.id)
        parser = self.tokenizer.output_parser(
            self.cfg.reasoning_parser, self.cfg.tool_call_parser, schema.tool_schemas(req), prompt, forced is not None
        )
        gen = Generation(
            self.client,
            self.tokenizer.hf,
            self.metrics,
            "responses",
            prompt.ids,
            sampling,
            req.max_output_tokens,
            [],
            fields=schema.SUBMIT_FIELDS,
            text=parser.text_source(),
        )
        async with contextlib.aclosing(gen.deltas()) as deltas:
            mark_counted_by_generations(request)  # it starts below, and counts itself
            if not req.stream:
                async for d in deltas:
                    _apply(builder, parser, d)
                    if d.finish_reason:
                        builder.finish(d.finish_reason, gen.usage)
                self._keep(req, items, builder)
                return web.json_response(builder.final)
            first = await anext(deltas)  # a rejection raises here, before any header: a plain 4xx/5xx
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await _write(response, builder.start())
                d = first
                while True:
                    await _write(response, _apply(builder, parser, d))
                    if d.finish_reason:
                        break
                    d = await anext(deltas)
                await _write(response, builder.finish(d.finish_reason, gen.usage))
                self._keep(req, items, builder)
            except FerryError as exc:  # lost mid-stream: headers are gone, so the error travels as an event
                await _write(response, builder.failed(exc))
            except ConnectionResetError:
                pass  # the client left: leaving the `async with` aborts the request, and Generation logs it
            return response

    def _keep(self, req: schema.ResponsesRequest, items: list[schema.InputItem], builder: ResponseBuilder) -> None:
        """Store the finished response with its conversation (unless store: false)."""
        if req.store is False:
            return
        if not self.store.put(builder.final, items + schema.output_items(builder.final["output"])):
            log.info("response_not_stored", reason="larger than the store", max_bytes=self.store.max_bytes)

    def _echo(self, req: schema.ResponsesRequest, sampling) -> dict:
        """The request's settings as the response object repeats them."""
        effort = req.reasoning.effort if req.reasoning is not None else None
        summary = (req.reasoning.summary or req.reasoning.generate_summary) if req.reasoning is not None else None
        return {
            "model": self.cfg.served_model_name,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": schema.parallel_calls(req),
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": effort, "summary": summary},
            "store": req.store is not False,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "text": schema.text_json(req),
            "tool_choice": schema.tool_choice_json(req),
            "tools": schema.tools_json(req),
            "truncation": "disabled",
            "user": req.user,
            "background": False,
            "service_tier": "default",
        }


def _apply(builder: ResponseBuilder, parser, d) -> list[dict]:
    events = parser.events(d)
    builder.count_reasoning_tokens(events, len(d.tokens))
    return builder.apply(events)


async def _write(response: web.StreamResponse, events: list[dict]) -> None:
    if events:
        await response.write(b"".join(sse_event(e) for e in events))


# What the tokenizer lanes run: fn(tokenizer, arg) (OpenAIRoutes._tokenize)


def _prompt(tokenizer: PromptTokenizer, arg) -> Prompt:
    """Render and encode. Under a grammar (which starts the answer at once) a reasoning the template
    always opens is closed in the prompt, as the model cannot close it itself."""
    messages, tools, kwargs, constrained = arg
    chat = tokenizer.render_chat(messages, tools, **kwargs)  # client text stays text (chat_prompt.py)
    if constrained and prompt_opens_reasoning(chat.text):
        chat = chat.plus("</think>\n\n")
    return Prompt(tokenizer.encode_chat(chat), chat.text)


# What the grammar lanes run: fn(arg) (GrammarLanes.build)


TOOL_FIELD = "tools[{}].parameters"  # where a forced tool's schema is in the request
FORMAT_FIELD = "text.format.schema"


def _tool_call_grammar(arg) -> str:
    """A forced call in the markup of the model's tool-call parser (PromptTokenizer.tool_call_grammar)."""
    tokenizer, parser, forced, parallel = arg
    return tokenizer.tool_call_grammar(forced, parallel, TOOL_FIELD, parser)


def _text_format_grammar(json_schema: dict) -> str:
    return structured.json_schema_grammar(json_schema, FORMAT_FIELD)
