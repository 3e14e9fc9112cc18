"""Worker boot (plan order, pools as priced, clear failures) and the step executor on CPU."""

from __future__ import annotations

import argparse
import json

import msgspec
import numpy as np
import pytest

from ferry.services.worker import boot as boot_module
from ferry.services.worker.boot import boot_worker
from ferry.services.worker.executor import StepBatchError
from ferry.services.worker.flags import WorkerBootConfig, add_worker_flags, boot_config_from_args
from ferry.shared.errors import PlanError
from ferry.shared.logging import configure_logging
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch
from ferry.shared.units import ceil_div


def boot_args(model_dir, *extra: str) -> WorkerBootConfig:
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    return boot_config_from_args(
        parser.parse_args(
            [
                "--model",
                str(model_dir),
                "--device",
                "cpu",
                "--max-running-requests",
                "4",
                "--max-prefill-tokens",
                "64",
                *extra,
            ]
        )
    )


def test_boot_allocates_exactly_the_plan(tiny_model):
    executor, plan = boot_worker(boot_args(tiny_model, "--gpu-memory", "64MiB"))
    pools = executor.pools
    assert (
        pools.nbytes == plan.kv.bytes + plan.linear_state.bytes + plan.linear_state_snapshots.bytes + plan.experts.bytes
    )
    assert (plan.linear_state_snapshots.snapshots > 0) == bool(executor.spec.linear_attention_layers)
    assert (
        plan.total_bytes <= plan.budget_bytes == 64 * 2**20
    )  # the whole budget: no context or allocator outside it on CPU
    params = sum(p.numel() * p.element_size() for p in executor.model.parameters())
    assert params <= plan.weights_bytes and plan.weights_source == "measured"
    assert plan.workspace_source == "estimate"  # CPU: no allocator to profile with
    assert plan.experts.slots == plan.experts.total
    assert (pools.linear_state is not None) == bool(executor.spec.linear_attention_layers)


def test_cpu_default_budget_is_stated(tiny_models, monkeypatch, capsys):
    configure_logging("worker")
    monkeypatch.setattr(boot_module, "CPU_DEFAULT_BUDGET", 48 * 2**20)
    _, plan = boot_worker(boot_args(tiny_models["qwen3_moe"]))
    events = {e["event"]: e for e in map(json.loads, _json_lines(capsys.readouterr().err))}
    assert "no --gpu-memory on CPU: budget 48.00 MiB" in events["cpu_default_budget"]["message"]
    assert events["cpu_default_budget"]["level"] == "warning"
    assert events["plan"]["expert_slots"] == plan.experts.slots and events["plan"]["process"] == "worker"
    assert plan.budget_bytes == 48 * 2**20
    assert "the CPU default" in plan.budget_derivation and "--gpu-memory" not in plan.budget_derivation


def test_cpu_default_budget_failure_names_no_flag_the_user_did_not_set(tiny_models, monkeypatch):
    monkeypatch.setattr(boot_module, "CPU_DEFAULT_BUDGET", 4 * 2**20)
    with pytest.raises(PlanError) as err:
        boot_worker(boot_args(tiny_models["qwen3_moe"]))
    assert "the CPU default" in str(err.value) and "--gpu-memory" not in str(err.value)


def _json_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{")]  # progress bars share stderr


def test_budget_too_small_fails_in_the_plan(tiny_models):
    with pytest.raises(PlanError, match="--gpu-memory would have to be at least"):
        boot_worker(boot_args(tiny_models["qwen3_moe"], "--gpu-memory", "4MiB"))


def test_fewer_slots_than_experts_boots_the_offload_store(tiny_models, capsys):
    from ferry.services.worker.offload.stores.offloaded import OffloadedExperts

    configure_logging("worker")
    executor, plan = boot_worker(
        boot_args(tiny_models["qwen3_moe"], "--gpu-memory", "64MiB", "--moe-cache-size", "8", "--expert-policy", "lru")
    )
    assert isinstance(executor.store, OffloadedExperts) and executor.store.policy.name == "lru"
    assert plan.experts.slots == 8 < plan.experts.total
    assert executor.store.policy.resident == 8  # preloaded
    assert not executor.store.slots.w13.is_pinned() and executor.store.banks.w13[0].device.type == "cpu"
    events = {e["event"]: e for e in map(json.loads, _json_lines(capsys.readouterr().err))}
    assert events["expert_host_banks"]["bytes"] == executor.store.banks.nbytes
    assert events["experts_loaded"]["expert_store"] == "lru"


def test_host_ram_shortage_fails_before_any_pool(tiny_models, monkeypatch):
    from ferry.services.worker.offload.host_memory import host_banks

    monkeypatch.setattr(host_banks, "mem_available_bytes", lambda meminfo=None: 2**30)  # less than the 2 GiB reserve
    allocated = []
    monkeypatch.setattr(boot_module, "allocate_pools", lambda *a: allocated.append(a))
    with pytest.raises(host_banks.HostMemoryError, match="of host RAM but only 1.00 GiB is available"):
        boot_worker(boot_args(tiny_models["qwen3_moe"], "--gpu-memory", "64MiB", "--moe-cache-size", "8"))
    assert not allocated


def _step(step_id, reqs, new=(), finished=()):
    """reqs: list of (req_id, tokens, context_len, first_page, linear_state_slot, sample)."""
    page_size = 16
    rows = max(ceil_div(c + len(t), page_size) for _, t, c, _, _, _ in reqs)
    table = np.zeros((len(reqs), rows), np.int32)
    for i, (_, t, c, first, _, _) in enumerate(reqs):
        n = ceil_div(c + len(t), page_size)
        table[i, :n] = np.arange(first, first + n)
    return StepBatch(
        step_id=step_id,
        req_ids=np.array([r[0] for r in reqs], np.int64),
        tokens=np.concatenate([np.array(r[1], np.int32) for r in reqs]),
        query_lens=np.array([len(r[1]) for r in reqs], np.int32),
        context_lens=np.array([r[2] for r in reqs], np.int32),
        page_table=table,
        linear_state_slots=np.array([r[4] for r in reqs], np.int32),
        reset_linear_state=np.array([r[2] == 0 for r in reqs]),
        sample=np.array([r[5] for r in reqs]),
        new_requests=tuple(new),
        finished_req_ids=tuple(finished),
    )


def _decode_alone(executor, req_id, prompt, steps, first_page, slot):
    greedy = SamplingParams(temperature=0.0)
    out = executor.execute(
        _step(
            1,
            [(req_id, prompt, 0, first_page, slot, True)],
            new=[NewRequest(req_id=req_id, prompt_token_ids=np.array(prompt, np.int32), sampling=greedy)],
        )
    )
    tokens = [int(out.token_ids[0])]
    for i in range(steps - 1):
        out = executor.execute(_step(2 + i, [(req_id, [tokens[-1]], len(prompt) + i, first_page, slot, True)]))
        tokens.append(int(out.token_ids[0]))
    executor.execute(_step(99, [(req_id, [0], 0, first_page, slot, False)], finished=[req_id]))
    return tokens


def test_batched_requests_match_each_request_alone(tiny_model):
    executor, _ = boot_worker(boot_args(tiny_model, "--gpu-memory", "64MiB"))
    a, b = [5, 17, 33, 2, 8, 100, 41, 9, 12, 77, 3, 60, 61, 62, 63, 64, 65, 66], [400, 7, 7]
    alone_a = _decode_alone(executor, 1, a, 5, first_page=1, slot=1)
    alone_b = _decode_alone(executor, 2, b, 5, first_page=10, slot=2)
    greedy = SamplingParams(temperature=0.0)
    new = [
        NewRequest(req_id=3, prompt_token_ids=np.array(a, np.int32), sampling=greedy),
        NewRequest(req_id=4, prompt_token_ids=np.array(b, np.int32), sampling=greedy),
    ]
    # a's prompt in two chunks; b joins in the second step; then both decode together
    out = executor.execute(_step(1, [(3, a[:10], 0, 20, 3, False), (4, b, 0, 30, 4, True)], new=new))
    assert out.req_ids.tolist() == [4]
    got_b = [int(out.token_ids[0])]
    out = executor.execute(_step(2, [(3, a[10:], 10, 20, 3, True), (4, [got_b[-1]], len(b), 30, 4, True)]))
    got_a, got_b = [int(out.token_ids[0])], got_b + [int(out.token_ids[1])]
    for i in range(3):
        out = executor.execute(
            _step(3 + i, [(3, [got_a[-1]], len(a) + i, 20, 3, True), (4, [got_b[-1]], len(b) + 1 + i, 30, 4, True)])
        )
        got_a.append(int(out.token_ids[0]))
        got_b.append(int(out.token_ids[1]))
    assert got_a == alone_a[:4] and got_b == alone_b[:5]
    assert np.all(out.logprobs <= 0) and out.token_ids.dtype == np.int32


def test_executor_rejects_out_of_plan_steps(tiny_models):
    executor, plan = boot_worker(boot_args(tiny_models["qwen3_moe"], "--gpu-memory", "64MiB"))
    new = [NewRequest(req_id=1, prompt_token_ids=np.array([1, 2], np.int32), sampling=SamplingParams())]
    bad_page = _step(1, [(1, [1, 2], 0, plan.kv.pages + 5, 1, True)], new=new)
    with pytest.raises(StepBatchError, match="page ids"):
        executor.execute(bad_page)
    too_long = _step(2, [(1, list(range(65)), 0, 1, 1, True)], new=new)
    with pytest.raises(StepBatchError, match="max_prefill_tokens"):
        executor.execute(too_long)
    # issue 11's fields, held to the same contract before anything changes: a prompt-logprobs mask of the
    # wrong shape, a logit_bias token outside the vocabulary, a top-logprobs count past 20
    marks = msgspec.structs.replace(_step(3, [(1, [1, 2], 0, 1, 1, True)], new=new), prompt_logprobs=np.ones(2, bool))
    with pytest.raises(StepBatchError, match="prompt_logprobs"):
        executor.execute(marks)
    for bad, word in [
        (SamplingParams(logit_bias=((executor.spec.vocab_size, 5.0),)), "vocabulary"),
        (SamplingParams(logprobs=21), "top_logprobs"),
    ]:
        forged = [NewRequest(req_id=2, prompt_token_ids=np.array([1, 2], np.int32), sampling=bad)]
        with pytest.raises(StepBatchError, match=word):
            executor.execute(_step(4, [(2, [1, 2], 0, 1, 1, True)], new=forged))
    assert 2 not in executor.sampler.requests  # refused before the sampler took the request


def test_largest_step_runs_on_temporary_pools(tiny_model):
    """The profiling step (run on CUDA at boot) is a valid batch for the model."""
    import torch

    from ferry.plan.planner import PlanRequest, resolve
    from ferry.services.worker.late_bound_experts import LateBoundExperts
    from ferry.services.worker.loader import open_model
    from ferry.services.worker.models import build_model
    from ferry.services.worker.workspace_profile import largest_step, run_largest_step

    files = open_model(str(tiny_model), load_format="dummy")
    r = resolve(files.spec, PlanRequest(max_running_requests=5, max_prefill_tokens=40))
    step = largest_step(r)
    assert len(step.tokens) == 40 and len(step.req_ids) == 5 and step.sample.all()
    experts = LateBoundExperts(files.spec.num_experts)
    model = build_model(files.spec, torch.float32, "cpu", experts)
    tokens = run_largest_step(model, experts, files.spec, r, torch.device("cpu"))
    assert tokens.shape == (5,) and bool(((tokens >= 0) & (tokens < files.spec.vocab_size)).all())
    with pytest.raises(RuntimeError, match="not bound"):
        experts.forward(
            0, torch.zeros(1, files.spec.hidden_size), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
        )


def test_reserving_more_than_gpu_memory_fails_clearly(monkeypatch):
    import torch

    from ferry.plan.planner import PlanRequest
    from ferry.services.worker.boot import MemoryBudgetExceeded, _check_budget

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 900)
    _check_budget(torch.device("cuda"), PlanRequest(gpu_memory=1000), None, earlier_peak=950)
    _check_budget(torch.device("cuda"), PlanRequest(gpu_memory=1000), None, earlier_peak=1500, baseline=600)  # not ours
    with pytest.raises(MemoryBudgetExceeded, match="--gpu-memory"):
        _check_budget(torch.device("cuda"), PlanRequest(gpu_memory=1000), None, earlier_peak=1001)
    with pytest.raises(MemoryBudgetExceeded, match="free memory"):
        _check_budget(torch.device("cuda"), PlanRequest(), 800, earlier_peak=0)


def test_the_budget_check_counts_the_memory_outside_the_allocator(monkeypatch):
    """--gpu-memory is nvidia-smi's figure: the context and kernels the process holds outside the allocator count
    against it; without the flag only what they grew since the free memory was read."""
    import torch

    from ferry.plan.planner import PlanRequest
    from ferry.services.worker.boot import MemoryBudgetExceeded, _check_budget

    class Probe:
        nvml, at_start = True, 40

        def held(self):
            return 100

    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 900)
    _check_budget(torch.device("cuda"), PlanRequest(gpu_memory=1000), None, earlier_peak=0, probe=Probe())
    with pytest.raises(MemoryBudgetExceeded, match="100 B outside"):
        _check_budget(torch.device("cuda"), PlanRequest(gpu_memory=999), None, earlier_peak=0, probe=Probe())
    _check_budget(torch.device("cuda"), PlanRequest(), 960, earlier_peak=0, probe=Probe())  # 900 + (100 - 40)
    with pytest.raises(MemoryBudgetExceeded, match="free memory"):
        _check_budget(torch.device("cuda"), PlanRequest(), 959, earlier_peak=0, probe=Probe())


def test_every_eager_step_tells_the_expert_store_it_begins_once_its_inputs_are_built(tiny_models):
    """`begin_step` (a prefill's expert copies start there, on CUDA) comes after the step's inputs are
    made, so those are uploaded first, and carries the step's token count and top-k."""
    executor, _ = boot_worker(boot_args(tiny_models["qwen3_moe"], "--gpu-memory", "64MiB", "--moe-cache-size", "8"))
    order: list = []
    build, begin = executor._forward_batch, executor.store.begin_step
    executor._forward_batch = lambda *args: (order.append("inputs"), build(*args))[1]
    executor.store.begin_step = lambda n, k, long_context: (
        order.append(("begin", n, k, long_context)),
        begin(n, k, long_context),
    )[1]
    k = executor.spec.num_experts_per_tok
    tokens = _decode_alone(executor, 1, [5, 17, 33, 2, 8, 100, 41, 9, 12, 77, 3], 3, first_page=1, slot=1)
    assert len(tokens) == 3
    # none of these is a long-context prefill (experts.is_long_context), which lends cache slots to its ring
    assert order == [
        "inputs",
        ("begin", 11, k, False),
        "inputs",
        ("begin", 1, k, False),
        "inputs",
        ("begin", 1, k, False),
        "inputs",
        ("begin", 1, k, False),
    ]  # the last: the step that tells
    # the worker request 1 finished


def test_a_chunk_that_runs_the_device_out_of_memory_is_a_plan_error_that_frees_its_tensors():
    """Boot profiles each prefill chunk's workspace; where one runs the device out of memory, the chooser
    must get a PlanError (and try a shorter chunk) while the step's tensors are already gone: the
    device's error is dropped first (its traceback holds the frames of the step that ran out), then the
    allocator's cache released, and the PlanError keeps no link to it. A chunk that fits gives its bytes."""
    import gc
    import weakref

    import torch

    from ferry.services.worker.workspace_profile import profiled_or_plan_error

    held: list = []
    released: list = []

    def step_that_runs_out():
        activations = torch.ones(1024)  # a tensor the step made, referenced only by this frame
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    def release():
        released.append(held[0]() is None)  # the step's tensor is gone by the time the cache is released

    gc.disable()  # the tensor must go by reference counts, as it does on the device, not by a collection
    try:
        with pytest.raises(PlanError, match=r"16384-token step's workspace did not fit.*Tried to allocate 2.00 GiB\)"):
            profiled_or_plan_error(step_that_runs_out, 16384, release=release)
    finally:
        gc.enable()
    assert released == [True]
    assert profiled_or_plan_error(lambda: 123, 8192, release=release) == 123 and released == [True]


def test_a_plan_error_from_a_profile_keeps_no_link_to_the_device_error():
    import torch

    from ferry.services.worker.workspace_profile import profiled_or_plan_error

    def oom():
        raise torch.OutOfMemoryError("out of memory")

    try:
        profiled_or_plan_error(oom, 4096)
    except PlanError as err:
        assert err.__context__ is None and err.__cause__ is None
    else:
        pytest.fail("no PlanError")


@pytest.mark.parametrize("layout, copy_engine", [(None, 8), ("packed", None), ("modelopt-nvfp4", None), ("fp8", None)])
def test_only_plain_bf16_banks_copy_large_decode_steps_with_the_copy_engine(
    tiny_models, quantized_tiny_models, monkeypatch, layout, copy_engine
):
    """Packed and quantized experts are small enough that their decode copies stay in the CUDA graph at any batch:
    the eager host-read path cost the full-size 35B NVFP4 three quarters of its 8-stream rate. (The threshold
    reaches the CUDA store only; on CPU the boot's choice is read where it is made.)"""
    from ferry.services.worker import boot

    if layout in (None, "packed"):
        model = tiny_models["qwen3_moe"]
        extra = (
            ("--expert-bank-format", "plain")
            if layout is None
            else ("--expert-bank-format", "packed", "--dtype", "bfloat16")
        )
    else:
        model, extra = quantized_tiny_models("qwen3_moe", layout), ()
    chosen = []
    real = boot.copy_engine_tokens
    monkeypatch.setattr(
        boot,
        "copy_engine_tokens",
        lambda requested, plain_bf16_banks: chosen.append(real(requested, plain_bf16_banks)) or chosen[-1],
    )
    _, plan = boot_worker(boot_args(model, "--gpu-memory", "64MiB", "--moe-cache-size", "8", *extra))
    assert plan.experts.slots < plan.experts.total
    assert chosen[-1] == copy_engine
