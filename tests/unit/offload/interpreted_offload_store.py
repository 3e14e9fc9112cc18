"""The offload store computing with the Triton kernels (the CUDA path's bookkeeping: the pair-by-pair
kernel for small steps, host or device alignment for larger ones) under TRITON_INTERPRET=1, against
the all-resident store on its own Triton path (FERRY_TRITON_ON_CPU=1), run in the interpreted child process
(tests/unit/interpreted_triton.py: triton decides at import whether to interpret) by test_expert_cache.py, one
check (CHECKS) a call of `run_check`. Small steps must agree bit for bit, as on the GPU. Run as a script, it runs
the check its argument names and prints JSON: null or the failure."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
assert os.environ.get("FERRY_TRITON_ON_CPU") == "1", "run me with FERRY_TRITON_ON_CPU=1"

from tests.triton_interpreter_patch import install as install_interpreter_patch  # noqa: E402

install_interpreter_patch()

from ferry.services.worker.offload.host_memory.host_banks import HostBanks  # noqa: E402
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks  # noqa: E402
from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy  # noqa: E402
from ferry.services.worker.offload.slot_cache.policy import LRUExpertPolicy  # noqa: E402
from ferry.services.worker.offload.stores.device_driven import DeviceDrivenExperts  # noqa: E402
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts  # noqa: E402
from ferry.services.worker.offload.stores.resident import ResidentExperts  # noqa: E402
from tests.unit.offload.offload_tiny import (  # noqa: E402
    assert_rows_agree,
    random_experts,
    random_routing,
    slot_pool,
    tiny_spec,
)


def check() -> None:
    spec = tiny_spec(layers=2, experts=6, top_k=3, hidden=32, inter=16)
    layers = 2
    for num_slots, host_align_max_pairs in ((6, 4096), (9, 16)):  # 16: steps of 30 tokens align on the device
        resident = ResidentExperts(slot_pool(spec, layers * 6), layers, 6)
        store = OffloadedExperts(
            slot_pool(spec, num_slots),
            HostBanks.for_model(spec, "float32", progress=False),
            LRUExpertPolicy(layers, 6, num_slots),
            "cpu",
            pipeline_chunks=2,
            prefill_tokens=8,
            use_triton=True,
            host_align_max_pairs=host_align_max_pairs,
        )
        for (layer, e), weights in random_experts(spec, num_slots).items():
            resident.load_expert(layer, e, *weights)
            store.load_expert(layer, e, *weights)
        g = torch.Generator().manual_seed(num_slots)
        for tokens in (1, 2, 30, 1):  # decode (pair by pair), and 30 tokens: grouped, misses in two chunks
            for layer in range(layers):
                x, ids, w = random_routing(spec, tokens, g)
                got = store.forward(layer, x, ids, w)
                assert_rows_agree(got, resident.forward(layer, x, ids, w), ids.numel(), 1e-5, f"{tokens} tokens")
        store.end_step()
        assert store.stats.total.misses > 0


# (slots, policy, prefetch, copy_engine_tokens, dtype): prefetch off and on, both policies with it, both copy paths,
# both bank kinds (LRU with prefetch is a bfloat16 case: each case costs ~10 s of CPU interpreted)
DEVICE_DRIVEN_CASES = (
    (6, LRUExpertPolicy, False, None, "float32"),
    (8, LFUExpertPolicy, True, None, "float32"),
    (7, LFUExpertPolicy, True, 2, "float32"),  # 2: every step of 2+ tokens takes the copy-engine path
    (7, LFUExpertPolicy, True, None, "bfloat16"),
    (6, LRUExpertPolicy, True, 2, "bfloat16"),
)


def check_device_driven(dtype_wanted: str) -> None:
    """The device-driven store (lookup, copies and prefetch by kernels) against the all-resident
    store: bit for bit on decode steps (padded ones included), prefetch on and off, both policies,
    plain float32 banks and packed bf16 ones (every copy path then unpacks), the cases of one dtype."""
    spec = tiny_spec(layers=3, experts=6, top_k=2, hidden=32, inter=16)
    layers = 3
    # cases of one slot count seed the same weights and routing: the all-resident rows of a step's layer are
    # computed for the first and kept for the others (the same inputs, checked)
    references: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
    for num_slots, policy_cls, prefetch, copy_engine_tokens, dtype in DEVICE_DRIVEN_CASES:
        if dtype != dtype_wanted:
            continue
        torch_dtype = getattr(torch, dtype)
        banks_kind = PackedHostBanks if dtype == "bfloat16" else HostBanks
        resident = ResidentExperts(slot_pool(spec, layers * 6, dtype=dtype), layers, 6)
        store = DeviceDrivenExperts(
            slot_pool(spec, num_slots, dtype=dtype, max_step_tokens=48),
            banks_kind.for_model(spec, dtype, progress=False),
            policy_cls(layers, 6, num_slots),
            "cpu",
            prefetch=prefetch,
            pipeline_chunks=2,
            copy_engine_tokens=copy_engine_tokens,
        )
        for (layer, e), weights in random_experts(spec, num_slots).items():
            resident.load_expert(layer, e, *weights)
            store.load_expert(layer, e, *weights)
        g = torch.Generator().manual_seed(num_slots)
        store.set_routers([torch.randn(6, 32, generator=g).to(torch_dtype) for _ in range(layers)])
        store.preload()
        # 20 tokens: the large path; 40 and 36 (past the pair kernel, 4+ pairs per expert): prefills,
        # streamed through the staging ring. `begun`: the executor's begin_step ran first (an eager
        # step): a prefill's copies start there, and its first layer must not stage them again
        for step, (tokens, real, begun) in enumerate(
            (
                (1, 1, False),
                (4, 4, True),
                (4, 2, False),
                (20, 20, True),
                (40, 40, False),
                (1, 1, False),
                (36, 33, False),
                (40, 40, True),
                (3, 3, False),
            )
        ):
            maps = store.cache.slot_of.clone() if store.cache is not None else None
            staged = store.ring.staged_total
            if begun:
                store.begin_step(tokens, spec.num_experts_per_tok)
                assert (store.ring.staged_total > staged) == (tokens >= 33), "only a prefill starts its copies"
            for layer in range(layers):
                x, ids, w = random_routing(spec, tokens, g)
                x = x.to(torch_dtype)
                got = store.forward(layer, x, ids, w, n_rows=torch.tensor([real], dtype=torch.int32))
                kept = references.get((num_slots, step, layer))
                if kept is None or not all(torch.equal(a, b) for a, b in zip(kept, (x, ids, w))):
                    kept = references[num_slots, step, layer] = (x, ids, w, resident.forward(layer, x, ids, w).clone())
                tol = 1e-5 if dtype == "float32" else 2e-2
                assert_rows_agree(got[:real], kept[3][:real], ids.numel(), tol, f"{tokens} tokens ({real} real)")
            if tokens >= 33:  # streamed: every non-resident expert staged once, nothing placed
                assert torch.equal(store.cache.slot_of, maps)
                assert store.ring.staged_total - staged == int((maps < 0).sum())
            store.stats_to_host()
            store.end_step()
        total = store.stats.total
        assert total.misses > 0 and total.hits + total.misses > 0
        assert (total.prefetched > store.ring.staged_total > 0) == prefetch, total  # the staged count as prefetched
        assert total.bytes_copied == (total.misses + total.prefetched) * store.banks.expert_nbytes
        if prefetch:
            assert total.prefetch_useful + total.prefetch_wasted > 0


def check_device_driven_biased() -> None:
    """gpt-oss's experts (biases in rows after the weights, the clamped SwiGLU) through the device-driven store:
    the bias rows cross with every copy, prefetch and streamed prefill, and the kernels add them, equal to the
    all-resident store bit for bit on decode steps."""
    import dataclasses

    from ferry.plan.model_spec import CLAMPED_SWIGLU
    from ferry.services.worker.expert_formats import expert_format_for
    from ferry.services.worker.expert_formats.expert_shapes import ExpertBias

    plain = tiny_spec(layers=3, experts=6, top_k=2, hidden=32, inter=16)
    biased = dict(expert_bias=True, expert_activation=CLAMPED_SWIGLU, swiglu_alpha=1.702, swiglu_limit=1.0)
    spec = dataclasses.replace(plain, **biased)
    layers, fmt = 3, expert_format_for(spec, torch.float32)
    resident = ResidentExperts(slot_pool(spec, layers * 6, fmt=fmt), layers, 6)
    store = DeviceDrivenExperts(
        slot_pool(spec, 7, max_step_tokens=48, fmt=fmt),
        HostBanks.for_model(spec, "float32", progress=False),
        LFUExpertPolicy(layers, 6, 7),
        "cpu",
        prefetch=True,
        pipeline_chunks=2,
    )
    g = torch.Generator().manual_seed(11)
    for (layer, e), weights in random_experts(spec, 7).items():
        bias = ExpertBias(0.5 * torch.randn(32, generator=g), 0.5 * torch.randn(32, generator=g))
        resident.load_expert(layer, e, *weights, bias)
        store.load_expert(layer, e, *weights, bias)
    store.set_routers([torch.randn(6, 32, generator=g) for _ in range(layers)])
    store.preload()
    for tokens in (1, 3, 20, 40, 1):
        for layer in range(layers):
            x, ids, w = random_routing(spec, tokens, g)
            got = store.forward(layer, x, ids, w, n_rows=torch.tensor([tokens], dtype=torch.int32))
            assert_rows_agree(got, resident.forward(layer, x, ids, w), ids.numel(), 1e-5, f"{tokens} tokens")
        store.stats_to_host()
        store.end_step()
    assert store.stats.total.misses > 0 and store.ring.staged_total > 0


def check_device_driven_mixed() -> None:
    """A GGUF Q4_K_M mix (w2 Q4_K on MoE layer 0, Q6_K on layer 1; every slot, bay and bank row sized for the
    larger) through the device-driven store: each layer's rows read in its own types on decode steps (the pair
    kernel), the large path, streamed prefills through the ring's bays and through cache slots lent to a long
    prefill, equal to the all-resident store (bit for bit where both take the pair kernel). The interpreter takes
    ~1 s a token-expert pair or a 40-token layer here, so the steps are few."""
    from ferry.services.worker.expert_formats import expert_format_for

    layers, experts, num_slots = 2, 4, 5
    mix = {"quant_method": "gguf", "ggml_type": "mixed", "expert_types": [["Q4_K", "Q4_K"], ["Q4_K", "Q6_K"]]}
    spec = tiny_spec(layers=layers, experts=experts, top_k=2, hidden=256, inter=256, quantization=mix)
    fmt = expert_format_for(spec, torch.float32)
    assert fmt.views_per_layer
    resident = ResidentExperts(slot_pool(spec, layers * experts, fmt=fmt), layers, experts)
    resident.fill_dummy(seed=3)
    banks = HostBanks.for_model(spec, "float32", progress=False)
    banks.fill_dummy(seed=3, progress=False)
    store = DeviceDrivenExperts(
        slot_pool(spec, num_slots, max_step_tokens=48, fmt=fmt),
        banks,
        LRUExpertPolicy(layers, experts, num_slots),
        "cpu",
        prefetch=True,
        pipeline_chunks=2,
        copy_engine_tokens=3,  # a 3-token step takes the large path (copy-engine copies, then its pairs)
    )
    g = torch.Generator().manual_seed(4)
    store.set_routers([torch.randn(experts, 256, generator=g) for _ in range(layers)])
    store.preload()
    store.attention_period = 1
    lend = store._slots_to_lend()
    assert lend > 0, "no cache slot lent: the lent bays' per-layer views untested"
    for tokens, long_context in ((1, False), (40, False), (3, False), (40, True), (1, False)):
        store.begin_step(tokens, 2, long_context=long_context)
        for layer in range(layers):
            x, ids, w = random_routing(spec, tokens, g)
            got = store.forward(layer, x, ids, w, n_rows=torch.tensor([tokens], dtype=torch.int32))
            want = resident.forward(layer, x, ids, w)
            assert_rows_agree(got, want, ids.numel(), 1e-4, f"{tokens} tokens, MoE layer {layer}")
        store.stats_to_host()
        store.end_step()
    assert store.stats.total.misses > 0 and store.ring.staged_total > 0 and store.ring.lent_total > 0


def check_prefetch_follows_the_router_bias() -> None:
    """The next-layer prediction applies the router's logit bias (gpt-oss's routers have one): with zero router
    weights and a bias on experts 4 and 5 of layer 1, a decode step of layer 0 prefetches exactly those."""
    spec = tiny_spec(layers=2, experts=6, top_k=2, hidden=32, inter=16)
    store = DeviceDrivenExperts(
        slot_pool(spec, 8),
        HostBanks.for_model(spec, "float32", progress=False),
        LFUExpertPolicy(2, 6, 8),
        "cpu",
        prefetch=True,
        pipeline_chunks=2,
    )
    for (layer, e), weights in random_experts(spec, 1).items():
        store.load_expert(layer, e, *weights)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0])
    store.set_routers([torch.zeros(6, 32) for _ in range(2)], [torch.zeros(6), bias])
    store.preload()  # 8 slots: layer 0's six experts and layer 1's first two
    assert (store.cache.slot_of[1, [4, 5]] < 0).all()
    g = torch.Generator().manual_seed(2)
    x, ids, w = random_routing(spec, 1, g)
    store.forward(0, x, ids, w, n_rows=torch.tensor([1], dtype=torch.int32))
    assert (store.cache.slot_of[1, [4, 5]] >= 0).all(), "the biased experts of layer 1 were not prefetched"
    store.stats_to_host()
    store.end_step()
    assert store.stats.total.prefetched == 2


def check_host_share() -> None:
    """Streamed prefills with the host computing half of every layer's missed experts
    (offload/host_compute/prefill_share.py): the same rows as the all-resident store, in float32; the ring stages
    only the rest."""
    from ferry.services.worker.offload.host_compute.host_experts import HostExperts
    from ferry.services.worker.offload.host_compute.prefill_share import HostCost, HostShare

    spec = tiny_spec(layers=3, experts=6, top_k=2, hidden=32, inter=16)
    layers = 3
    resident = ResidentExperts(slot_pool(spec, layers * 6), layers, 6)
    banks = HostBanks.for_model(spec, "float32", progress=False)
    share = HostShare(
        HostExperts(banks, torch.float32, threads=1), HostCost(1.0, 1.0, 0.0, 0.0), max_tokens=48, top_k=2, device="cpu"
    )
    store = DeviceDrivenExperts(
        slot_pool(spec, 7, max_step_tokens=48),
        banks,
        LFUExpertPolicy(layers, 6, 7),
        "cpu",
        prefetch=True,
        pipeline_chunks=2,
        host_share=share,
    )
    for (layer, e), weights in random_experts(spec, 7).items():
        resident.load_expert(layer, e, *weights)
        store.load_expert(layer, e, *weights)
    g = torch.Generator().manual_seed(3)
    store.set_routers([torch.randn(6, 32, generator=g) for _ in range(layers)])
    store.preload()
    for tokens, real in ((40, 40), (1, 1), (36, 33), (40, 40)):
        maps = store.cache.slot_of.clone()
        staged = store.ring.staged_total
        for layer in range(layers):
            x, ids, w = random_routing(spec, tokens, g)
            got = store.forward(layer, x, ids, w, n_rows=torch.tensor([real], dtype=torch.int32))
            torch.testing.assert_close(got[:real], resident.forward(layer, x, ids, w)[:real], rtol=1e-5, atol=1e-5)
        if tokens >= 33:  # streamed: half of each layer's missed experts (rounded down) staged, the rest the host's
            missed = (maps < 0).sum(dim=1)
            assert store.ring.staged_total - staged == int((missed - missed // 2).sum())
            assert all(len(h) == m // 2 for h, m in zip(store._host_experts, missed.tolist()))
        store.stats_to_host()
        store.end_step()
    assert share.layers > 0 and share.computed > 0
    assert store.report()["host_share"] == {
        "layers": share.layers,
        "experts": share.computed,
        "costs_ns": [1_000_000_000, 1_000_000_000, 0, 0],
    }
    share.close()


def _long_steps_take_their_rows(store, module, resident, spec, g, steps) -> None:
    """`steps` ((tokens, rows dtype wanted), ...) through every layer of `store`: each layer's rows in the dtype
    wanted (read where `module`, the store's, finishes them) and its output within rounding of the all-resident
    store with float32 rows (bf16 rows are one rounding of each, within bf16's own tolerance)."""
    import ferry.kernels.expert_rows_sum as rows_sum

    finished, finish = [], module.finish_rows

    def record_finish(rows, dtype, summed=True):
        finished.append(rows.dtype)
        return finish(rows, dtype, summed)

    module.finish_rows = record_finish
    try:
        for tokens, rows_wanted in steps:
            for layer in range(len(spec.moe_layer_indices)):
                x, ids, w = random_routing(spec, tokens, g)
                x = x.to(torch.bfloat16)
                finished.clear()
                got = store.forward(layer, x, ids, w, n_rows=torch.tensor([tokens], dtype=torch.int32))
                assert finished == [rows_wanted], f"{tokens} tokens: rows in {finished}, not {rows_wanted}"
                threshold, rows_sum.ROWS_FLOAT32_MAX_TOKENS = rows_sum.ROWS_FLOAT32_MAX_TOKENS, 10**6
                want = resident.forward(layer, x, ids, w)  # float32 rows: the reference
                rows_sum.ROWS_FLOAT32_MAX_TOKENS = threshold
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            store.stats_to_host()
            store.end_step()
    finally:
        module.finish_rows = finish


def check_long_step_rows() -> None:
    """A step past ROWS_FLOAT32_MAX_TOKENS (36 here, 8,192 in service) writes its expert rows in the model's
    dtype (kernels/expert_rows_sum.py), in both offloading stores. The device-driven one: a 40-token bf16
    prefill streamed with the host computing half of each layer's misses takes bf16 rows, a 36-token one
    float32 rows, and boot's warm-up (a padding-only streamed step) compiles the chunks' kernels and the row
    sum into both row dtypes, since a step that long fits the store. The host-driven one (OffloadedExperts):
    the same two lengths, misses copied in two chunks. All within rounding of the all-resident store with
    float32 rows."""
    import ferry.kernels.expert_rows_sum as rows_sum
    import ferry.services.worker.offload.stores.device_driven as device_store
    import ferry.services.worker.offload.stores.offloaded as expert_cache
    from ferry.kernels.aligned_blocks import SLOT_WINDOW_ALL
    from ferry.services.worker.offload.host_compute.host_experts import HostExperts
    from ferry.services.worker.offload.host_compute.prefill_share import HostCost, HostShare

    spec = tiny_spec(layers=2, experts=6, top_k=2, hidden=32, inter=16)
    layers, bf16 = 2, torch.bfloat16
    resident = ResidentExperts(slot_pool(spec, layers * 6, dtype="bfloat16"), layers, 6)
    banks = HostBanks.for_model(spec, "bfloat16", progress=False)
    share = HostShare(
        HostExperts(banks, bf16, threads=1), HostCost(1.0, 1.0, 0.0, 0.0), max_tokens=48, top_k=2, device="cpu"
    )
    store = DeviceDrivenExperts(
        slot_pool(spec, 7, dtype="bfloat16", max_step_tokens=48),
        banks,
        LFUExpertPolicy(layers, 6, 7),
        "cpu",
        prefetch=True,
        pipeline_chunks=2,
        host_share=share,
    )
    host_driven = OffloadedExperts(
        slot_pool(spec, 7, dtype="bfloat16"),
        banks,
        LRUExpertPolicy(layers, 6, 7),
        "cpu",
        pipeline_chunks=2,
        prefill_tokens=8,
        use_triton=True,
    )
    for (layer, e), weights in random_experts(spec, 7).items():
        for s in (resident, store, host_driven):
            s.load_expert(layer, e, *weights)
    g = torch.Generator().manual_seed(5)
    store.set_routers([torch.randn(6, 32, generator=g).to(bf16) for _ in range(layers)])
    store.preload()
    launched, summed_rows = [], []
    kernel, row_sum = device_store.grouped_expert_rows_triton, device_store.sum_rows

    def record_launch(x, topk_slots, weights, w13, w2, rows, *args, **kwargs):
        launched.append((rows.dtype, kwargs.get("slot_window", SLOT_WINDOW_ALL)))
        return kernel(x, topk_slots, weights, w13, w2, rows, *args, **kwargs)

    def record_sum(rows, dtype):
        summed_rows.append(rows.dtype)
        return row_sum(rows, dtype)

    rows_sum.ROWS_FLOAT32_MAX_TOKENS = device_store.ROWS_FLOAT32_MAX_TOKENS = 36
    device_store.grouped_expert_rows_triton, device_store.sum_rows = record_launch, record_sum
    try:
        x, ids, w = random_routing(spec, 40, g)
        store.forward(0, x.to(bf16), ids, w, n_rows=torch.tensor([0], dtype=torch.int32))  # boot's warm-up step
        store.stats_to_host()
        store.end_step()
        windowed = {dtype for dtype, window in launched if window != SLOT_WINDOW_ALL}
        assert windowed == {torch.float32, bf16}, f"the warm-up compiled the chunks' kernels into {windowed}"
        assert set(summed_rows) == {torch.float32, bf16}, f"the warm-up summed rows of {summed_rows}"
        steps = ((40, bf16), (36, torch.float32), (40, bf16))
        _long_steps_take_their_rows(store, device_store, resident, spec, g, steps)
        assert share.layers > 0 and share.computed > 0, "the host computed nothing: its fold into bf16 rows untested"
        _long_steps_take_their_rows(host_driven, expert_cache, resident, spec, g, steps)
        assert host_driven.stats.total.misses > 0
    finally:
        rows_sum.ROWS_FLOAT32_MAX_TOKENS = device_store.ROWS_FLOAT32_MAX_TOKENS = 8192
        device_store.grouped_expert_rows_triton, device_store.sum_rows = kernel, row_sum
        share.close()


def check_host_decode_kernel() -> None:
    """The hand-off kernel (kernels/expert_host_handoff.py) against its torch twin on random lookups:
    the same maps, miss slots, count, host pair list, flags, meta and totals."""
    from types import SimpleNamespace

    from ferry.kernels.expert_host_handoff import hand_to_host, hand_to_host_reference
    from ferry.services.worker.offload.host_compute.decode_share import HostDecodeBuffers

    g = torch.Generator().manual_seed(5)
    experts, slots, layers, k = 12, 9, 2, 3
    handed, restored = [], []
    for trial in range(12):
        t = int(torch.randint(1, 6, (1,), generator=g))
        real = int(torch.randint(1, t + 1, (1,), generator=g))
        layer = trial % layers
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
        weights = torch.rand(t, k, generator=g)
        wanted = torch.unique(ids[:real])
        missed = wanted[torch.rand(len(wanted), generator=g) < 0.7]  # the rest hit
        slot_of = torch.full((layers, experts), -1, dtype=torch.int32)
        free = torch.randperm(slots, generator=g)
        slot_of[layer, wanted] = free[: len(wanted)].to(torch.int32)
        layer_of_slot = torch.full((slots,), -1, dtype=torch.int32)
        expert_of_slot = torch.full((slots,), -1, dtype=torch.int32)
        layer_of_slot[free[: len(wanted)]] = layer
        expert_of_slot[free[: len(wanted)]] = wanted.to(torch.int32)
        # what the lookup evicted for each slot: a resident expert of the other layer (its map entry freed),
        # or nothing (the slot was free)
        evicted = torch.full((slots,), -1, dtype=torch.int32)
        for slot in free[: len(wanted)].tolist():
            if bool(torch.rand(1, generator=g) < 0.5):
                evicted[slot] = (1 - layer) * experts + int(torch.randint(0, experts, (1,), generator=g))
        misses = torch.zeros(experts, 2, dtype=torch.int32)
        misses[: len(missed), 0] = missed.to(torch.int32)
        misses[: len(missed), 1] = slot_of[layer, missed]
        flat = ids.reshape(-1)
        miss_slots = torch.where(
            torch.isin(flat, missed) & (torch.arange(t * k) < real * k), slot_of[layer, flat], -1
        ).to(torch.int32)
        costs = torch.randint(1, 400, (4,), generator=g)
        # experts the layer's prefetch already put on the link (none on every third trial)
        in_flight = torch.tensor(
            [0 if trial % 3 == 0 else int(torch.randint(0, 4, (1,), generator=g))], dtype=torch.int32
        )
        runs = []
        for fn in (hand_to_host, hand_to_host_reference):
            cache = SimpleNamespace(
                slot_of=slot_of.clone(),
                layer_of_slot=layer_of_slot.clone(),
                expert_of_slot=expert_of_slot.clone(),
                num_experts=experts,
                expert_flags=torch.zeros(experts, dtype=torch.int8),
                evicted=evicted.clone(),
                evicted_stamp=torch.arange(slots, dtype=torch.int64) * 7,
                stamp=torch.arange(slots, dtype=torch.int64) + 100,
                counters=torch.full((8,), 50, dtype=torch.int64),
            )
            out = HostDecodeBuffers.make(t * k, torch.device("cpu"))
            ms, count = miss_slots.clone(), torch.tensor([len(missed)], dtype=torch.int32)
            fn(
                ids,
                weights,
                torch.tensor([real], dtype=torch.int32),
                ms,
                misses,
                count,
                in_flight,
                cache,
                layer,
                costs,
                out,
            )
            n = int(out.meta[1])
            runs.append(
                [
                    cache.slot_of,
                    cache.layer_of_slot,
                    cache.expert_of_slot,
                    cache.expert_flags,
                    cache.stamp,
                    cache.counters,
                    ms,
                    count,
                    out.host_pairs,
                    out.pair_token[:n],
                    out.pair_expert[:n],
                    out.pair_weight[:n],
                    out.meta,
                    out.totals,
                ]
            )
        for got, want in zip(*runs):
            assert torch.equal(got, want), (trial, got, want)
        handed.append(int(runs[0][-1][0]))
        restored.append(50 - int(runs[0][5][3]))  # evictions given back
    assert 0 < sum(h > 0 for h in handed) < len(handed), handed  # some layers split, some not
    assert sum(restored) > 0, restored  # and some handed slots went back to what they held


def check_host_decode(poll: bool = False, min_tokens: int = 1) -> None:
    """Decode steps with the host computing all but one of each layer's missed experts
    (offload/host_compute/decode_share.py, through the C host node, or with `poll` through the polling thread,
    host_handoff.py): the same rows as
    the all-resident store in float32, with prefills streamed between them; what crosses PCIe is counted
    without the host's experts. `min_tokens`: launches of fewer rows hand the host nothing (auto's choice where
    a single stream's misses do not pay for a hand-off), and their prefetch copies every predicted expert."""
    from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare
    from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel

    spec = tiny_spec(layers=3, experts=6, top_k=2, hidden=32, inter=16)
    layers = 3
    resident = ResidentExperts(slot_pool(spec, layers * 6), layers, 6)
    banks = HostBanks.for_model(spec, "float32", progress=False)
    experts = random_experts(spec, 7)
    for (layer, e), weights in experts.items():
        resident.load_expert(layer, e, *weights)
    g = torch.Generator().manual_seed(4)
    routers = [torch.randn(6, 32, generator=g) for _ in range(layers)]

    def offloaded() -> DeviceDrivenExperts:
        store = DeviceDrivenExperts(
            slot_pool(spec, 7, max_step_tokens=48),
            banks,
            LRUExpertPolicy(layers, 6, 7),
            "cpu",
            prefetch=True,
            pipeline_chunks=2,
        )
        for (layer, e), weights in experts.items():
            store.load_expert(layer, e, *weights)
        store.set_routers(routers)
        store.preload()
        return store

    store = offloaded()
    # a copy costs 1000 ns, the host nothing: of m misses the host takes m - 1
    store.host_decode = HostDecodeShare(
        HostKernel(banks, torch.float32, threads=2), (1000, 1, 0, 0), max_tokens=8, top_k=2, num_experts=6, device="cpu"
    )
    store.host_decode.min_tokens = min_tokens
    if poll:
        store.host_decode.use_poll()
    launches = ((1, 1), (4, 4), (3, 2), (40, 40), (1, 1), (4, 3), (2, 2), (1, 1))
    routed = []
    for tokens, real in launches:
        for layer in range(layers):
            x, ids, w = random_routing(spec, tokens, g)
            routed.append((layer, x, ids, w, real))
            got = store.forward(layer, x, ids, w, n_rows=torch.tensor([real], dtype=torch.int32))
            torch.testing.assert_close(got[:real], resident.forward(layer, x, ids, w)[:real], rtol=1e-5, atol=1e-5)
        snap = store.cache.snapshot()  # the maps stay each other's inverse with the host's slots freed
        for s in range(7):
            lay, e = int(snap["layer_of_slot"][s]), int(snap["expert_of_slot"][s])
            assert (lay < 0) == (e < 0) and (lay < 0 or snap["slot_of"][lay, e] == s), (s, lay, e)
        assert int((snap["slot_of"] >= 0).sum()) == int((snap["layer_of_slot"] >= 0).sum())
        store.stats_to_host()
        store.end_step()
    handed = store.report()["host_decode"]
    covered = sum(min_tokens <= tokens <= 8 for tokens, _ in launches) * layers
    assert (handed["experts"] > 0) == (covered > 0) and handed["pairs"] >= handed["experts"], handed
    # every decode layer of a launch the share covers (the 40-token steps stream instead) was handed over the
    # chosen way, and no other
    assert sum(t.calls for t in store.host_decode.tasks) == covered, (covered, handed)
    if not covered:  # a share that covers no launch changes nothing: the same lookups, misses and prefetches
        plain = offloaded()
        for layer, x, ids, w, real in routed:
            plain.forward(layer, x, ids, w, n_rows=torch.tensor([real], dtype=torch.int32))
            if layer == layers - 1:
                plain.stats_to_host()
                plain.end_step()
        counters = store.cache.counters_dict(store.cache.counters.numpy())
        assert counters == plain.cache.counters_dict(plain.cache.counters.numpy()), counters
    assert handed["handoff"] == ("poll" if poll else "node") and handed["polled_layers"] == (covered if poll else 0)
    # boot's measure of a hand-off with nothing for the host, the chosen way, leaves the counts as they were
    from ferry.services.worker.offload.host_compute.decode_share import calibrate_handoff

    assert calibrate_handoff(store.host_decode, store.cache, repeats=2) > 0
    assert store.report()["host_decode"]["experts"] == handed["experts"]

    class Traffic:  # boot's LinkTraffic, recorded: copies queued ahead of each timed replay, drained at the end
        calls = []

        def cover(self, seconds):  # with the host calls of layer 0 made so far: 8 hand-offs a replay
            self.calls.append(("cover", seconds, store.host_decode.tasks[0].calls))

        def drain(self):
            self.calls.append(("drain", None, store.host_decode.tasks[0].calls))

    traffic, base = Traffic(), store.host_decode.tasks[0].calls
    assert calibrate_handoff(store.host_decode, store.cache, repeats=3, traffic=traffic) > 0
    assert [c[0] for c in traffic.calls] == ["cover"] * 3 + ["drain"], traffic.calls
    # each cover before its replay's hand-offs, the drain after the last
    assert [c[2] for c in traffic.calls] == [base, base + 8, base + 16, base + 24], (base, traffic.calls)
    assert all(c[1] > 0 for c in traffic.calls[:3]) and store.report()["host_decode"]["experts"] == handed["experts"]
    # a handed miss gives its slot back to what the lookup evicted for it: the slots stay full
    assert int((store.cache.snapshot()["layer_of_slot"] >= 0).sum()) == 7
    total = store.stats.total
    assert total.bytes_copied == (total.misses - handed["experts"] + total.prefetched) * banks.expert_nbytes


def check_lent_slots() -> None:
    for long_ring_chunk in (None, 3):
        _check_lent_slots(long_ring_chunk)
    # a long chunk larger than what a step may lend (one layer's 3 missing experts here): no lending, said once
    spec = tiny_spec(layers=3, experts=6, top_k=2, hidden=32, inter=16)
    store = DeviceDrivenExperts(
        slot_pool(spec, 9, max_step_tokens=48),
        HostBanks.for_model(spec, "float32", progress=False),
        LRUExpertPolicy(3, 6, 9),
        "cpu",
        ring_chunks=(None, 4),
    )
    for (layer, e), weights in random_experts(spec, 9).items():
        store.load_expert(layer, e, *weights)
    store.preload()
    store.attention_period = 1
    assert store._slots_to_lend() == 0 and store._said_no_lending


def _check_lent_slots(long_ring_chunk) -> None:
    """Long-context prefills lending the ring the cache's last slots (device_store._slots_to_lend): the
    same rows as the all-resident store in float32, the lent slots emptied and their experts staged,
    the next chunk lending the same (already empty) slots, and decode after them placing into them.
    `long_ring_chunk` (--long-prefill-ring-chunk): the lending steps' chunks, and the lent slots whole
    bays of them; the other steps' chunks the ring's own."""
    from ferry.services.worker.offload.stores.expert_store import (
        LEND_CONTEXT_TOKENS,
        LEND_QUERY_TOKENS,
        is_long_context,
    )

    assert is_long_context([LEND_QUERY_TOKENS], [LEND_CONTEXT_TOKENS - LEND_QUERY_TOKENS])
    assert not is_long_context([LEND_QUERY_TOKENS - 1, 1], [LEND_CONTEXT_TOKENS, LEND_CONTEXT_TOKENS])
    assert not is_long_context([LEND_QUERY_TOKENS], [LEND_CONTEXT_TOKENS - LEND_QUERY_TOKENS - 1])
    spec = tiny_spec(layers=3, experts=6, top_k=2, hidden=32, inter=16)
    layers, num_slots = 3, 9
    resident = ResidentExperts(slot_pool(spec, layers * 6), layers, 6)
    store = DeviceDrivenExperts(
        slot_pool(spec, num_slots, max_step_tokens=48),
        HostBanks.for_model(spec, "float32", progress=False),
        LRUExpertPolicy(layers, 6, num_slots),
        "cpu",
        prefetch=True,
        pipeline_chunks=2,
        ring_chunks=(None, long_ring_chunk),
    )
    store.attention_period = 2
    for (layer, e), weights in random_experts(spec, num_slots).items():
        resident.load_expert(layer, e, *weights)
        store.load_expert(layer, e, *weights)
    g = torch.Generator().manual_seed(11)
    store.set_routers([torch.randn(6, 32, generator=g) for _ in range(layers)])
    store.preload()
    lend = store._slots_to_lend()
    assert store.ring.long_chunk == (long_ring_chunk or store.ring.base_chunk)
    assert 0 < lend <= num_slots and lend % store.ring.long_chunk == 0, (lend, store.ring.long_chunk)
    lent = slice(num_slots - lend, num_slots)
    held_before = int((store.cache.layer_of_slot[lent] >= 0).sum())
    for step, (tokens, long_context) in enumerate(((40, True), (40, True), (1, False), (1, False), (40, False))):
        maps = store.cache.slot_of.clone()
        staged = store.ring.staged_total
        store.begin_step(tokens, spec.num_experts_per_tok, long_context=long_context)
        if long_context:
            assert (store.cache.layer_of_slot[lent] < 0).all() and not (store.cache.slot_of >= num_slots - lend).any()
            evicted = int((maps >= num_slots - lend).sum())
            assert store.ring.staged_total - staged == int((maps < 0).sum()) + evicted
        if tokens > 1:  # a prefill: its chunks cut at the long chunk where it lends, else at the ring's own
            assert store.ring.chunk == (store.ring.long_chunk if long_context else store.ring.base_chunk)
        for layer in range(layers):
            x, ids, w = random_routing(spec, tokens, g)
            got = store.forward(layer, x, ids, w, n_rows=torch.tensor([tokens], dtype=torch.int32))
            torch.testing.assert_close(got, resident.forward(layer, x, ids, w), rtol=1e-5, atol=1e-5)
        store.stats_to_host()
        store.end_step()
    assert store.ring.lent_total == 2 * lend and store.lent_evictions == held_before
    report = store.report()
    assert report["prefill_lent_slots"] == 2 * lend and report["prefill_lent_evictions"] == held_before
    assert (store.cache.layer_of_slot[lent] >= 0).any(), "decode placed nothing into the freed slots"


def check_windowed_chunks() -> None:
    """A streamed prefill's chunks launch the expert kernels over their own blocks (the aligned block
    starts given, one window a chunk, covering the layer's staged positions once), with the rows the
    all-resident store computes. Boot's warm-up (steps of padding rows only: nothing staged) compiles
    them once: over an empty window, and the hits' grouped kernel with every pair skipped, at both block
    sizes a streamed step of this store can take (512 tokens of 2 pairs: the small block; 513: the
    large), whatever the warm-up step's own size."""
    import ferry.services.worker.offload.stores.device_driven as device_store

    spec = tiny_spec(layers=2, experts=6, top_k=2, hidden=32, inter=16)
    layers = 2
    resident = ResidentExperts(slot_pool(spec, layers * 6), layers, 6)
    store = DeviceDrivenExperts(
        slot_pool(spec, 7, max_step_tokens=600),
        HostBanks.for_model(spec, "float32", progress=False),
        LRUExpertPolicy(layers, 6, 7),
        "cpu",
        prefetch=False,
        pipeline_chunks=2,
    )
    for (layer, e), weights in random_experts(spec, 7).items():
        resident.load_expert(layer, e, *weights)
        store.load_expert(layer, e, *weights)
    store.preload()
    calls = []
    kernel = device_store.grouped_expert_rows_triton

    def recording(*args, **kwargs):
        aligned = kwargs.get("aligned")
        calls.append((None if aligned is None else len(aligned), kwargs.get("slot_window"), args[0].shape[0]))
        return kernel(*args, **kwargs)

    device_store.grouped_expert_rows_triton = recording
    g = torch.Generator().manual_seed(5)
    try:
        for tokens, real in ((40, 0), (600, 0), (40, 40)):
            calls.clear()
            for layer in range(layers):
                x, ids, w = random_routing(spec, tokens, g)
                got = store.forward(layer, x, ids, w, n_rows=torch.tensor([real], dtype=torch.int32))
                if real:
                    torch.testing.assert_close(got, resident.forward(layer, x, ids, w), rtol=1e-5, atol=1e-5)
            store.stats_to_host()
            store.end_step()
            windows = [(window, n) for parts, window, n in calls if window is not None]
            assert all(parts == 3 for parts, window, _ in calls if window is not None), calls  # block starts given
            if not real:  # compiled at the first padding-only step, once: 512 and 513 rows, not the step's own
                assert windows == ([((0, 0, 0), 512), ((0, 0, 0), 513)] if tokens == 40 else []), calls
                if tokens == 40:  # and the hits' kernel at both sizes, every pair skipped
                    assert sorted(n for _, window, n in calls if window is None and n in (512, 513)) == [512, 513]
            else:
                covered = sorted((lo, hi) for (lo, hi, _), _ in windows)
                staged = [store._staged_count[layer] for layer in range(layers)]
                assert sum(hi - lo for lo, hi in covered) == sum(staged) > 0, (covered, staged)
    finally:
        device_store.grouped_expert_rows_triton = kernel


def check_streamed_launches() -> None:
    """What a streamed prefill's MoE layer launches on the Triton path (the device's kernels, counted on the host):
    a prefill step of a small model is bound by the host's launches, so the layer's two alignments take four Triton
    launches each (kernels/align_pairs.py), not ~40 torch calls, and the torch calls left between the kernels are
    the padding mask and the staged positions."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    no_launch = {
        "view",
        "_unsafe_view",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "expand",
        "t",
        "transpose",
        "permute",
        "as_strided",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "_reshape_alias",
        "reshape",
    }

    class TorchLaunches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            frame, name = sys._getframe(1), func.overloadpacket.__name__
            while frame is not None and "triton/runtime/interpreter" not in frame.f_code.co_filename:
                frame = frame.f_back
            if name not in no_launch and frame is None:  # not the interpreter's own tensor work
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    kernels: list[str] = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        kernels.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    spec = tiny_spec(layers=2, experts=6, top_k=2, hidden=32, inter=16)
    store = DeviceDrivenExperts(
        slot_pool(spec, 7, max_step_tokens=600),
        HostBanks.for_model(spec, "float32", progress=False),
        LRUExpertPolicy(2, 6, 7),
        "cpu",
        prefetch=False,
        pipeline_chunks=2,
    )
    for (layer, e), weights in random_experts(spec, 7).items():
        store.load_expert(layer, e, *weights)
    store.preload()
    g = torch.Generator().manual_seed(5)
    interpreter.InterpretedFunction.run = counted
    try:
        for _ in range(2):  # the second step's layers: the compile-once work of the first is behind
            for layer in range(2):
                x, ids, w = random_routing(spec, 40, g)
                torch_launches, kernels[:] = TorchLaunches(), []
                with torch_launches:
                    store.forward(layer, x, ids, w, n_rows=torch.tensor([40], dtype=torch.int32))
            store.stats_to_host()
            store.end_step()
    finally:
        interpreter.InterpretedFunction.run = run
    staged = store._staged_count[1]
    assert staged > 0, "the last layer streamed nothing: the check would count nothing"
    alignment = [k for k in kernels if k in ("_count_kernel", "_column_kernel", "_prefix_kernel", "_scatter_kernel")]
    assert len(alignment) == 8, kernels  # the hits' alignment and the staged experts', four launches each
    assert len(torch_launches.ops) <= 6 and not {"sort", "cumsum", "scatter_", "searchsorted"} & set(
        torch_launches.ops
    ), torch_launches.ops


CHECKS = {
    "store": check,
    "device-driven-float32": lambda: check_device_driven("float32"),
    "device-driven-bfloat16": lambda: check_device_driven("bfloat16"),
    "device-driven-biased": check_device_driven_biased,
    "device-driven-mixed": check_device_driven_mixed,
    "prefetch-router-bias": check_prefetch_follows_the_router_bias,
    "host-share": check_host_share,
    "host-decode-kernel": check_host_decode_kernel,
    "host-decode": check_host_decode,
    "host-decode-poll": lambda: check_host_decode(poll=True),
    "host-decode-from-3-tokens": lambda: check_host_decode(min_tokens=3),
    "host-decode-covering-none": lambda: check_host_decode(min_tokens=9),
    "lent-slots": check_lent_slots,
    "windowed-chunks": check_windowed_chunks,
    "streamed-launches": check_streamed_launches,
    "long-step-rows": check_long_step_rows,
}


def run_check(name: str) -> None:
    """The check `name` (raises its failure): the suite's entry, through run_interpreted."""
    CHECKS[name]()


if __name__ == "__main__":  # argv[1]: one of CHECKS
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries the JSON only
    try:
        CHECKS[sys.argv[1]]()
        json.dump(None, sys.stdout)
    except Exception:  # noqa: BLE001 - reported to the parent test
        json.dump(traceback.format_exc(), sys.stdout)
