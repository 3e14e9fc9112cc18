"""KV layer groups: the softmax-attention layers whose K/V share one shape and one way of being kept.

Layers group by (kv heads, head_dim, window): each group is one tensor of the KV pool
(pool_layout.kv_pool_layout), priced by its own bytes per token. Full-attention groups come first, in layer order.
The MTP draft layers of `--speculative-method mtp` (spec.mtp_kv_layers, plan/mtp_layer.py) are full-attention
layers of the target's head shape numbered on from the decoder's (num_layers, ...): paged with the request's
pages, as the target's full layers.

A full-attention group (window 0) is paged over the context: the scheduler's page ids (KvPagePool), one page
table a request, as every layer once was.

A sliding group (window W > 0: a token sees itself and the W - 1 keys before it) keeps per running request a
ring of `ring_pages(W, slice_tokens, page_size)` pages, reused as the sequence grows: position p lives in ring
page (p // page_size) mod ring_pages of the request's slot (`ring_page`), so the ring's rows are the positions
modulo ring_pages x page_size. A ring layer runs over a step's tokens in sliding slices of at most
`slice_tokens` (`sliding_slice_tokens`: SLIDING_SLICE_TOKENS, or the prefill chunk where smaller;
services/worker/mixer_slices.py), each slice writing its new K/V and then attending before the next one writes,
so the ring holds, without two positions on one row, every key one slice reads or writes: from the oldest key
its first token sees to its last token, W - 1 + slice_tokens positions. A slice is at most that many tokens of
the step, so of any request in it (a cut inside a request continues it in the next slice, as a later chunk
would); decode steps (a token a request) are never cut. The rings belong to request slots, as the linear
states do (ids 1..max_running_requests, handed out at admission, so a running request always has one; slot 0
is the padding rows' ring), so they take no page from the scheduler and never run short under load.

A ring is taken only where it is smaller than the group paged over the context (`uses_ring`): (slots + 1) rings
against the context's pages + the sentinel. Elsewhere the sliding group is paged over the context with the full
layers' page ids (its window then only masks keys, as a full group's context pool) and runs over the whole
step. So a ring never costs more than before, and `--num-tokens`, `--num-pages`, `--kv-reserve-tokens` and
`max_model_len` count the context's tokens, the full groups' (and a paged sliding group's).

No torch here (`ferry plan` prices groups without it)."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.plan.model_spec import FULL_ATTENTION, ModelSpec
from ferry.shared.units import ceil_div

# The most tokens of a step a ring layer writes before attending (services/worker/mixer_slices.py): 512 rows
# still give a data-centre GPU's SMs tiles enough in the layer's GEMMs (gpt-oss's q/k/v: 4 x 40 tiles of 128)
# while a ring stays within W - 1 + 512 positions, 16x fewer than an 8,192-token chunk's.
SLIDING_SLICE_TOKENS = 512


@dataclass(frozen=True)
class KvGroup:
    layers: tuple[int, ...]  # the model's layer indices, in order
    kv_heads: int
    head_dim: int
    window: int  # 0: full attention; else the keys a token attends to, itself included

    @property
    def sliding(self) -> bool:
        return self.window > 0


def kv_groups(spec: ModelSpec) -> tuple[KvGroup, ...]:
    """The softmax-attention layers grouped by (kv heads, head_dim, window): the full-attention groups first,
    then the sliding ones, each in the order of its first layer."""
    members: dict[tuple[int, int, int], list[int]] = {}
    for layer, kind in enumerate(spec.layer_types):
        if kind == FULL_ATTENTION:
            key = (spec.layer_kv_heads(layer), spec.layer_head_dim(layer), spec.attention_window(layer))
            members.setdefault(key, []).append(layer)
    for i in range(spec.mtp_kv_layers):  # the MTP draft layers' own K/V (their attention is full attention)
        members.setdefault((spec.num_kv_heads, spec.head_dim, 0), []).append(spec.num_layers + i)
    groups = [KvGroup(tuple(layers), *key) for key, layers in members.items()]
    return tuple(sorted(groups, key=lambda g: (g.sliding, g.layers[0])))


def sliding_slice_tokens(step_tokens: int) -> int:
    """The most new tokens of a request a ring layer writes before attending, in steps of at most
    `step_tokens` (the prefill chunk): a sliding slice, or the whole step where that is shorter."""
    return min(step_tokens, SLIDING_SLICE_TOKENS)


def ring_pages(window: int, slice_tokens: int, page_size: int) -> int:
    """Pages of one request's ring: room for the window - 1 keys before a slice's first new token and the
    slice's slice_tokens new ones, all at once (a ring's rows are positions modulo its pages x page_size)."""
    return ceil_div(window - 1 + slice_tokens, page_size)


def ring_page(slot: int, position: int, pages: int, page_size: int) -> int:
    """The ring's page (within its group's tensor) that holds `position` of the request in `slot`: the kernels
    (kernels/paged_attention*.py) and the K/V writes compute the same."""
    return slot * pages + (position // page_size) % pages


def uses_ring(group: KvGroup, context_rows: int, ring_slots: int, slice_tokens: int, page_size: int) -> bool:
    """A sliding group takes rings (one per request slot and the padding slot) where they are fewer pages than
    `context_rows`, the pages it would have paged over the context (sentinel included); never without request
    slots (ring_slots 0) or a slice to hold."""
    if not group.sliding or ring_slots <= 0 or slice_tokens <= 0:
        return False
    return (ring_slots + 1) * ring_pages(group.window, slice_tokens, page_size) < context_rows
