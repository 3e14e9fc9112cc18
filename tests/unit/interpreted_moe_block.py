"""Child side of test_fused_moe_block.py (run with TRITON_INTERPRET=1 and FERRY_TRITON_ON_CPU=1): one
MoE block of a tiny model on the Triton path (fused router GEMV + router kernel, resident store
with the marks in its gate/up kernel, fused shared expert and combine) and on its plain-torch
reference; and the block's unsummed rows through the final norm against its summed output."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_harness import make_pools  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from ferry.kernels.router_topk_reference import mark_routed_reference  # noqa: E402
from ferry.services.worker.models import build_model  # noqa: E402
from ferry.services.worker.offload.stores.resident import ResidentExperts  # noqa: E402


def block_outputs(arch: str, overrides: dict, rows: int, real: int | None, seed: int) -> dict:
    hf, spec = tiny_model(arch, seed=seed, **overrides)
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    store = ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
    model = build_model(spec, torch.float32, "cpu", store)
    model.load_weights(hf.state_dict().items())
    layer = spec.moe_layer_indices[-1]
    block = model.layers[layer].mlp
    x = torch.randn(rows, spec.hidden_size, generator=torch.Generator().manual_seed(seed)) * 2
    ctx = None
    if real is not None:  # a padded batch: rows past `real` are padding
        ctx = SimpleNamespace(batch=SimpleNamespace(real_tokens=torch.tensor([real], dtype=torch.int32)))
    with torch.inference_mode():
        fused_route = block.gate(x)
        fused = block(x, ctx)
        marked = store._routed.clone()
        reference_route = block.gate.reference(x)
        reference = block.reference(x, ctx)
        # the decoder's call: the routed rows may come back unsummed, for the next norm to sum
        unsummed = block(x, ctx, summed=False)
        residual = torch.randn(rows, spec.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
        norm_of_rows = model.norm.forward_add(unsummed, residual)
        norm_of_sum = model.norm.forward_add(fused, residual)
    want_marks = torch.zeros_like(marked)
    mark_routed_reference(want_marks, block.moe_layer, reference_route[0], ctx.batch.real_tokens if ctx else None)
    return dict(
        fused=fused,
        reference=reference,
        fused_route=fused_route,
        reference_route=reference_route,
        marked=marked,
        want_marks=want_marks,
        unsummed_kind=type(unsummed).__name__,
        norm_of_rows=norm_of_rows,
        norm_of_sum=norm_of_sum,
    )
