"""The `gguf-q8_0` expert format's worker side: a GGUF file's Q8_0 blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q8_0.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q8_0 import GGUF_Q8_0
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ8_0Experts(GgufBlockExperts):
    plan = F.get(GGUF_Q8_0)
    name = plan.name
    scale_fields = ((0, 1 / 73.9),)  # d: int8 codes have a std of ~73.9
