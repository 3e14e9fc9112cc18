"""The `gguf-q5_0` expert format's worker side: a GGUF file's Q5_0 blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q5_0.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q5_0 import GGUF_Q5_0
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ5_0Experts(GgufBlockExperts):
    plan = F.get(GGUF_Q5_0)
    name = plan.name
    scale_fields = ((0, 1 / 9.2),)  # d: (q - 16) of 5 random bits has a std of ~9.2
