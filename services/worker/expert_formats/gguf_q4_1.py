"""The `gguf-q4_1` expert format's worker side: a GGUF file's Q4_1 blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q4_1.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q4_1 import GGUF_Q4_1
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ4_1Experts(GgufBlockExperts):
    plan = F.get(GGUF_Q4_1)
    name = plan.name
    scale_fields = ((0, 1 / 4.6), (2, -7.5 / 4.6))  # d, m: 4 random bits have a std of ~4.6, centred by m = -7.5 d
