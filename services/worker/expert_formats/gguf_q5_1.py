"""The `gguf-q5_1` expert format's worker side: a GGUF file's Q5_1 blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q5_1.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q5_1 import GGUF_Q5_1
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ5_1Experts(GgufBlockExperts):
    plan = F.get(GGUF_Q5_1)
    name = plan.name
    scale_fields = ((0, 1 / 9.2), (2, -15.5 / 9.2))  # d, m: 5 random bits have a std of ~9.2, centred by m = -15.5 d
