"""The `gguf-iq4_nl` expert format's worker side: a GGUF file's IQ4_NL blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_iq4_nl.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_iq4_nl import GGUF_IQ4_NL
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufIQ4NLExperts(GgufBlockExperts):
    plan = F.get(GGUF_IQ4_NL)
    name = plan.name
    scale_fields = ((0, 1 / 67.4),)  # d: the grid's values at random indices have an rms of ~67.4
