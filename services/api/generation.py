"""One request from token events to text deltas: detokenize, apply stop strings, time it, and abort
it in the scheduler if the caller goes away before it finishes (client disconnect, stop string)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from ferry.services.api.detokenizer import IncrementalDetokenizer
from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.scheduler_client import PromptLogprobs, SchedulerClient, Token
from ferry.services.api.stop_strings import StopStringFilter
from ferry.shared.errors import FerryError
from ferry.shared.messages import Finished
from ferry.shared.sampling import SamplingParams

log = structlog.get_logger("api.generation")


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None  # set on the last delta
    tokens: list[Token] = field(default_factory=list)  # the tokens whose text this delta completes (with logprobs)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    def __init__(
        self,
        client: SchedulerClient,
        tokenizer,
        metrics: ApiMetrics,
        route: str,
        prompt: list[int],
        sampling: SamplingParams,
        max_tokens: int | None,
        stops: list[str],
        fields: dict[str, str] | None = None,
        text=None,
    ):
        """`fields`: the request body's names of the Submit fields a refusal names as its param, where
        they differ ({"prompt": "messages"}): the error then names the field the client sent. `text`: where
        the deltas' text comes from, push(token_id) -> text and flush() -> text (the output parser's
        text_source(): the harmony format's parser); None: the tokenizer's detokenized output."""
        self.client, self.metrics, self.route = client, metrics, route
        self.fields = fields or {}
        self.prompt, self.sampling, self.max_tokens = prompt, sampling, max_tokens
        self.detok = text if text is not None else IncrementalDetokenizer(tokenizer)
        self.stops = StopStringFilter(stops)
        self.usage = Usage(prompt_tokens=len(prompt))
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        # What happened, for ferry_requests_total{outcome}: stop | length (completed), disconnected (the
        # client left first), refused (turned away before it ran: a 4xx, or a 503 at admission),
        # failed (lost or broken after it was admitted). "disconnected" until it ends another way.
        self.outcome = "disconnected"
        self.stop_sequence: str | None = None  # the stop string that ended it, if one did
        self.error: str | None = None  # the error's type, when it ended in one
        self.prompt_logprobs: list = []  # Logprobs of prompt positions, in order (completions' echo)
        self._pending: list[Token] = []  # tokens not yet handed out with a delta

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas; the last one carries the finish reason. Raises FerryError when the request
        is rejected or lost. Closing the iterator early aborts the request."""
        stream = None
        try:
            try:
                stream = await self.client.submit(self.prompt, self.sampling, self.max_tokens)
            except FerryError:
                self.outcome = "refused"
                raise
            last = None
            while True:
                ev = await stream.next()
                if isinstance(ev, FerryError):
                    ev.param = self.fields.get(ev.param, ev.param)
                    self.outcome = "refused" if ev.http_status < 500 else "failed"
                    self.error = type(ev).__name__
                    raise ev
                if isinstance(ev, PromptLogprobs):
                    self.prompt_logprobs.append(ev.logprobs)
                    continue
                if isinstance(ev, Finished):
                    if self.usage.completion_tokens == 0:
                        self.metrics.prompt_tokens.inc(len(self.prompt))
                    text, hit = self.stops.push(self.detok.flush())
                    if hit:
                        self.stop_sequence = self.stops.matched
                    else:
                        text += self.stops.flush()
                    self.usage.cached_tokens = ev.cached_tokens
                    yield self._finish(text, "stop" if hit else ev.reason)
                    return
                assert isinstance(ev, Token)
                self._observe(ev, last)
                last = ev.at
                self._pending.append(ev)
                text, hit = self.stops.push(self.detok.push(ev.token_id))
                if hit:
                    self.stop_sequence = self.stops.matched
                    self.client.abort(stream)
                    yield self._finish(text, "stop")
                    return
                if text:
                    yield Delta(text, tokens=self._take())
        except Exception:
            if self.outcome == "disconnected":
                self.outcome = "failed"  # not the client's doing: a bug on this side (logged by the middleware)
            raise
        finally:
            if stream is not None and not stream.done:
                self.client.abort(stream)  # the caller left (disconnect) before the request finished
            self.metrics.requests.labels(self.route, self.outcome).inc()
            self._log_end()

    def _log_end(self) -> None:
        """One line per request that reached the scheduler, however it ended: finished (stop, length),
        aborted (the client disconnected) or failed (the error's type). The request id is in the context."""
        finished = self.outcome in ("stop", "length")
        ttft = None if self.first_token_at is None else round(self.first_token_at - self.arrived, 4)
        (log.info if finished or self.outcome == "disconnected" else log.warning)(
            "request_finished" if finished else "request_aborted",
            route=self.route,
            outcome=self.outcome,
            error=self.error,
            prompt_tokens=self.usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens,
            cached_tokens=self.usage.cached_tokens,
            ttft_s=ttft,
            seconds=round(time.perf_counter() - self.arrived, 4),
        )

    def _observe(self, ev: Token, previous: float | None) -> None:
        if previous is None:
            self.first_token_at = ev.at
            self.metrics.ttft.observe(ev.at - self.arrived)
            self.metrics.prompt_tokens.inc(len(self.prompt))
        else:
            self.metrics.itl.observe(ev.at - previous)
        self.usage.completion_tokens += 1
        self.metrics.generation_tokens.inc()

    def _take(self) -> list[Token]:
        out, self._pending = self._pending, []
        return out

    def _finish(self, text: str, reason: str) -> Delta:
        self.outcome = reason
        self.metrics.e2e.observe(time.perf_counter() - self.arrived)
        self.metrics.cached_tokens.inc(self.usage.cached_tokens)
        return Delta(text, reason, self._take())
