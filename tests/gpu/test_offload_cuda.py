"""The offload store on a real GPU: copy stream, events, pinned banks, Triton (skipped without CUDA)."""

import pytest
import torch

from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
from ferry.plan import pool_layout as L
from ferry.plan.model_config import parse_model_config
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.slot_cache.policy import LRUExpertPolicy
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts
from ferry.services.worker.pools import ExpertSlotPool, allocate_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC = parse_model_config(
    {
        "model_type": "qwen3_moe",
        "vocab_size": 64,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "intermediate_size": 512,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
)
LAYERS, E = 4, 16


@pytest.mark.parametrize("num_slots", [16, 24, 64])
def test_offloaded_matches_all_resident_on_cuda(num_slots, cuda_device):
    banks = HostBanks.for_model(SPEC, "bfloat16", progress=False)
    assert banks.pinned
    banks.fill_dummy(seed=num_slots, progress=False)
    slots = ExpertSlotPool(allocate_pool(L.expert_slot_layout(SPEC, "bfloat16", num_slots), cuda_device))
    store = OffloadedExperts(slots, banks, LRUExpertPolicy(LAYERS, E, num_slots), cuda_device, prefill_tokens=32)
    if num_slots == LAYERS * E:
        assert store.preload() == LAYERS * E
    # every expert resident, slot = layer * E + expert: the answer the cache must give
    w13 = torch.cat([banks.w13[layer] for layer in range(LAYERS)]).cuda()
    w2 = torch.cat([banks.w2[layer] for layer in range(LAYERS)]).cuda()
    g = torch.Generator(device="cuda").manual_seed(num_slots)
    for tokens in (1, 3, 1, 200, 1, 1, 64, 1100):  # decode, prefill (chunked copies), 4400 pairs: device alignment
        for layer in range(LAYERS):
            x = torch.randn(tokens, SPEC.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
            weights, ids = torch.rand(tokens, E, device="cuda", generator=g).topk(4, dim=-1)
            got = store.forward(layer, x, ids, weights)
            want = grouped_expert_forward(x, ids + layer * E, weights, w13, w2)
            torch.testing.assert_close(got, want)  # same kernel; blocks group other tokens, so bf16 tolerance
    store.end_step()
    total = store.stats.total
    if num_slots == LAYERS * E:
        assert total.misses == 0 and total.bytes_copied == 0
    else:
        assert total.misses > 0 and total.copy_time_s > 0
        assert total.bytes_copied == total.misses * banks.expert_nbytes
        assert 0 <= total.exposed_copy_time_s
