"""On a CUDA device the pools take exactly the bytes the planner priced (allocator counters)."""

import pytest
import torch

from ferry.plan.model_config import load_model_config
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.worker.pools import allocate_pools
from tests.helpers import QWEN3_6_35B

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_allocated_equals_priced_on_cuda(cuda_device):
    spec = load_model_config(QWEN3_6_35B)
    plan = make_plan(
        spec,
        PlanRequest(gpu_memory=8 * 2**30, max_model_len=8192, max_running_requests=8, moe_cache_size=300),
        Measured(0, 0),
    )
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # blocks cached by earlier tests would hide what the pools reserve
    before_alloc, before_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    pools = allocate_pools(spec, plan, cuda_device)
    torch.cuda.synchronize()
    priced = plan.kv.bytes + plan.linear_state.bytes + plan.linear_state_snapshots.bytes + plan.experts.bytes
    assert plan.linear_state_snapshots.snapshots > 0  # the prefix cache's snapshots: a pool of their own, as priced
    assert torch.cuda.memory_allocated() - before_alloc == priced
    # 2 MiB granules: nothing reserved beyond. Segments that an earlier test's live tensors keep (empty_cache
    # cannot free them) may lend their free bytes to the pools, which then reserve that much less.
    lent = before_reserved - before_alloc
    assert priced - lent <= torch.cuda.memory_reserved() - before_reserved <= priced
    del pools
