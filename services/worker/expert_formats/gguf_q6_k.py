"""The `gguf-q6_k` expert format's worker side: a GGUF file's Q6_K blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_q6_k.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_q6_k import GGUF_Q6_K
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufQ6KExperts(GgufBlockExperts):
    plan = F.get(GGUF_Q6_K)
    name = plan.name
    scale_fields = ((208, 1 / 1369.0),)  # d: (q - 32) of 6 bits under random int8 scales has a std of ~1369
