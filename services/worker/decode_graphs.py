"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured at boot.

A decode step of R requests (one new token each, every one sampling, none starting) runs in the
graph of the smallest bucket B >= R: its inputs are packed into the graph's static input buffer
(rows past R are padding: shared/step.py's sentinel page and padding state slot take their
writes, and the expert store leaves them out through `real_tokens`), the graph replays the whole
model forward — every layer's kernels, the expert cache's lookups, copies and prefetches on the
device — and writes the logits of its B rows into its static output; the sampler runs eagerly on
the first R rows. Launching a step costs one graph launch instead of about a thousand kernels.

Buckets are powers of two up to the largest decode step whose experts take the pair-by-pair
kernel (kernels/expert_pair_gemv.py: the graph-safe path of the device-driven store), capped by
--max-running-requests. All graphs share one memory pool, captured largest first so the smaller
ones reuse its blocks; the pool and the static buffers are workspace that the plan prices
(`graph_workspace_bytes`, measured at boot before the plan, by capturing the same graphs).
"""

from __future__ import annotations

import torch

from ferry.kernels.expert_pair_gemv import PAIR_KERNEL_MAX_PAIRS
from ferry.shared.step import StepBatch
from ferry.shared.units import ceil_div
from ferry.services.worker.forward_batch import ForwardBatch, packed_bytes


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
    def __init__(self, rows: int, inputs: torch.Tensor, batch: ForwardBatch):
        self.rows, self.inputs, self.batch = rows, inputs, batch
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model, pools, page_size: int, max_model_len: int, buckets: list[int], device: torch.device):
        self.model, self.pools, self.page_size, self.device = model, pools, page_size, torch.device(device)
        self.max_pages = ceil_div(max_model_len, page_size)
        self.buckets = sorted(buckets)
        self.graphs: dict[int, _Graph] = {}

    def capture(self, warmups: int = 2) -> None:
        """Warm every bucket up eagerly (Triton compilation, library handles), then capture them,
        largest first, into one shared pool. Runs on padding rows only: no request is touched."""
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for rows in sorted(self.buckets, reverse=True):
                inputs = torch.empty(packed_bytes(rows, self.max_pages), dtype=torch.uint8, device=self.device)
                batch = self._load(StepBatch.empty(step_id=0), rows, inputs)  # every row padding
                g = _Graph(rows, inputs, batch)
                for _ in range(warmups):
                    self.model(batch, self.pools)
                torch.cuda.synchronize(self.device)
                with torch.cuda.graph(g.graph, pool=pool):
                    g.logits = self.model(batch, self.pools)
                self.graphs[rows] = g
        torch.cuda.synchronize(self.device)

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

    def run(self, step: StepBatch, rows: int, before_replay=None) -> torch.Tensor:
        """Replay the bucket's graph on this step; float32 logits of its requests, [R, vocab].
        `before_replay(tokens)`: rewrites the loaded token ids in place (the rows fed from the previous
        step's samples, StepBatch.feed_sampled), queued before the replay."""
        g = self.graphs[rows]
        self._load(step, rows, g.inputs)
        if before_replay is not None:
            before_replay(g.batch.tokens)
        g.graph.replay()
        return g.logits[: len(step.req_ids)]

    def _load(self, step: StepBatch, rows: int, inputs: torch.Tensor) -> ForwardBatch:
        return ForwardBatch.from_step(step, self.page_size, self.device, pad_to=rows, max_pages=self.max_pages,
                                      into=inputs)  # fmt: skip
