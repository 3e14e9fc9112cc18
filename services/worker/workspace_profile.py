"""The activation workspace: measured by running the largest step once (docs/ARCHITECTURE.md §2 rule 3).

The largest step is `max_prefill_tokens` new tokens spread over as many requests as may run
together, every one of them sampling: one long prefill chunk carries most tokens (the widest
activations), the other requests one token each (the most logits rows), whose logits then also go through
speculative decoding's verify (services/worker/speculative_verify.py). It runs on a temporary
minimal pool set — just enough KV pages and linear-state slots for itself, one MoE layer's expert
slots shared by every layer — that is freed before the real pools are planned.

On CUDA the peak allocation above the baseline is the workspace. Attention over long contexts
is not in this step (its requests have no cached context; past MIXER_SLICE_TOKENS its long row's later
mixer slices attend to its earlier ones, whose few thousand keys are gathered into tensors of their own
and so counted twice, a few MiB over),
so the buffers a long prefill gathers one request's K/V into for FlashAttention (max_model_len of
them, `gathered_context_bytes`) are added to it; so are the expert rows a shorter step may hold beyond the
largest step's (`rows_beyond_longest_step`: a step of 8,192 tokens keeps its rows in float32, one past it
in the dtype). On CPU there is no allocator to
measure: the worker uses the estimate of `plan/costs.py`."""

from __future__ import annotations

import msgspec
import numpy as np
import structlog
import torch

from ferry.plan import pool_layout as L
from ferry.plan.costs import rows_beyond_longest_step
from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.kv_groups import kv_groups, sliding_slice_tokens
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import Resolved
from ferry.services.worker.expert_formats import expert_format_for
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.late_bound_experts import LateBoundExperts, SharedLayerExperts
from ferry.services.worker.mtp_drafts import MtpDrafter
from ferry.services.worker.pools import (
    TORCH_DTYPES,
    ExpertSlotPool,
    KvTensorPool,
    LinearStatePool,
    Pools,
    allocate_pool,
)
from ferry.services.worker.sampler import Sampler
from ferry.services.worker.speculative_verify import verify_drafts
from ferry.shared.errors import PlanError
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch
from ferry.shared.units import ceil_div

log = structlog.get_logger("worker")

# The sampling path with the most workspace: a full-vocabulary sort for top-k/top-p, and min-p.
PROFILE_SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1)


def largest_step(r: Resolved) -> StepBatch:
    requests = max(1, min(r.max_running_requests, r.max_prefill_tokens))
    query_lens = np.ones(requests, dtype=np.int32)
    query_lens[0] = r.max_prefill_tokens - (requests - 1)
    pages_per_request = ceil_div(query_lens.astype(np.int64), r.page_size)
    page_table = np.zeros((requests, int(pages_per_request.max())), dtype=np.int32)
    next_page = 1  # page 0 is the sentinel
    for i, n in enumerate(pages_per_request):
        page_table[i, :n] = np.arange(next_page, next_page + n)
        next_page += int(n)
    rng = np.random.default_rng(0)
    return StepBatch(
        step_id=0,
        req_ids=np.arange(requests, dtype=np.int64),
        tokens=rng.integers(0, 1000, size=int(query_lens.sum()), dtype=np.int32),
        query_lens=query_lens,
        context_lens=np.zeros(requests, dtype=np.int32),
        page_table=page_table,
        linear_state_slots=np.arange(1, requests + 1, dtype=np.int32),
        reset_linear_state=np.ones(requests, dtype=bool),
        sample=np.ones(requests, dtype=bool),
    )


def temporary_pools(spec: ModelSpec, r: Resolved, step: StepBatch, device: torch.device) -> Pools:
    pages = int(step.page_table.max())
    # rings for the step's requests (slots 1..requests) where the model's sliding groups would keep them
    slots, slice_tokens = len(step.req_ids), sliding_slice_tokens(r.max_prefill_tokens)
    kv = KvTensorPool(
        allocate_pool(
            L.kv_pool_layout(spec, r.dtype, pages, r.page_size, r.kv_cache_dtype, slots, slice_tokens), device
        ),
        L.kv_group_layouts(spec, pages, r.page_size, slots, slice_tokens),
        r.page_size,
        dtype=TORCH_DTYPES[r.dtype],
    )
    linear_layout = L.linear_state_layout(spec, r.dtype, len(step.req_ids))
    linear = (
        LinearStatePool(allocate_pool(linear_layout, device), spec.linear_attention_layers)
        if linear_layout.tensors
        else None
    )
    experts = ExpertSlotPool(
        allocate_pool(L.expert_slot_layout(spec, r.dtype, spec.num_experts), device),
        expert_format_for(spec, TORCH_DTYPES[r.dtype]),
    )
    return Pools(kv, linear, experts)


def _prepare(experts: LateBoundExperts, spec: ModelSpec, r: Resolved, device: torch.device):
    step = largest_step(r)
    np.remainder(step.tokens, spec.vocab_size, out=step.tokens)  # in place: the struct is frozen, not its arrays
    pools = temporary_pools(spec, r, step, device)
    experts.bind(SharedLayerExperts(pools.experts, spec.num_experts))
    return step, pools


def _sampler(spec: ModelSpec, step: StepBatch, device: torch.device) -> Sampler:
    """The sampler with every request of the step registered: each penalised request keeps
    per-vocabulary state on the device for its lifetime, which the workspace must include."""
    sampler = Sampler(spec.vocab_size, device, seed=0)
    for rid in step.req_ids.tolist():
        sampler.add_request(NewRequest(req_id=rid, prompt_token_ids=step.tokens[:8], sampling=PROFILE_SAMPLING))
    return sampler


def _run(
    model, step: StepBatch, pools: Pools, sampler: Sampler, r: Resolved, device: torch.device, mtp_head=None
) -> torch.Tensor:
    with torch.inference_mode():
        batch = ForwardBatch.from_step(step, r.page_size, device)
        hidden = None
        if mtp_head is None:
            logits = model(batch, pools)
        else:  # the hidden states stay for the MTP head's pass, after the sampling (as in the executor)
            hidden = model.hidden_states(batch, pools)
            logits = model.logits(hidden[batch.logits_rows])
        tokens, _ = sampler.sample(step.req_ids.tolist(), logits)
        if mtp_head is not None:  # --speculative-method mtp: the head's K/V of every position, and a draft a row
            asked = msgspec.structs.replace(step, mtp_drafts=np.ones(len(step.req_ids), np.int32))
            MtpDrafter(mtp_head, model, pools, r.page_size, device).run(asked, batch.tokens, hidden, tokens, None)
        # speculative decoding's verify over as many logits rows (a step's drafts keep its logits rows within
        # max_running_requests: batcher._give_drafts), as pairs of a draft and the bonus after it: its
        # temporaries are the workspace's too
        pairs = len(step.req_ids) // 2
        if pairs:
            states = [sampler.requests[int(rid)] for rid in step.req_ids[:pairs].tolist()]
            verify_drafts(states, logits[: 2 * pairs], [[0]] * pairs, sampler.generator, logits.shape[1])
    return tokens


def run_largest_step(
    model, experts: LateBoundExperts, spec: ModelSpec, r: Resolved, device: torch.device, mtp_head=None
) -> torch.Tensor:
    """Forward and sample the largest step on temporary pools (and, with `mtp_head`, draft after it); returns the
    sampled tokens."""
    step, pools = _prepare(experts, spec, r, device)
    try:
        return _run(model, step, pools, _sampler(spec, step, device), r, device, mtp_head)
    finally:
        experts.unbind()


def profile_decode_graphs_cuda(
    model,
    experts: LateBoundExperts,
    spec: ModelSpec,
    r: Resolved,
    device: torch.device,
    buckets: list[int],
    mtp_head=None,
    speculative_tokens: int = 0,
) -> int | None:
    """Device memory the decode graphs take (their shared pool and static buffers; with `speculative_tokens`
    the verify and MTP chain graphs beside them, as boot captures them), measured by
    capturing them on temporary pools with one MoE layer's slots serving every layer, then freed.
    The offloading store's graph-safe path allocates a few more small tensors per layer (the next
    layer's router logits and top-k for the prefetch, [T, experts] at most 64 rows): one more
    small-allocation segment covers them, and boot checks the real capture against this. With `mtp_head`
    (--speculative-method mtp) the graphs write its K/V too, as boot's capture does."""
    from ferry.services.worker.decode_graphs import DecodeGraphs

    _step, pools = _prepare(experts, spec, r, device)
    graphs = None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved(device)
    try:
        graphs = DecodeGraphs(
            model,
            pools,
            r.page_size,
            r.max_model_len,
            buckets,
            device,
            spec.vocab_size,
            r.max_running_requests,
            count_step=experts.count_step_on_device,
            mtp_head=mtp_head,
            speculative_tokens=speculative_tokens,
        )
        graphs.capture()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what the eager warm-ups cached is the eager workspace's, not the graphs'
        taken = torch.cuda.memory_reserved(device) - baseline
    except RuntimeError as exc:  # a decode path that waits for the device (e.g. float32 Gated DeltaNet)
        log.warning("cuda_graphs_unavailable", error=str(exc), message="this model decodes eagerly")
        return None
    finally:
        experts.unbind()
        del graphs, pools
        torch.cuda.empty_cache()
    return int(taken + GRAPH_OFFLOAD_MARGIN)


# What the offloading store's graph-safe path allocates beyond the profiled all-resident path
# (see profile_decode_graphs_cuda): one segment of the caching allocator's small-block pool.
GRAPH_OFFLOAD_MARGIN = 2 * 2**20


def profile_workspace_cuda(
    model, experts: LateBoundExperts, spec: ModelSpec, r: Resolved, device: torch.device, mtp_head=None
) -> int:
    """Peak bytes the largest step takes beyond its inputs (allocator segments included; with `mtp_head`, its
    drafting pass after the forward: services/worker/mtp_drafts.py), plus the long-context gather and the rows a
    shorter step may hold beyond its own."""
    # The temporary pools are part of the baseline, not of the workspace: allocate them first.
    step, pools = _prepare(experts, spec, r, device)
    sampler = None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    baseline_allocated = torch.cuda.memory_allocated(device)
    baseline_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        sampler = _sampler(spec, step, device)
        _run(model, step, pools, sampler, r, device, mtp_head)
        torch.cuda.synchronize(device)
        # Reserved, not only allocated: the allocator takes whole segments (2 MiB, or 20 MiB for
        # blocks of 1-10 MiB), and those segments are what the device gives away.
        peak = max(
            torch.cuda.max_memory_allocated(device) - baseline_allocated,
            torch.cuda.max_memory_reserved(device) - baseline_reserved,
        )
    finally:
        experts.unbind()
        del pools, sampler
        torch.cuda.empty_cache()
    return int(
        peak
        + gathered_context_bytes(spec, r.dtype, r.max_model_len, r.page_size)
        + rows_beyond_longest_step(spec, r.dtype, r.max_prefill_tokens)
    )


def profiled_or_plan_error(profile, tokens: int, release=lambda: None) -> int:
    """profile()'s bytes, or a PlanError saying that a `tokens`-token step's workspace did not fit, for the
    prefill chunk's chooser (plan/prefill_chunk.py) to try a shorter one. The device's out-of-memory
    error is dropped before the PlanError is raised and `release` (the caching allocator's empty_cache)
    called after: its traceback holds the frames of the step that ran out, and with them every tensor the
    step had made, which would otherwise stay on the device through the shorter chunk's profile and the
    pools' allocation (a PlanError raised inside the except block keeps it as its __context__)."""
    try:
        return profile()
    except torch.OutOfMemoryError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
    release()  # the error, its traceback and the step's tensors are gone here
    raise PlanError(f"a {tokens}-token step's workspace did not fit on the device while it was profiled ({reason})")


def gathered_context_bytes(spec: ModelSpec, dtype: str, max_model_len: int, page_size: int) -> int:
    """One request's K and V at max_model_len, in whole pages: the buffers a long prefill gathers them
    into for FlashAttention (pools.KvTensorPool.gather_buffers), taken once and kept; none where no layer takes
    FlashAttention (attention with sinks or a sliding window never does: kernels/paged_attention.py)."""
    flash = [g for g in kv_groups(spec) if not spec.attention_sinks and not g.window]
    if not flash:
        return 0
    tokens = ceil_div(max_model_len, page_size) * page_size
    # in the first group's shape, as pools.KvTensorPool keeps them: a full group's, which come first
    return 2 * tokens * flash[0].kv_heads * flash[0].head_dim * DTYPE_BYTES[dtype]
