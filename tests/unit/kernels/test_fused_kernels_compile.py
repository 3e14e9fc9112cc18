"""The fused norm / rotary kernels, the paged attention kernels, the MoE block's kernels and the
Gated DeltaNet decode kernels compile for the H200 (sm_90) on a machine without a GPU."""

import pytest
import torch

from hopper_compile import compile_in_child


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
def test_fused_and_paged_attention_kernels_compile_for_hopper():
    results = compile_in_child("compile_fused_kernels.py")
    # 11 norm / rotary / attention kernels per dtype (paged attention's decode is split + combine, its prefill at
    # two head sizes), 8 MoE block kernels (router, marking, SiLU-and-mul, combine) per dtype, 2 Gated DeltaNet
    # decode kernels per dtype
    assert len(results) == 22 + 16 + 4
    assert sum(name.startswith("gated_deltanet_") for name in results) == 4
    assert any(name.startswith("router_topk[") for name in results)
    for name, r in results.items():
        assert "error" not in r and r["cubin"], f"{name}: {r}"
    # the long prefill's tiles hold in registers (prefill_tiles): a spill there costs every key block of 262k
    for name in (n for n in results if n.startswith("paged_attention_prefill[bf16")):
        assert results[name]["stack"] in (0, None), f"{name} spills: {results[name]}"
