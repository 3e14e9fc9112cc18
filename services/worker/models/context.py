"""What every layer of one forward step reads besides its input: the batch and the pools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.pools import Pools


@dataclass
class StepContext:
    batch: ForwardBatch
    pools: Pools
    cos: torch.Tensor  # [T, rotary_dim], rotary tables of the batch's positions
    sin: torch.Tensor
    fresh_state_slots: torch.Tensor | None  # linear-state slots of requests starting now (to zero), or None
