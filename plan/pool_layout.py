"""The byte layout of each GPU pool: the one cost model that the planner prices and the allocator allocates.

A pool is one flat byte buffer carved into typed views. Its size is the sum of its tensors,
each starting at a VIEW_ALIGN boundary, rounded up to POOL_ALIGN: the CUDA caching allocator
reserves large blocks in 2 MiB granules, so a buffer of a multiple of 2 MiB makes the bytes the
process reserves equal the bytes we priced (DESIGN §2 rule 1). Sentinel pages and padding slots
are tensors rows like any other, so they are priced like any other.

No torch here: `ferry plan` prices pools on machines without it; `pools.py` allocates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ferry.plan.model_config import DTYPE_BYTES, ModelSpec
from ferry.shared.units import MiB, round_up

POOL_ALIGN = 2 * MiB
VIEW_ALIGN = 256

# Page 0 of the KV pool is never handed to a request: padded and masked-out positions of a
# batch write there, so a real page is never touched by a token that is not its own.
KV_SENTINEL_PAGES = 1
# One extra linear-state slot takes the writes of padded batch rows, for the same reason.
LINEAR_PADDING_SLOTS = 1
# Recurrent Gated DeltaNet state is kept in float32, as the reference implementation computes it.
LINEAR_RECURRENT_DTYPE = "float32"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class PoolLayout:
    """Named tensors packed into one flat buffer."""

    name: str
    tensors: tuple[TensorSpec, ...]

    def offsets(self) -> tuple[int, ...]:
        out, cursor = [], 0
        for t in self.tensors:
            cursor = round_up(cursor, VIEW_ALIGN)
            out.append(cursor)
            cursor += t.nbytes
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """The exact bytes the allocator takes for this pool (0 for an empty pool)."""
        if not self.tensors:
            return 0
        end = self.offsets()[-1] + self.tensors[-1].nbytes
        return round_up(end, POOL_ALIGN) if end else 0


# ---- the three pools --------------------------------------------------------------------


def kv_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """K and V of every full-attention layer for one token (linear-attention layers keep no KV)."""
    return len(spec.full_attention_layers) * 2 * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[dtype]


def kv_pool_layout(spec: ModelSpec, dtype: str, num_pages: int, page_size: int) -> PoolLayout:
    """`num_pages` usable pages plus the sentinel page(s), for every full-attention layer."""
    total_pages = num_pages + KV_SENTINEL_PAGES
    shape = (len(spec.full_attention_layers), 2, total_pages, page_size, spec.num_kv_heads, spec.head_dim)
    return PoolLayout("kv", (TensorSpec("kv", shape, dtype),))


def linear_state_bytes_per_slot(spec: ModelSpec, dtype: str) -> int:
    if not spec.linear_attention_layers:
        return 0
    return sum(t.nbytes for t in linear_state_layout(spec, dtype, 1, padding=0).tensors)


def linear_state_layout(spec: ModelSpec, dtype: str, slots: int, padding: int = LINEAR_PADDING_SLOTS) -> PoolLayout:
    """Conv and recurrent state of every Gated DeltaNet layer, for `slots` requests plus padding."""
    layers = len(spec.linear_attention_layers)
    if layers == 0:
        return PoolLayout("linear_state", ())
    total = slots + padding
    conv = TensorSpec("conv", (layers, total, spec.linear_conv_dim, spec.linear_conv_kernel_dim - 1), dtype)
    recurrent = TensorSpec(
        "recurrent",
        (layers, total, spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim),
        LINEAR_RECURRENT_DTYPE,
    )
    return PoolLayout("linear_state", (conv, recurrent))


def expert_bytes(spec: ModelSpec, dtype: str) -> int:
    """One routed expert: the fused gate+up projection and the down projection."""
    return 3 * spec.moe_intermediate_size * spec.hidden_size * DTYPE_BYTES[dtype]


def expert_slot_layout(spec: ModelSpec, dtype: str, slots: int) -> PoolLayout:
    """`slots` expert slots shared by all MoE layers: w13 = [gate; up], w2 = down."""
    h, i = spec.hidden_size, spec.moe_intermediate_size
    return PoolLayout(
        "experts",
        (TensorSpec("w13", (slots, 2 * i, h), dtype), TensorSpec("w2", (slots, h, i), dtype)),
    )
