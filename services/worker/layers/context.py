"""What every layer of one forward step reads besides its input: the batch and the pools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    # a long step's mixer slices: (start, end, the slice's context) (services/worker/mixer_slices.py)
    slices: tuple[tuple[int, int, "StepContext"], ...] = ()
    # (cos, sin) of each of the model's rotary embeddings where its layers turn differently (Gemma 4's sliding
    # and full layers), by the embedding's `table_index`; () where one embedding serves every layer
    tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

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
        """The context of `batch` (and of each of its mixer slices), the rotary tables of its positions given.
        `linear`: the model has linear-attention layers, whose starting requests' states are zeroed."""
        fresh = None
        if linear and batch.fresh_slots_host and not batch.mixer_slices:  # (a sliced step's slices zero their own)
            # the host knows which requests start now: most steps start none, and then no state row is
            # touched; the slots cross without the host waiting for the device
            fresh = to_device(list(batch.fresh_slots_host), torch.int64, batch.state_slots.device)
        slices = tuple(
            (a, b, cls.of(part, pools, cos[a:b], sin[a:b], linear, tuple((c[a:b], s[a:b]) for c, s in tables)))
            for a, b, part in batch.mixer_slices
        )
        return cls(batch, pools, cos, sin, fresh, slices, tables)

    def rotary_table(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the model's rotary embedding `index` (its `table_index`)."""
        return self.tables[index] if self.tables else (self.cos, self.sin)

    def mix(self, mixer: Callable[[torch.Tensor, "StepContext"], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """`mixer(h, self)`, over the step's slices one after another when it has them (each slice's K/V and
        linear states are written before the next one reads them, as between two steps)."""
        if not self.slices:
            return mixer(h, self)
        out = None
        for a, b, ctx in self.slices:
            part = mixer(h[a:b], ctx)
            if out is None:
                out = part.new_empty(h.shape[0], part.shape[1])
            out[a:b] = part
        return out
