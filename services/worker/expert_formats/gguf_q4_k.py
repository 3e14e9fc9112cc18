"""The `gguf-q4_k` expert format's worker side: a GGUF file's Q4_K blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q4_k.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q4_k import GGUF_Q4_K
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ4KExperts(GgufBlockExperts):
    plan = F.get(GGUF_Q4_K)
    name = plan.name
    scale_fields = (
        (0, 1 / 258.3),
        (2, 7.5 / 258.3),
    )  # d, dmin: 4-bit codes under random 6-bit scales and mins, centred by dmin = 7.5 d
