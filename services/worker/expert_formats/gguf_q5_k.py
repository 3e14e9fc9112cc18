"""The `gguf-q5_k` expert format's worker side: a GGUF file's Q5_K blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q5_k.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q5_k import GGUF_Q5_K
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ5KExperts(GgufBlockExperts):
    plan = F.get(GGUF_Q5_K)
    name = plan.name
    scale_fields = (
        (0, 1 / 527.0),
        (2, 15.5 / 527.0),
    )  # d, dmin: 5-bit codes under random 6-bit scales and mins, centred by dmin = 15.5 d
