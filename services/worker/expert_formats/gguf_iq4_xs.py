"""The `gguf-iq4_xs` expert format's worker side: a GGUF file's IQ4_XS blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_iq4_xs.py prices its rows)."""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_iq4_xs import GGUF_IQ4_XS
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts


class GgufIQ4XSExperts(GgufBlockExperts):
    plan = F.get(GGUF_IQ4_XS)
    name = plan.name
    scale_fields = ((0, 1 / 1246.0),)  # d: grid values under random 6-bit scales (minus 32) have an rms of ~1246
