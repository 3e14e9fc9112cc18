"""The `gguf-q4_0` expert format's worker side: a GGUF file's Q4_0 blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q4_0.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q4_0 import GGUF_Q4_0
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ4_0Experts(GgufBlockExperts):
    plan = F.get(GGUF_Q4_0)
    name = plan.name
    scale_fields = ((0, 1 / 4.6),)  # d: (q - 8) of 4 random bits has a std of ~4.6
