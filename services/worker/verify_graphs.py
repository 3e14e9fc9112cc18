"""Speculative verify steps replayed as CUDA graphs: one graph per (rows, tokens a row), captured at boot beside the
decode graphs, into their pool.

A verify step whose every row carries the same n tokens (its last token and drafts, and for a hybrid the drafts it
kept last time, computed again: shared/speculation.py), every row sampling, none starting, none fed from the step
before, runs in the graph of the smallest row bucket that holds it at that n: its inputs packed into the graph's
static buffer (ForwardBatch.from_step with `row_tokens`, padding rows' tokens at the sentinel page), the graph
replays the forward over every position and the LM head over all of them, and the expert store's step statistics.
What depends on the drafts' judgement stays eager after the replay, on the graph's outputs: the verify rule
(speculative_verify.py), the linear states put back, the MTP head's K/V and chain (mtp_drafts.py). An eager verify
step cost its launches (a thousand kernels for a step of a few tokens), which made drafting lose wherever a decode
graph's replay was the alternative.

Shapes: n from 2 to twice --speculative-tokens (a hybrid's row after a refusal: its kept drafts, its token and new
drafts), within what the decode kernels take as a row (kernels/paged_attention.py's SHORT_QUERY_TOKENS,
kernels/gated_delta_rule.py's RECURRENT_MAX_TOKENS), and row buckets of the decode graphs' up to VERIFY_MAX_ROWS whose
rows x n tokens the decode graphs' largest step holds (the expert store's graph-safe path). The graphs' logits and
hidden states go to one buffer each, shared by all of them (their temporaries share the pool): the price of the
verify graphs is the pool's growth and those two buffers, which the plan's profile of the decode graphs measures."""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.gated_delta_rule import RECURRENT_MAX_TOKENS
from ferry.kernels.host_to_device import to_device
from ferry.kernels.paged_attention import SHORT_QUERY_TOKENS
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.shared.step import StepBatch

# the most rows a verify graph has: a step of several drafting rows carries one n only where the rows' drafts and
# kept tokens agree, which few-row steps do most; wider ones run eagerly
VERIFY_MAX_ROWS = 4


def verify_shapes(decode_buckets: list[int], speculative_tokens: int) -> list[tuple[int, int]]:
    """(rows, tokens a row) of the verify graphs, for the decode graphs' row buckets and --speculative-tokens K."""
    if not decode_buckets or speculative_tokens < 1:
        return []
    most_tokens = max(decode_buckets)  # the largest step the decode graphs replay: the store's graph-safe path
    longest = min(2 * speculative_tokens, SHORT_QUERY_TOKENS, RECURRENT_MAX_TOKENS)
    return [
        (rows, n)
        for n in range(2, longest + 1)
        for rows in decode_buckets
        if rows <= VERIFY_MAX_ROWS and rows * n <= most_tokens
    ]


class _Graph:
    def __init__(self, rows: int, n: int, inputs: torch.Tensor, batch: ForwardBatch):
        self.rows, self.n, self.inputs, self.batch = rows, n, inputs, batch
        self.graph = torch.cuda.CUDAGraph() if inputs.is_cuda else None  # CPU: the tests of its body


class VerifyGraphs:
    def __init__(
        self,
        model,
        pools,
        page_size: int,
        max_pages: int,
        shapes: list[tuple[int, int]],
        device: torch.device,
        vocab_size: int,
        hidden_size: int,
        count_step=None,
    ):
        """`shapes`: (rows, tokens a row) to capture (`verify_shapes`); `count_step`: the expert store's
        `count_step_on_device`, which the graphs hold after the forward, as the decode graphs do."""
        self.model, self.pools, self.page_size, self.max_pages = model, pools, page_size, max_pages
        self.device = torch.device(device)
        self.shapes = sorted(shapes)
        self.count_step = count_step
        self.graphs: dict[tuple[int, int], _Graph] = {}
        most = max((rows * n for rows, n in self.shapes), default=0)
        self.logits = torch.zeros(most, vocab_size, dtype=torch.float32, device=self.device)
        dtype = model.dtype if model is not None else torch.float32
        self.hidden = torch.zeros(most, hidden_size, dtype=dtype, device=self.device)
        self.last_replay: tuple | None = None  # the last replay's (start, end) timing events (CUDA)

    def capture(self, pool, warmups: int = 2) -> None:
        """Warm each shape up eagerly, then capture it into the decode graphs' `pool`, the most tokens first (the
        smaller reuse its blocks). Padding rows only: no request is touched. Off CUDA nothing is captured."""
        if self.device.type != "cuda":
            self.graphs = {shape: self._graph(*shape) for shape in self.shapes}
            return
        for rows, n in sorted(self.shapes, key=lambda s: (s[0] * s[1], s), reverse=True):
            g = self._graph(rows, n)
            for _ in range(warmups):
                self._forward(g)
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(g.graph, pool=pool):
                self._forward(g)
            self.graphs[(rows, n)] = g
        torch.cuda.synchronize(self.device)

    def _graph(self, rows: int, n: int) -> _Graph:
        """A shape's static input buffer, loaded with a step of padding rows only."""
        # the packed size at this shape: every array of a step is a view of one buffer (forward_batch.py)
        probe = self._load(StepBatch.empty(step_id=0), rows, n, None, "cpu")
        inputs = torch.zeros(probe.tokens.untyped_storage().nbytes(), dtype=torch.uint8, device=self.device)
        return _Graph(rows, n, inputs, self._load(StepBatch.empty(step_id=0), rows, n, inputs))

    def _forward(self, g: _Graph) -> None:
        """What a graph holds: the forward over every position, the LM head over all of them, the step's
        statistics; into the shared buffers."""
        hidden = self.model.hidden_states(g.batch, self.pools)
        t = g.rows * g.n
        self.logits[:t].copy_(self.model.logits(hidden))
        self.hidden[:t].copy_(hidden)
        if self.count_step is not None:
            self.count_step()

    def shape_for(self, step: StepBatch, feed_src: np.ndarray | None) -> tuple[int, int] | None:
        """The graph that replays this verify step, or None where it runs eagerly (rows of different lengths, a row
        that starts, is fed, does not sample, asks for prompt logprobs or saves a state inside it, more rows or
        pages than a graph holds)."""
        r = len(step.req_ids)
        if not self.graphs or r == 0 or step.draft_lens is None:
            return None
        q = np.asarray(step.query_lens)
        n = int(q[0])
        if (q != n).any() or not step.sample.all() or step.reset_linear_state.any():
            return None
        if feed_src is not None and (np.asarray(feed_src) >= 0).any():
            return None
        if step.prompt_logprobs is not None and np.asarray(step.prompt_logprobs).any():
            return None
        if step.saved_inside().any() or step.page_table.shape[1] > self.max_pages:
            return None
        return next(((rows, m) for rows, m in self.shapes if m == n and rows >= r and (rows, m) in self.graphs), None)

    def run(self, step: StepBatch, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay the shape's graph on this step: (the logits of each sampling row's last draft_lens + 1 positions,
        in order, as ForwardBatch.logits_rows takes them; the final-normed hidden states [T, hidden] and the tokens
        [T] of the step's positions)."""
        g = self.graphs[shape]
        rows, n = shape
        t = len(step.req_ids) * n
        batch = self._load(step, rows, n, g.inputs)
        if g.graph is None:  # off CUDA, the body eagerly, on the step's batch: the CPU kernels read its host lengths
            g.batch = batch
            self._forward(g)
            self.last_replay = None
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.graph.replay()
            end.record()
            self.last_replay = (start, end)
        spans = np.asarray(step.draft_lens, dtype=np.int64) + 1
        judged = np.concatenate([np.arange((i + 1) * n - s, (i + 1) * n) for i, s in enumerate(spans)])
        return self.logits[to_device(judged, torch.int64, self.device)], self.hidden[:t], g.batch.tokens[:t]

    def _load(self, step: StepBatch, rows: int, n: int, inputs: torch.Tensor | None, device=None) -> ForwardBatch:
        return ForwardBatch.from_step(
            step,
            self.page_size,
            self.device if device is None else device,
            pad_to=rows,
            max_pages=self.max_pages,
            into=inputs,
            row_tokens=n,
        )
