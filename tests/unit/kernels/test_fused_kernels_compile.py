"""The fused norm / rotary kernels and the paged attention kernels compile for the H200 (sm_90) on a
machine without a GPU."""

import pytest
import torch

from hopper_compile import compile_in_child


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
def test_fused_and_paged_attention_kernels_compile_for_hopper():
    results = compile_in_child("compile_fused_kernels.py")
    assert len(results) == 18
    for name, r in results.items():
        assert "error" not in r and r["cubin"], f"{name}: {r}"
