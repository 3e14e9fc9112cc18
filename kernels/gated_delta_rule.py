"""Gated delta rule over a batch of requests, each continuing from its linear-state slot.

CUDA with bf16/fp16 activations: fla-core's Triton kernels over the whole varlen batch
(`cu_seqlens`), imported only there because fla needs a GPU (and its chunked kernel refuses
float32). Otherwise: the float32 reference twins, request by request (chunked for prompts,
recurrent for single decode tokens), on whatever device the tensors are. Either way the states
of the batch's slots are read before and written after, in place, in the float32 pool."""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.gated_delta_rule_reference import gated_delta_rule_chunked, gated_delta_rule_recurrent
from ferry.kernels.host_to_device import to_device


def gated_delta_rule_varlen(
    q: torch.Tensor,  # [T, k_heads, k_dim], requests one after another
    k: torch.Tensor,  # [T, k_heads, k_dim]
    v: torch.Tensor,  # [T, v_heads, v_dim]
    g: torch.Tensor,  # [T, v_heads] float32
    beta: torch.Tensor,  # [T, v_heads]
    states: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] float32, updated in place
    state_slots: torch.Tensor,  # int64 [R]
    query_start: torch.Tensor,  # int32 [R + 1]
    query_lens: list[int],
) -> torch.Tensor:
    """Outputs [T, v_heads, v_dim] in v's dtype."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return _fla_varlen(q, k, v, g, beta, states, state_slots, query_start, query_lens)
    out = torch.empty_like(v)
    start = 0
    for slot, qlen in zip(state_slots.tolist(), query_lens):
        rows = slice(start, start + qlen)
        rule = gated_delta_rule_recurrent if qlen == 1 else gated_delta_rule_chunked
        o, final = rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot])
        out[rows] = o.to(v.dtype)
        states[slot] = final
        start += qlen
    return out


# the longest request the recurrent rule takes (token after token, one program a request and head): decode steps and
# speculative verify rows, with no host-built chunk list, so a CUDA graph can hold them; a longer one is chunked
RECURRENT_MAX_TOKENS = 17


def _fla_varlen(q, k, v, g, beta, states, state_slots, query_start, query_lens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    v_heads, k_heads = v.shape[1], k.shape[1]
    recurrent = 0 < min(query_lens) and max(query_lens) <= RECURRENT_MAX_TOKENS
    if not recurrent:  # normalised here, not by fla's chunked rule (see _l2norm)
        q, k = _l2norm(q), _l2norm(k)
    if v_heads != k_heads:  # grouped heads: give every value head its q/k head
        q = q.repeat_interleave(v_heads // k_heads, dim=1)
        k = k.repeat_interleave(v_heads // k_heads, dim=1)
    initial = states[state_slots]  # [R, v_heads, k_dim, v_dim]
    rule = fused_recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
    # the chunked rule's chunk list made here, from the host's lengths (see chunk_indices)
    chunked = {} if recurrent else {"chunk_size": FLA_CHUNK, "chunk_indices": chunk_indices(query_lens, q.device)}
    # by keyword: fla's positional order differs between the two functions
    out, final = rule(
        q=q[None].contiguous(),
        k=k[None].contiguous(),
        v=v[None].contiguous(),
        g=g[None].float().contiguous(),
        beta=beta[None].contiguous(),
        initial_state=initial.contiguous(),
        output_final_state=True,
        cu_seqlens=query_start.long(),
        use_qk_l2norm_in_kernel=recurrent,
        **chunked,
    )
    states[state_slots] = final.float()
    return out[0].to(v.dtype)


FLA_CHUNK = 64  # tokens a chunk of fla's chunked rule (its default, passed explicitly with the list below)
# the chunk lists last made, by lengths and device: a step's linear layers share one, and a step whose token
# mixers run in slices (services/worker/mixer_slices.py) alternates between its slices' lists in every layer
_CHUNK_INDICES_KEPT = 4
_chunk_indices_made: dict[tuple, torch.Tensor] = {}


def chunk_indices(query_lens: list[int], device: torch.device) -> torch.Tensor:
    """fla's `chunk_indices` for requests of `query_lens` tokens: [chunks, 2] int64, each chunk's request
    and its index in that request, FLA_CHUNK tokens a chunk (fla.ops.utils.index.prepare_chunk_indices'
    layout). fla makes it from the device's cu_seqlens with a repeat_interleave whose size it reads
    back: a synchronisation in every linear layer of a prefill step, which kept the host from running
    ahead of the device. Made here from the host's lengths and sent without waiting (pinned), once a
    step (or a mixer slice): the step's linear layers share it (the last few made are kept)."""
    key = (tuple(query_lens), str(device))
    made = _chunk_indices_made.pop(key, None)
    if made is None:
        counts = np.array([-(-n // FLA_CHUNK) for n in query_lens], dtype=np.int64)
        request = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        index = np.arange(len(request), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        made = to_device(np.stack([request, index], axis=1), torch.int64, device)
    _chunk_indices_made[key] = made  # the most recent last
    while len(_chunk_indices_made) > _CHUNK_INDICES_KEPT:
        del _chunk_indices_made[next(iter(_chunk_indices_made))]
    return made


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dim, in float32, back in x's dtype: what fla's chunked
    rule does with `use_qk_l2norm_in_kernel`, but not through fla's l2norm kernel. That kernel is
    autotuned (25 variants) on a key that grows with tokens x heads (a block count of 65,536 rows), so
    the first prefill chunk past each multiple (past 2,048 tokens on a 32-head model) tuned it inside a
    request: a 9-10 s step that the boot's warm-up, at 300 tokens, never reached
    (services/worker/compile_watch.py logs such a compile). Done before the heads are
    repeated, on the q/k heads alone."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def gated_delta_rule_varlen_keeping(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: list[int],
    inside: list[tuple[int, int]],
    state_slots_host: list[int],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`gated_delta_rule_varlen`, also keeping some rows' states at a point inside their chunk: `inside`
    holds (row, tokens of the row before the point), 0 < tokens < the row's length. Two passes over the
    same kernels: every row up to its point (the others whole), the inside rows' states copied out,
    then those rows' remainders continuing from them (the state is carried exactly: the chunked rule's
    state after n tokens is the state a chunk ending there leaves). `state_slots_host`: `state_slots`
    as the host knows them, so that nothing is read back from the device, and the index arrays of the
    two passes go over pinned (a prefix-cache step keeps such states in every linear layer). Returns
    (outputs [T, v_heads, v_dim], the state at each inside row's point, in `inside`'s order)."""
    if not inside:
        return gated_delta_rule_varlen(q, k, v, g, beta, states, state_slots, query_start, query_lens), []
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    cut = dict(inside)
    first = [cut.get(i, n) for i, n in enumerate(query_lens)]
    rows = [i for i, _ in inside]
    rest = [query_lens[i] - cut[i] for i in rows]
    device = q.device

    def positions(spans) -> torch.Tensor:
        return to_device(np.concatenate([np.arange(a, b) for a, b in spans]), torch.int64, device)

    def cumulative(lens) -> torch.Tensor:
        return to_device(np.concatenate([[0], np.cumsum(lens)]), torch.int32, device)

    out = torch.empty_like(v)
    head = positions((starts[i], starts[i] + n) for i, n in enumerate(first))
    out[head] = gated_delta_rule_varlen(
        q[head], k[head], v[head], g[head], beta[head], states, state_slots, cumulative(first), first
    )
    kept_slots = [int(state_slots_host[i]) for i in rows]
    kept = [states[slot].clone() for slot in kept_slots]
    slots = to_device(kept_slots, state_slots.dtype, state_slots.device)
    tail = positions((starts[i] + cut[i], starts[i + 1]) for i in rows)
    out[tail] = gated_delta_rule_varlen(
        q[tail], k[tail], v[tail], g[tail], beta[tail], states, slots, cumulative(rest), rest
    )
    return out, kept
