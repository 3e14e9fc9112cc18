"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured at boot.

A decode step of R requests (one new token each, every one sampling, none starting) runs in the
graph of the smallest bucket B >= R: its inputs are packed into the graph's static input buffer
(rows past R are padding: shared/step.py's sentinel page and padding state slot take their
writes, and the expert store leaves them out through `real_tokens`), the graph replays the whole
model forward — every layer's kernels, the expert cache's lookups, copies and prefetches on the
device — and writes the logits of its B rows into its static output. Launching a step costs one
graph launch instead of about a thousand kernels.

The graph holds the step's two ends too, so a plain decode step is, from the host, one input copy,
the noise draws, one replay and one result copy (decode_io.py's pinned rings):
* before the forward, the rows fed from the previous step's samples (StepBatch.feed_sampled) take
  their token from `last_tokens`, where every step's sampled tokens are left on the device;
* after it, the expert store's step statistics are counted on the device (`count_step_on_device`),
  and kernels/sample_rows.py samples every row from the inverse temperatures and noise rows
  the inputs carry and the noise drawn into `noise`, and packs [tokens | logprobs] for one copy.
A step whose sampling needs more (penalties, logit_bias, a grammar, top-k/top-p/min-p, logprobs)
ignores the graph's samples and runs the sampler on the graph's logits instead (executor.py).

Buckets are powers of two up to the largest decode step whose experts take the pair-by-pair
kernel (kernels/expert_pair_gemv.py: the graph-safe path of the device-driven store), capped by
--max-running-requests. All graphs share one memory pool, captured largest first so the smaller
ones reuse its blocks; the pool and the static buffers are workspace that the plan prices
(`graph_workspace_bytes`, measured at boot before the plan, by capturing the same graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.expert_pair_gemv import PAIR_KERNEL_MAX_PAIRS
from ferry.kernels.sample_rows import sample_rows
from ferry.services.worker.decode_io import TAIL_FIELDS, DecodeInputs, DecodeResults, device_views, forward_bytes
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.mtp_chain_graphs import ChainGraphs, chain_shapes
from ferry.services.worker.mtp_drafts import write_decode_kv
from ferry.services.worker.verify_graphs import VerifyGraphs, verify_shapes
from ferry.shared.step import StepBatch
from ferry.shared.units import ceil_div


def graph_buckets(top_k: int, max_running_requests: int, below: int | None = None) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, ... up to the pair kernel's limit and the request cap,
    and under `below` (the steps that take the expert store's copy-engine path run eagerly)."""
    largest = min(max_running_requests, max(1, PAIR_KERNEL_MAX_PAIRS // top_k))
    if below is not None:
        largest = min(largest, below - 1)
    if largest < 1:
        return []
    out, b = [], 1
    while b < largest:
        out.append(b)
        b *= 2
    return out + [largest]


class _Graph:
    def __init__(
        self,
        rows: int,
        inputs: torch.Tensor,
        batch: ForwardBatch,
        tail: dict[str, torch.Tensor],
        staging: DecodeInputs,
        results: DecodeResults,
    ):
        self.rows, self.inputs, self.batch, self.tail = rows, inputs, batch, tail
        self.staging, self.results = staging, results
        self.graph = torch.cuda.CUDAGraph() if inputs.is_cuda else None  # CPU: the tests of its parts
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # [rows, hidden]: the final-normed hidden states (with an MTP head)
        self.sampled: torch.Tensor | None = None  # uint8 [8 * rows]: tokens int32 then logprobs float32


class DecodeGraphs:
    def __init__(
        self,
        model,
        pools,
        page_size: int,
        max_model_len: int,
        buckets: list[int],
        device: torch.device,
        vocab_size: int,
        max_sampled_rows: int,
        count_step=None,
        mtp_head=None,
        speculative_tokens: int = 0,
    ):
        """`max_sampled_rows`: the most rows any step samples (the plan's max_running_requests): the
        size of `last_tokens`, which every step (eager ones too, executor.py) leaves its samples in.
        `count_step`: the expert store's `count_step_on_device`, which the graphs hold after the forward.
        `mtp_head`: --speculative-method mtp's draft head, whose K/V of the step's rows the graphs write after
        the sampling (mtp_drafts.py's `write_decode_kv`), keeping the final hidden states for its chain.
        `speculative_tokens`: --speculative-tokens where speculation is on (else 0): the verify steps' graphs
        (verify_graphs.py) and with `mtp_head` its chain's (mtp_chain_graphs.py) are captured into the same pool."""
        self.model, self.pools, self.page_size, self.device = model, pools, page_size, torch.device(device)
        self.max_pages = ceil_div(max_model_len, page_size)
        self.buckets = sorted(buckets)
        self.vocab_size = vocab_size
        self.graphs: dict[int, _Graph] = {}
        self.count_step = count_step
        self.mtp_head = mtp_head
        self.last_replay: tuple | None = None  # the last replay's (start, end) timing events (CUDA)
        largest = max(self.buckets, default=1)
        self.last_tokens = torch.zeros(max(max_sampled_rows, largest), dtype=torch.int64, device=self.device)
        self.noise = torch.ones(largest, vocab_size, dtype=torch.float32, device=self.device)  # Exp(1) draws, shared
        self.verify: VerifyGraphs | None = None
        self.chains: ChainGraphs | None = None
        if speculative_tokens and self.buckets:
            hidden = model.spec.hidden_size
            shapes = verify_shapes(self.buckets, speculative_tokens)
            self.verify = VerifyGraphs(
                model, pools, page_size, self.max_pages, shapes, self.device, vocab_size, hidden, count_step
            )
            if mtp_head is not None:
                shapes = chain_shapes(self.buckets, speculative_tokens)
                self.chains = ChainGraphs(mtp_head, model, pools, page_size, self.max_pages, shapes, self.device)

    def capture(self, warmups: int = 2) -> None:
        """Warm every bucket up eagerly (Triton compilation, library handles), then capture them,
        largest first, into one shared pool. Runs on padding rows only: no request is touched. Off CUDA nothing
        is captured: each replay runs the graph's body eagerly (`run`; the CPU tests of the graph path)."""
        if self.device.type != "cuda":
            self.graphs = {rows: self._bucket(rows) for rows in self.buckets}
            self._capture_speculation(None, warmups)
            return
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for rows in sorted(self.buckets, reverse=True):
                g = self._bucket(rows)
                for _ in range(warmups):
                    self._forward(g)
                torch.cuda.synchronize(self.device)
                with torch.cuda.graph(g.graph, pool=pool):
                    g.logits, g.sampled, g.hidden = self._forward(g)
                self.graphs[rows] = g
        torch.cuda.synchronize(self.device)
        self._capture_speculation(pool, warmups)
        self._upload()

    def _upload(self) -> None:
        """Replay every graph once, on the padding rows it was captured with: a graph's first replay uploads it to
        the device and takes several times a warm one, which the first steps that hit it (and the draft-length
        controller's prices, measured from them) would otherwise pay."""
        replays = [g.graph for g in self.graphs.values()]
        replays += [g.graph for g in self.verify.graphs.values()] if self.verify is not None else []
        replays += [c.graph for c in self.chains.chains.values()] if self.chains is not None else []
        with torch.inference_mode():
            for graph in replays:
                graph.replay()
        torch.cuda.synchronize(self.device)

    def _capture_speculation(self, pool, warmups: int) -> None:
        with torch.inference_mode():
            if self.verify is not None:
                self.verify.capture(pool, warmups)
            if self.chains is not None:
                self.chains.capture(pool, warmups)

    def _bucket(self, rows: int) -> _Graph:
        """A bucket's static input buffer (the forward's arrays, then the tail's: decode_io.py's layout),
        loaded with a step of padding rows only, and its pinned rings."""
        staging = DecodeInputs(rows, self.max_pages, self.page_size, self.device)
        inputs = torch.zeros(staging.nbytes, dtype=torch.uint8, device=self.device)
        staging.upload(StepBatch.empty(step_id=0), inputs)
        batch = self._load(StepBatch.empty(step_id=0), rows, inputs[: forward_bytes(rows, self.max_pages)])
        tail = device_views(inputs, staging.layout, [name for name, _, _ in TAIL_FIELDS])
        return _Graph(rows, inputs, batch, tail, staging, DecodeResults(rows, self.device))

    def _forward(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a graph holds: the feed, the forward, the sampling of every row and its packed results; with an MTP
        head, its K/V of the rows after the sampling (the hidden states kept: the third of the outputs)."""
        self._feed(g)
        hidden = self.model.hidden_states(g.batch, self.pools)
        logits = self.model.logits(hidden[g.batch.logits_rows])
        if self.count_step is not None:
            self.count_step()
        sampled = self._sample(g, logits)
        if self.mtp_head is None:
            return logits, sampled, None
        write_decode_kv(self.mtp_head, self.model, self.pools, g.batch, hidden, self.last_tokens[: g.rows])
        return logits, sampled, hidden

    def _feed(self, g: _Graph) -> None:
        """The rows fed from the previous step take their token from `last_tokens`."""
        tokens, src = g.batch.tokens, g.tail["feed_src"]
        fed = self.last_tokens.index_select(0, src.clamp(min=0))
        tokens.copy_(torch.where(src >= 0, fed, tokens))

    def _sample(self, g: _Graph, logits: torch.Tensor) -> torch.Tensor:
        """Every row drawn (kernels/sample_rows.py), the tokens left in `last_tokens`, and
        [tokens int32 | logprobs float32] packed for one copy to the host."""
        sampled, logprobs = sample_rows(logits, g.tail["inv_temperature"], self.noise[: g.rows], g.tail["noise_rows"])
        self.last_tokens[: g.rows].copy_(sampled)
        return torch.cat([sampled.to(torch.int32).view(torch.uint8), logprobs.view(torch.uint8)])

    def bucket_for(self, step: StepBatch) -> int | None:
        """The bucket that replays this step, or None when it must run eagerly (prefill, a request
        starting, a row that does not sample, a row that asks for prompt logprobs, more rows than the
        largest graph)."""
        r = len(step.req_ids)
        if r == 0 or not self.graphs or r > self.buckets[-1]:
            return None
        if len(step.tokens) != r or not step.sample.all() or step.reset_linear_state.any():
            return None
        if step.prompt_logprobs is not None and step.prompt_logprobs.any():
            return None  # prompt logprobs need the logits of rows the graph does not keep
        if step.page_table.shape[1] > self.max_pages:
            return None
        return next(b for b in self.buckets if b >= r)

    def run(
        self, step: StepBatch, rows: int, feed_src: np.ndarray | None = None, sampling: tuple[list, list] | None = None
    ) -> torch.Tensor:
        """Replay the bucket's graph on this step; float32 logits of its requests, [R, vocab].
        `feed_src`: for each row, the row of the previous step's samples that is its token, -1 for
        none (None: no row is fed); `sampling`: (inverse temperatures, noise rows) when the graph's
        own samples are the step's (the noise drawn into `noise` before), None when they are not."""
        g = self.graphs[rows]
        inv_t, noise_rows = sampling if sampling is not None else (None, None)
        g.staging.upload(step, g.inputs, feed_src, inv_t, noise_rows)
        if g.graph is None:  # off CUDA, the body eagerly, on the step's batch: the CPU kernels read its host lengths
            g.batch = self._load(step, rows, g.inputs[: forward_bytes(rows, self.max_pages)])
            g.logits, g.sampled, g.hidden = self._forward(g)
            self.last_replay = None
        else:  # timed around the replay alone: what the device spends on the step, not the host's upload before it
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.graph.replay()
            end.record()
            self.last_replay = (start, end)
        return g.logits[: len(step.req_ids)]

    def step_tensors(self, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last replay's first `n` rows: (their tokens, the final-normed hidden states; with an MTP head)."""
        g = self.graphs[rows]
        return g.batch.tokens[:n], g.hidden[:n]

    def fetch_samples(self, rows: int, n: int) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Queue the copy of the last replay's samples to the host: ([tokens int32 [n], logprobs [n]], event)."""
        g = self.graphs[rows]
        return g.results.fetch(g.sampled, n)

    def keep_samples(self, tokens: torch.Tensor) -> torch.Tensor:
        """Leave a step's samples (sampled outside a graph) in `last_tokens`, where a graph's feed reads
        them; returns the view that holds them."""
        n = int(tokens.shape[0])
        if n > self.last_tokens.shape[0]:
            raise ValueError(
                f"a step sampled {n} rows, more than the {self.last_tokens.shape[0]} of max_running_requests"
            )
        self.last_tokens[:n].copy_(tokens)
        return self.last_tokens[:n]

    def _load(self, step: StepBatch, rows: int, inputs: torch.Tensor) -> ForwardBatch:
        return ForwardBatch.from_step(
            step, self.page_size, self.device, pad_to=rows, max_pages=self.max_pages, into=inputs
        )
