"""What every layer of one forward step reads besides its input: the batch and the pools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ferry.kernels.host_to_device import to_device
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.pools import Pools


@dataclass
class StepContext:
    batch: ForwardBatch
    pools: Pools
    cos: torch.Tensor  # [T, rotary_dim], rotary tables of the batch's positions
    sin: torch.Tensor
    fresh_state_slots: torch.Tensor | None  # linear-state slots of requests starting now (to zero), or None
    linear: bool = False  # the model has linear-attention layers
    # (cos, sin) of each of the model's rotary embeddings where its layers turn differently (Gemma 4's sliding
    # and full layers), by the embedding's `table_index`; () where one embedding serves every layer
    tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # (slice tokens, rows only) -> (start, end, the slice's context) (services/worker/mixer_slices.py)
    _slices: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        batch: ForwardBatch,
        pools: Pools,
        cos: torch.Tensor,
        sin: torch.Tensor,
        linear: bool,
        tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
    ) -> "StepContext":
        """The context of `batch`, the rotary tables of its positions given (`tables`: each embedding's, where
        the layers' differ). `linear`: the model has linear-attention layers, whose starting requests' states
        are zeroed."""
        fresh = None
        if linear and batch.fresh_slots_host and not batch.mixer_slices:  # (a sliced step's slices zero their own)
            # the host knows which requests start now: most steps start none, and then no state row is
            # touched; the slots cross without the host waiting for the device
            fresh = to_device(list(batch.fresh_slots_host), torch.int64, batch.state_slots.device)
        return cls(batch, pools, cos, sin, fresh, linear, tables)

    def rotary_table(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the model's rotary embedding `index` (its `table_index`)."""
        return self.tables[index] if self.tables else (self.cos, self.sin)

    def slices(
        self, max_tokens: int | None = None, rows_only: bool = False
    ) -> tuple[tuple[int, int, "StepContext"], ...]:
        """The contexts of the batch's slices (ForwardBatch.slices), made at a layer's first ask, then kept."""
        key = (max_tokens, rows_only)
        if key not in self._slices:
            self._slices[key] = tuple(
                (
                    a,
                    b,
                    StepContext.of(
                        part,
                        self.pools,
                        self.cos[a:b],
                        self.sin[a:b],
                        self.linear,
                        tuple((c[a:b], s[a:b]) for c, s in self.tables),
                    ),
                )
                for a, b, part in self.batch.slices(max_tokens, rows_only)
            )
        return self._slices[key]

    def mix(
        self, mixer: Callable[[torch.Tensor, "StepContext"], torch.Tensor], h: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """`mixer(h, self)` of layer `layer`, over the step's slices one after another when it has them (each
        slice's K/V and linear states are written before the next one reads them, as between two steps): a ring
        layer's slices hold at most what its ring holds besides the window, a request's (pools.kv.slice_tokens),
        the others' at most MIXER_SLICE_TOKENS of the step."""
        ring = self.pools.kv.slice_tokens(layer)
        slices = self.slices(ring, rows_only=True) if ring else self.slices()
        if not slices:
            return mixer(h, self)
        out = None
        for a, b, ctx in slices:
            part = mixer(h[a:b], ctx)
            if out is None:
                out = part.new_empty(h.shape[0], part.shape[1])
            out[a:b] = part
        return out
