"""The decode layer's hand-off kernel and the expert cache's lookup compile for the H200 (sm_90) on a
machine without a GPU (their semantics are held to their twins under the interpreter:
tests/unit/offload/interpreted_offload_store.py, test_device_cache.py)."""

import pytest
import torch
from hopper_compile import compile_in_child


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
def test_the_host_handoff_kernel_compiles_for_hopper():
    results = compile_in_child("compile_host_handoff.py")
    assert len(results) == 4 + 8
    for name, r in results.items():
        assert "error" not in r and r["cubin"], f"{name}: {r}"
        assert r["stack"] in (0, None), f"{name} spills: {r}"
