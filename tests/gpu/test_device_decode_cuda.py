"""The decode path driven from the device, on a real GPU: the expert cache's kernel against its host
twin, the GPU-driven copy from mapped pinned banks, and whole models served through boot — CUDA
graph replay equal to eager execution, and offloaded equal to all-resident, token for token in
float32, with next-layer prefetch on and off. Skipped without CUDA."""

from __future__ import annotations

import argparse
import gc

import numpy as np
import pytest
import torch

from ferry.services.worker.offload.host_compute.prefill_share import HostCost
from tests.helpers import cuda_test_budget

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_device_cache_makes_the_twins_decisions_at_real_sizes(cuda_device):
    from ferry.services.worker.offload.slot_cache.device_cache import DeviceExpertCache
    from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy
    from ferry.services.worker.offload.slot_cache.policy import LRUExpertPolicy
    from tests.unit.offload.offload_tiny import slot_pool, tiny_spec
    from tests.unit.offload.test_device_cache import _assert_same_state

    layers, experts, slots, k = 6, 128, 300, 8
    spec = tiny_spec(layers=layers, experts=experts, top_k=k)
    rng = np.random.default_rng(0)
    for policy in (LFUExpertPolicy(layers, experts, slots, half_life=50), LRUExpertPolicy(layers, experts, slots)):
        for i in range(slots // 2):
            policy.place_in_free_slot(i % layers, (7 * i) % experts)
        dev = DeviceExpertCache(slot_pool(spec, slots, max_step_tokens=8, device=cuda_device), policy)
        for step in range(12):
            real = int(rng.integers(1, 9))
            n = torch.tensor([real], dtype=torch.int32, device=cuda_device)
            for layer in range(layers):
                ids = torch.tensor(
                    np.stack([rng.choice(experts, k, replace=False) for _ in range(8)]), device=cuda_device
                )
                below = layer if step % 3 == 1 else 0  # some steps scan (prefill's rule)
                call = dev.lookup(layer, ids, n, evict_below=below)
                got = policy.lookup(layer, np.unique(ids[:real].cpu().numpy()), evict_below=below)
                assert [tuple(r) for r in call.misses[: int(call.count[0])].tolist()] == list(got.misses)
                if layer + 1 < layers:
                    predicted = torch.tensor(
                        np.stack([rng.choice(experts, k, replace=False) for _ in range(8)]), device=cuda_device
                    )
                    pcall = dev.prefetch(layer + 1, predicted, n, call, evict_below=below)
                    pgot = policy.prefetch(
                        layer + 1, np.unique(predicted[:real].cpu().numpy()), got.slots, evict_below=below
                    )
                    assert [tuple(r) for r in pcall.misses[: int(pcall.count[0])].tolist()] == list(pgot.placed)
            _assert_same_state(policy, dev)


def test_the_gpu_reads_the_mapped_banks(cuda_device):
    from ferry.kernels.expert_copy import copy_experts_triton
    from ferry.services.worker.offload.host_memory.host_banks import HostBanks

    banks = HostBanks.allocate(2, 16, 256, 128, torch.bfloat16, pin=True, progress=False)
    banks.fill_dummy(seed=3, progress=False)
    w13 = torch.full((10, 256, 256), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    w2 = torch.full((10, 256, 128), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    misses = torch.tensor([[15, 9], [0, 0], [7, 4], [3, 3]], dtype=torch.int32, device=cuda_device)
    copy_experts_triton(
        banks.w13[1], banks.w2[1], w13, w2, misses, torch.tensor([3], dtype=torch.int32, device=cuda_device)
    )
    torch.cuda.synchronize()
    for expert, slot in ((15, 9), (0, 0), (7, 4)):
        assert torch.equal(w13[slot].cpu(), banks.w13[1][expert]) and torch.equal(w2[slot].cpu(), banks.w2[1][expert])
    assert torch.isnan(w13[3].float()).all()  # past the count: untouched


def test_the_gpu_unpacks_the_mapped_packed_banks_bit_for_bit(cuda_device):
    """Packed banks (packed on the GPU as they fill) hold the plain banks' bits: unpacked by the GPU
    from a device-held list inside a CUDA graph, from a host list, and after an expert is reloaded
    with values that escape their window (a subnormal, inf, NaN; the zeros are kept as such)."""
    from ferry.services.worker.offload.host_memory.host_banks import HostBanks
    from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

    shape = (2, 16, 256, 128, torch.bfloat16)
    plain = HostBanks.allocate(*shape, pin=True, progress=False)
    plain.fill_dummy(seed=3, progress=False)
    packed = PackedHostBanks.allocate(*shape, pin=True, progress=False)
    packed.fill_dummy(seed=3, progress=False)
    g = torch.Generator().manual_seed(0)
    gate, up, down = (
        (torch.randn(128, 256, generator=g) * 0.02).bfloat16(),
        torch.randn(128, 256, generator=g).bfloat16(),
        (torch.randn(256, 128, generator=g) * 1e-3).bfloat16(),
    )
    gate[0, :5] = torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("nan")])
    for banks in (plain, packed):
        banks.load_expert(1, 5, gate, up, down)
    packed.seal()
    w13 = torch.full((10, 256, 256), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    w2 = torch.full((10, 256, 128), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    misses = torch.zeros(4, 2, dtype=torch.int32, device=cuda_device)
    count = torch.zeros(1, dtype=torch.int32, device=cuda_device)
    packed.copy_listed(1, w13, w2, misses, count)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed.copy_listed(1, w13, w2, misses, count)

    def same(slot: int, layer: int, expert: int) -> bool:
        return torch.equal(
            w13[slot].cpu().view(torch.int16), plain.w13[layer][expert].view(torch.int16)
        ) and torch.equal(w2[slot].cpu().view(torch.int16), plain.w2[layer][expert].view(torch.int16))

    for listed in ([[15, 9], [5, 0], [7, 4]], [[5, 3], [0, 1]]):
        misses[: len(listed)].copy_(torch.tensor(listed, dtype=torch.int32))
        count.fill_(len(listed))
        graph.replay()
        torch.cuda.synchronize()
        assert all(same(s, 1, e) for e, s in listed), listed
    assert torch.isnan(w13[2].float()).all()  # never listed: untouched
    packed.copy_experts(0, [(3, 2), (4, 8)], w13, w2)
    torch.cuda.synchronize()
    assert same(2, 0, 3) and same(8, 0, 4)
    assert packed.escape_count >= 3 and packed.expert_nbytes < 0.76 * plain.expert_nbytes


def _boot(model_dir, dtype, *flags):
    """A worker on the GPU. Its experts are computed on the GPU alone unless `flags` name an --expert-backend: the
    tests compare paths token for token, bit for bit, and under auto a boot calibration skewed by a busy host
    (other test processes) can hand decode layers' misses to the host, whose rounding differs (a bf16 token
    flipped so); the host's share is compared where its costs are forced (the float32 host-share variants)."""
    from ferry.services.worker.boot import boot_worker
    from ferry.services.worker.flags import add_worker_flags, boot_config_from_args

    if "--expert-backend" not in flags:
        flags = (*flags, "--expert-backend", "gpu")

    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    return boot_worker(
        boot_config_from_args(
            parser.parse_args(
                [
                    "--model",
                    str(model_dir),
                    "--device",
                    "cuda",
                    "--dtype",
                    dtype,
                    "--gpu-memory",
                    cuda_test_budget(768 * 2**20),
                    "--max-running-requests",
                    "8",
                    "--max-prefill-tokens",
                    "256",
                    *flags,
                ]
            )
        )
    )


def _greedy_batch(executor, prompts: list[list[int]], steps: int, sampling: list | None = None) -> list[list[int]]:
    """Three requests prefilled together, then decoded together (3 rows: a padded graph bucket);
    greedy unless `sampling` gives each request its SamplingParams."""
    from ferry.shared.sampling import SamplingParams
    from ferry.shared.step import NewRequest, StepBatch

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    sampling = sampling or [greedy] * len(prompts)
    page = executor.plan.kv.page_size
    n = len(prompts)
    pages_each = -(-(max(map(len, prompts)) + steps + 1) // page)
    table = np.stack([np.arange(1 + i * pages_each, 1 + (i + 1) * pages_each) for i in range(n)]).astype(np.int32)
    ids = np.arange(1, n + 1, dtype=np.int64)
    context = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]

    def step(tokens, new=(), step_id=0):
        batch = StepBatch(
            step_id=step_id,
            req_ids=ids,
            tokens=np.array([t for ts in tokens for t in ts], np.int32),
            query_lens=np.array([len(ts) for ts in tokens], np.int32),
            context_lens=np.array(context, np.int32),
            page_table=table,
            linear_state_slots=np.arange(1, n + 1, dtype=np.int32),
            reset_linear_state=np.array([c == 0 for c in context]),
            sample=np.ones(n, bool),
            new_requests=tuple(new),
        )
        result = executor.execute(batch)
        for i, ts in enumerate(tokens):
            context[i] += len(ts)
        return result.token_ids.tolist()

    news = [
        NewRequest(req_id=int(r), prompt_token_ids=np.array(p, np.int32), sampling=sp)
        for r, p, sp in zip(ids, prompts, sampling)
    ]
    last = step(prompts, news, 1)
    for s in range(steps):
        for i, t in enumerate(last):
            out[i].append(t)
        last = step([[t] for t in last], step_id=2 + s)
    return out


@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", "float32"), ("qwen3_5_moe", "bfloat16")])
def test_graphs_and_the_device_cache_decode_token_for_token(tiny_models, arch, dtype):
    """Graph replay == eager, and offloaded (device-driven, prefetch on or off, GPU-core or copy-engine
    copies) == all-resident. The hybrid in bf16, its serving dtype: in float32 its Gated DeltaNet takes
    the reference twin, which waits for the device and so decodes eagerly (no graphs). Every compared
    path runs the same expert kernels, so the tokens must be equal, not close."""
    from ferry.services.worker.decode_graphs import graph_buckets
    from ferry.services.worker.flags import DEFAULT_COPY_ENGINE_TOKENS

    model = tiny_models[arch]
    prompts = [[5, 17, 33, 2, 8, 100, 41, 9], [7, 7, 3], [250, 1, 64, 64, 12]]
    runs, hits = {}, {}
    variants = {
        "resident-eager": ["--enforce-eager"],
        "resident-graphs": [],
        "offload-graphs": ["--moe-cache-size", "10"],
        "offload-graphs-no-prefetch": ["--moe-cache-size", "10", "--no-expert-prefetch"],
        "offload-eager": ["--moe-cache-size", "10", "--enforce-eager"],
        "offload-copy-engine": ["--moe-cache-size", "10", "--expert-copy-engine-tokens", "2"],
    }
    if dtype == "bfloat16":  # packed banks by default: the plain ones too, graphs and copy engine
        variants["offload-plain-banks"] = ["--moe-cache-size", "10", "--expert-bank-format", "plain"]
    for name, flags in variants.items():
        executor, plan = _boot(model, dtype, *flags)
        if "--moe-cache-size" in flags:
            want_format = "packed" if dtype == "bfloat16" and "plain" not in flags else "plain"
            assert plan.host.expert_bank_format == want_format and executor.store.banks.packed == (
                want_format == "packed"
            )
        assert (executor.graphs is None) == ("--enforce-eager" in flags)
        if "--expert-copy-engine-tokens" in flags:
            assert executor.graphs.buckets == [1]  # 3-row decode steps take the copy-engine path, eagerly
        elif executor.graphs is not None:  # all-resident, packed banks: every bucket; plain: those under 8
            every = graph_buckets(executor.spec.num_experts_per_tok, plan.max_running_requests)
            plain = "--moe-cache-size" in flags and plan.host.expert_bank_format == "plain"
            below = DEFAULT_COPY_ENGINE_TOKENS if plain else None  # packed banks: no copy-engine threshold
            assert executor.graphs.buckets == graph_buckets(
                executor.spec.num_experts_per_tok, plan.max_running_requests, below=below
            )
            assert (executor.graphs.buckets == every) == (below is None or every[-1] < below)
        runs[name] = _greedy_batch(executor, prompts, steps=12)
        report = executor.expert_cache_report()
        hits[name] = report["hits"]
        if "--moe-cache-size" in flags:
            assert plan.experts.slots == 10 and report["misses"] > 0
            assert (report["prefetched"] > 0) == ("--no-expert-prefetch" not in flags)
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    want = runs.pop("resident-eager")
    for name, got in runs.items():
        assert got == want, f"{name} differs from all-resident eager decoding"
    # the graphs count the distinct routed experts of each step on the device, as eager steps do
    assert hits["resident-graphs"] == hits["resident-eager"] > 0


def test_a_graph_samples_seeded_requests_as_the_eager_sampler_does(tiny_models):
    """Temperature sampling with seeds: drawn inside the decode graph (plain sampling), by the sampler on
    the graph's logits (a request asking for logprobs takes that path) and eagerly, the same tokens."""
    from ferry.shared.sampling import SamplingParams

    prompts = [[5, 17, 33, 2, 8, 100, 41, 9], [7, 7, 3], [250, 1, 64, 64, 12]]
    plain = [SamplingParams(temperature=t, seed=s, ignore_eos=True) for t, s in ((0.8, 1), (1.3, 2), (0.0, None))]
    asks = [
        SamplingParams(temperature=t, seed=s, ignore_eos=True, logprobs=1) for t, s in ((0.8, 1), (1.3, 2), (0.0, None))
    ]
    runs = {}
    for name, flags, sampling in (
        ("eager", ["--enforce-eager"], plain),
        ("in-graph", [], plain),
        ("sampler-on-graph-logits", [], asks),
    ):
        executor, _ = _boot(tiny_models["qwen3_moe"], "float32", *flags)
        assert (executor.graphs is None) == (name == "eager")
        runs[name] = _greedy_batch(executor, prompts, steps=12, sampling=sampling)
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    assert runs["in-graph"] == runs["eager"] and runs["sampler-on-graph-logits"] == runs["eager"]


@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", "float32"), ("qwen3_5_moe", "bfloat16")])
def test_steps_scheduled_ahead_decode_as_one_by_one_through_graphs_and_the_device_cache(tiny_models, arch, dtype):
    """A step launched before the previous one finished, its tokens fed from that step's samples on the
    device (before the graph replays, or into an eager step), gives the tokens of running them one by one."""
    from tests.unit.test_executor_ahead import decode_two_requests

    for flags in ([], ["--moe-cache-size", "10"], ["--moe-cache-size", "10", "--enforce-eager"]):
        executor, _ = _boot(tiny_models[arch], dtype, *flags)
        assert (executor.graphs is None) == ("--enforce-eager" in flags)
        one_by_one = decode_two_requests(executor, ahead=False)
        del executor
        gc.collect()
        executor, _ = _boot(tiny_models[arch], dtype, *flags)
        assert decode_two_requests(executor, ahead=True) == one_by_one, flags
        del executor
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", "float32"), ("qwen3_5_moe", "bfloat16")])
def test_a_prefill_streamed_past_the_cache_decodes_as_all_resident(tiny_models, arch, dtype, monkeypatch):
    """A prefill of 95 tokens (190 (token, k) pairs over 8 experts: past the pair kernel, 4+ pairs per
    expert) streams every non-resident expert through the staging ring, copy-engine copies running
    ahead of the computation across layers; it places nothing in the cache. Its tokens, and those
    decoded after it, equal all-resident decoding, prefetch on and off, and with the host's share handed
    over by host nodes (FERRY_HOST_HANDOFF=node), by polling (poll: stream memory operations in the graphs)
    and by whichever boot timed faster (auto, the default)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 250, n).tolist() for n in (40, 25, 30)]
    runs = {}
    variants = {
        "resident": ["--enforce-eager"],
        "offload": ["--moe-cache-size", "10"],
        "offload-no-prefetch": ["--moe-cache-size", "10", "--no-expert-prefetch"],
    }
    if (
        dtype == "float32"
    ):  # the host computes part of each streamed layer's misses (offload/host_compute/prefill_share.py): same tokens
        variants["offload-host-share-node"] = [
            "--moe-cache-size",
            "10",
            "--expert-backend",
            "hybrid",
            "--host-expert-threads",
            "2",
        ]
        variants["offload-host-share-poll"] = variants["offload-host-share-node"]
        # the default: whichever boot measured faster
        variants["offload-host-share-auto"] = variants["offload-host-share-node"]
    for name, flags in variants.items():
        if name.endswith(("-node", "-poll", "-auto")):
            monkeypatch.setenv("FERRY_HOST_HANDOFF", name.rsplit("-", 1)[1])
        else:
            monkeypatch.delenv("FERRY_HOST_HANDOFF", raising=False)
        executor, plan = _boot(tiny_models[arch], dtype, *flags)
        if "--host-expert-threads" in flags:
            # the tiny model's experts cross in a few µs, against the hand-off's hundreds, so the calibrated
            # split rightly gives the host nothing: costs that make the host as fast as the link give it
            # half of a layer's missed experts (rounded down), so both sides compute
            assert executor.store.host_share is not None
            executor.store.host_share.cost = HostCost(
                pcie_s=1e-3, host_s_at_1=1e-3, host_s_per_token=0.0, overhead_s=0.0
            )
            # and half of each decode layer's misses, through the host node in the decode graphs (captured
            # at boot: the hand-off kernel reads its costs from the device at run time)
            assert executor.store.host_decode is not None, "the host's C kernel is not built (gpu_check builds it)"
            executor.store.host_decode.costs_ns = (1_000_000, 1_000_000, 0, 0)
        before = executor.store.ring.staged_total if "--moe-cache-size" in flags else 0
        assert before == 0  # boot's warm-up steps are padding only: they stage nothing
        runs[name] = _greedy_batch(executor, prompts, steps=6)
        if "--moe-cache-size" in flags:
            staged = executor.store.ring.staged_total
            # every MoE layer's non-resident experts, once (the cache holds 10 of them, the rest crossed)
            layers = len(executor.spec.moe_layer_indices)
            if "--host-expert-threads" not in flags:  # with a host share, the host's experts are not staged
                assert staged >= layers * executor.spec.num_experts - plan.experts.slots > 0
            if "--no-expert-prefetch" in flags:  # the staged experts are counted as prefetched, and only they
                assert executor.expert_cache_report()["prefetched"] == staged
            if "--host-expert-threads" in flags:
                shared = executor.store.report()["host_share"]
                assert shared["layers"] > 0 and shared["experts"] > 0, shared
                handed = executor.store.report()["host_decode"]
                assert handed["experts"] > 0, handed
                # polled: the boot kept it (the driver captured the stream memory operations, the thread answered)
                if not name.endswith("-auto"):
                    assert handed["handoff"] == ("poll" if name.endswith("-poll") else "node"), handed
                assert (handed["polled_layers"] > 0) == (handed["handoff"] == "poll"), handed
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    want = runs.pop("resident")
    for name, got in runs.items():
        assert got == want, f"{name} differs from all-resident decoding"


@pytest.mark.parametrize("arch", ["gemma4", "gpt_oss"])
def test_the_hosts_share_of_other_families_decodes_as_all_resident(arch, tmp_path):
    """Gemma 4 (GELU-tanh experts beside its dense MLP) and gpt-oss (biases, the clamped SwiGLU) with the host
    computing half of each layer's misses, in prefill (the streamed layers' share) and decode (the host node in the
    decode graphs): the tokens of all-resident decoding. The host's C kernel takes the family's activation from
    the model; one that fell back to SiLU would change them."""
    from ferry.services.make_tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / arch, arch, seed=0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 250, n).tolist() for n in (40, 25, 30)]
    runs = {}
    host = ["--moe-cache-size", "10", "--expert-backend", "hybrid", "--host-expert-threads", "2"]
    for name, flags in {"resident": ["--enforce-eager"], "host-share": host}.items():
        executor, _ = _boot(model, "float32", *flags)
        if name == "host-share":  # costs that give the host half of a layer's misses (as in the test above)
            executor.store.host_share.cost = HostCost(
                pcie_s=1e-3, host_s_at_1=1e-3, host_s_per_token=0.0, overhead_s=0.0
            )
            assert executor.store.host_decode is not None, "the host's C kernel is not built (gpu_check builds it)"
            executor.store.host_decode.costs_ns = (1_000_000, 1_000_000, 0, 0)
        runs[name] = _greedy_batch(executor, prompts, steps=6)
        if name == "host-share":
            report = executor.store.report()
            assert report["host_share"]["experts"] > 0 and report["host_decode"]["experts"] > 0, report
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    assert runs["host-share"] == runs["resident"]
