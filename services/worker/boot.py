"""Worker boot, in the order of docs/ARCHITECTURE.md §2 rule 3: measure, load dense weights, measure them,
profile the workspace, plan, allocate the pools, load the experts.

    free memory ─▶ dense weights ─▶ weight bytes ─▶ workspace ─▶ plan ─▶ [host banks] ─▶ pools ─▶ experts

When the plan gives fewer expert slots than experts, the experts go to host banks (allocated,
RAM checked, before any device pool) and are read to CPU, never to the device; the offload
store then warms its slots (`preload`). Log lines are structlog events (shared/logging.py).

Everything the planner is given is a measurement of this process on this device, except on
CPU, where there is no allocator to ask: weights are counted from the parameters and the
workspace is estimated (costs.py)."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import chain

import structlog
import torch

from ferry.plan import expert_formats
from ferry.plan.costs import workspace_bytes_estimate
from ferry.plan.expert_parallel import check_ranks_host, nccl_workspace_bytes, rank_spec
from ferry.plan.mtp_layer import spec_for_method
from ferry.plan.outside_memory import OutsideMemory
from ferry.plan.plan_report import plan_detail_fields, plan_log_fields
from ferry.plan.planner import DEFAULT_MAX_PREFILL_TOKENS, Measured, Plan, PlanRequest, Resolved, resolve
from ferry.plan.prefill_chunk import plan_with_prefill_chunk
from ferry.services.worker.decode_graphs import DecodeGraphs, graph_buckets
from ferry.services.worker.device import select_device
from ferry.services.worker.device_memory import OutsideAllocatorProbe
from ferry.services.worker.dummy_weights import iter_dummy_experts
from ferry.services.worker.executor import StepExecutor
from ferry.services.worker.flags import WorkerBootConfig, copy_engine_tokens, ring_chunk
from ferry.services.worker.late_bound_experts import LateBoundExperts
from ferry.services.worker.loader import ModelFiles, open_model, resident_weights, routed_expert_weights
from ferry.services.worker.offload.host_compute.expert_backends import expert_backend_for
from ferry.services.worker.offload.host_memory.host_banks import mem_available_bytes
from ferry.services.worker.offload.host_memory.huge_pages import anon_huge_bytes, huge_pages_wanted, thp_mode
from ferry.services.worker.offload.stores.build import build_expert_store, host_banks_for, is_offloaded
from ferry.services.worker.offload.stores.expert_parallel import ExpertParallelExperts
from ferry.services.worker.offload.stores.expert_store import ExpertStore
from ferry.services.worker.pools import TORCH_DTYPES, Pools, allocate_pools
from ferry.services.worker.warmup import real_warmup_shapes, warm_up, warmup_shapes
from ferry.services.worker.workspace_profile import (
    profile_decode_graphs_cuda,
    profile_workspace_cuda,
    profiled_or_plan_error,
)
from ferry.shared.eos import eos_token_ids
from ferry.shared.errors import ConfigError, FerryError
from ferry.shared.speculation import DEFAULT_SPECULATIVE_TOKENS, draft_vocab_problems, speculation_problems
from ferry.shared.units import MiB, format_bytes

log = structlog.get_logger("worker")

# Without --gpu-memory a CPU run gets this much (or half the available RAM, if less): the
# planner fills its budget with KV pages, and a CPU run should not claim the machine's memory.
CPU_DEFAULT_BUDGET = 512 * MiB


class MemoryBudgetExceeded(FerryError):
    """The worker reserved more device memory than --gpu-memory allows."""

    exit_status = 2


def _free_memory(device: torch.device, req: PlanRequest) -> tuple[int | None, str]:
    """Free device memory and where it came from. On CPU without --gpu-memory that is a default
    budget, passed as free memory so that no message names a flag the user did not set."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "measured"
    available = mem_available_bytes()  # what a CPU run may use without swapping
    if req.gpu_memory is None:
        default = CPU_DEFAULT_BUDGET if available is None else min(CPU_DEFAULT_BUDGET, available // 2)
        origin = (
            f"the CPU default, min({format_bytes(CPU_DEFAULT_BUDGET)}, half of MemAvailable"
            f"{'' if available is None else ' ' + format_bytes(available)})"
        )
        log.warning(
            "cpu_default_budget",
            budget=format_bytes(default),
            budget_bytes=default,
            message=f"no --gpu-memory on CPU: budget {format_bytes(default)} ({origin}); set --gpu-memory to change it",
        )
        return default, origin
    return available, "MemAvailable"


def _reserved(device: torch.device) -> int:
    """Device memory this process holds through the caching allocator, with free cached blocks
    returned first: what the plan prices is what the device gives away (segments, not tensors),
    so that the promise of --gpu-memory is kept against max_memory_reserved."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device)
    return 0


def _tensor_bytes(model: torch.nn.Module) -> int:
    storages = {}
    for t in chain(model.parameters(), model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _then(step: Callable[[], None], tensors: Callable[[], Iterable]) -> Iterator:
    """A lazy tail for load_weights: `step` runs when every tensor before it has been consumed."""
    step()
    yield from tensors()


def _progress_bars() -> bool:
    """Progress bars only on an interactive terminal: a service's stderr is JSON lines (one per
    event) that log collectors parse, and tqdm's carriage-return redraws would break them; the
    boot's log events carry the durations instead."""
    return sys.stderr.isatty()


def prediction_routers(model) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | None:
    """(router weights, their biases or None) of every MoE layer, what the offloading store's next-layer prediction
    applies to a layer's expert input; None where a MoE layer's router is no linear of that input (Gemma 4's
    normalises and scales the layer's input first): then no prediction."""
    routers = [layer.mlp.gate for layer in model.layers if hasattr(getattr(layer, "mlp", None), "gate")]
    if len(routers) != len(model.spec.moe_layer_indices):
        return None
    biases = [r.bias for r in routers]
    return [r.weight for r in routers], biases if any(b is not None for b in biases) else None


def _host_banks(spec, plan: Plan):
    """Host banks when the plan offloads, allocated before any device pool so a RAM shortage
    (HostMemoryError) comes first; None when every expert has a slot."""
    if not is_offloaded(spec, plan):
        return None
    t0 = time.monotonic()
    banks = host_banks_for(spec, plan, progress=_progress_bars())
    huge = anon_huge_bytes()  # the process's, so the banks' and a little else: page-locking faulted them in
    log.info(
        "expert_host_banks",
        bytes=banks.nbytes,
        size=format_bytes(banks.nbytes),
        pinned=banks.pinned,
        layers=banks.num_layers,
        experts=banks.num_experts,
        seconds=round(time.monotonic() - t0, 3),
        thp_mode=thp_mode(),
        huge_pages_advised=huge_pages_wanted(),
        huge_page_bytes=huge if banks.pinned else None,
    )
    return banks


def _load_dummy_experts(store, spec, dtype: torch.dtype, device: torch.device) -> None:
    """--load-format dummy: the offload store's host banks take the fast seeded fill (tens of GB
    at memcpy speed); an all-resident store gets the per-name dummy tensors on the device, or in a
    quantized expert format its slots filled in place by the format."""
    banks = getattr(store, "banks", None)
    if banks is not None:
        banks.fill_dummy(seed=0, progress=_progress_bars())
        return
    if store.slots.format.quantized:
        store.fill_dummy(seed=0)
        return
    for moe_layer, expert, gate, up, down in iter_dummy_experts(spec, dtype, device, progress=_progress_bars()):
        store.load_expert(moe_layer, expert, gate, up, down)


def boot_worker(cfg: WorkerBootConfig) -> tuple[StepExecutor, Plan]:
    """Boot in three parts: resolve what was asked (here), load the dense weights, measure, plan and
    allocate (`_load_and_plan`), then load the experts and make the executor (`_finish_boot`)."""
    device = select_device(cfg.device)
    graphed_drafts(cfg.plan)  # the speculation flags refused before anything loads
    files = open_model(cfg.model, cfg.load_format, cfg.revision)
    # --speculative-method mtp: the MTP layers' K/V in the plan and the pools (refused for a model without them)
    files = dataclasses.replace(files, spec=spec_for_method(files.spec, cfg.plan.speculative_method))
    problems = draft_vocab_problems(
        cfg.speculative_draft_vocab, cfg.plan.speculative_method or "off", files.spec.vocab_size
    )
    if problems:
        raise ConfigError("; ".join(problems))
    slots = expert_formats.format_of(files.spec)
    if device.type == "cuda" and not slots.reads_on_cuda(files.spec):  # refused before the device is touched
        raise ConfigError(
            f"the routed experts are {slots.name}, which no CUDA expert kernel reads yet: run this model with "
            "--device cpu"
        )
    req = cfg.plan
    free, free_source = _free_memory(device, req)
    r = resolve(files.spec, req)
    try:  # refused before anything loads
        copy_engine_tokens(cfg.expert_copy_engine_tokens, plain_bf16_banks=False)
        ring_chunk(cfg.prefill_ring_chunk, "--prefill-ring-chunk")
        ring_chunk(cfg.long_prefill_ring_chunk, "--long-prefill-ring-chunk")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    # every bucket is profiled (the plan prices the largest set); an offloaded store then captures
    # only those under --expert-copy-engine-tokens (_finish_boot), which take no more memory
    buckets = graph_buckets(files.spec.num_experts_per_tok, r.max_running_requests)
    # expert-parallel ranks run eagerly: a rank's share of a step's pairs is counted on the host
    graphs_wanted = device.type == "cuda" and not cfg.enforce_eager and bool(buckets) and cfg.expert_parallel_size == 1
    baseline = 0
    probe = None
    if device.type == "cuda":
        baseline = _reserved(device)  # what this process held before: not this boot's (tests boot many times)
        torch.cuda.reset_peak_memory_stats(device)
        probe = OutsideAllocatorProbe(device)
    booted = _load_and_plan(cfg, files, r, device, free, free_source, graphs_wanted, probe)
    # the plan sized the running requests (plan/memory_defaults.py), and with them the decode graphs' batches
    buckets = graph_buckets(files.spec.num_experts_per_tok, booted.plan.max_running_requests)
    return _finish_boot(files, booted, r, device, req, free, buckets, probe, baseline)


@dataclasses.dataclass(frozen=True)
class Booted:
    """What loading and planning hand the rest of boot (`_load_and_plan` to `_finish_boot`)."""

    model: torch.nn.Module  # its dense and routed weights loaded
    plan: Plan
    pools: Pools
    store: ExpertStore  # bound to the model's MoE layers
    graph_bytes: int | None  # the decode graphs' bytes profiled for the plan's step; None: no graphs profiled
    experts_started: float  # monotonic seconds when the routed experts began to load
    loading_peak_reserved: int  # the allocator's peak while the dense weights loaded (0 off CUDA)
    # expert-parallel ranks draw the same noise for unseeded requests: their samples, and so the tokens a
    # step scheduled ahead is fed on each rank, are the same (services/worker/expert_ranks.py)
    sampler_seed: int | None
    mtp_head: torch.nn.Module | None = None  # --speculative-method mtp: the draft head, its weights loaded


def _mtp_head(files: ModelFiles, model, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The MTP draft head (services/worker/models/mtp_head.py) with the checkpoint's MTP tensors (a GGUF's MTP
    block: gguf_tensors.py), or, with --load-format dummy, random ones; it turns positions as the target's
    full-attention layers do."""
    from ferry.services.worker.gguf_tensors import mtp_gguf_tensors
    from ferry.services.worker.loader import GGUF_LOAD
    from ferry.services.worker.models.mtp_head import MtpHead, random_mtp_tensors, read_mtp_tensors

    head = MtpHead(files.spec, model.rotary, dtype, device)
    if files.load_format == "dummy":
        head.load_weights(random_mtp_tensors(files.spec, seed=0).items())
    elif files.load_format == GGUF_LOAD:
        head.load_weights(mtp_gguf_tensors(files.model_dir, files.spec))
    else:
        head.load_weights(read_mtp_tensors(files.model_dir, files.spec, progress=_progress_bars()))
    return head


def _load_and_plan(
    cfg: WorkerBootConfig,
    files: ModelFiles,
    r: Resolved,
    device: torch.device,
    free: int | None,
    free_source: str,
    graphs_wanted: bool,
    probe: OutsideAllocatorProbe | None,
) -> Booted:
    """Build the model, load its dense weights, then (between the two weight passes) measure,
    plan, allocate the pools and bind the expert store, then load the routed experts. Returns
    what the rest of boot needs: model, plan, pools, store and the measurements."""
    from ferry.services.worker.models import build_model

    spec, dtype, req = files.spec, TORCH_DTYPES[r.dtype], cfg.plan
    world, rank = cfg.expert_parallel_size, cfg.expert_parallel_rank
    # this rank's routed experts (all of them on one rank): what its plan, banks and store hold
    store_spec = rank_spec(spec, rank, world) if world > 1 else spec

    before = _reserved(device)
    experts = LateBoundExperts(spec.num_experts)
    model = build_model(spec, dtype, device, experts)
    # loaded before the weights are measured: its bytes are in them (plan/mtp_layer.py prices the same for `ferry plan`)
    mtp_head = _mtp_head(files, model, dtype, device) if spec.mtp_kv_layers else None
    if mtp_head is not None:
        mtp_head.draft_vocab = cfg.speculative_draft_vocab
    # a step's workspace and decode graphs' bytes, profiled once each: the chunk chooser asks for a step again
    workspace_by_step: dict[tuple[int, int, int], int] = {}
    graph_bytes_by_step: dict[tuple[int, int, int], int | None] = {}
    booted: Booted | None = None
    expert_device = device  # where the routed experts are read to: set by the plan (host banks: the CPU)

    def plan_and_allocate() -> None:
        """Runs between the two weight passes: the dense weights are in, the experts not yet."""
        nonlocal booted, expert_device
        loading_peak = 0
        if device.type == "cuda":
            weights = _reserved(device) - before  # with the allocator's segment rounding
            # profiling resets the allocator's peak counters: keep the peak of loading
            loading_peak = torch.cuda.max_memory_reserved(device)
        else:
            weights = _tensor_bytes(model) + (_tensor_bytes(mtp_head) if mtp_head is not None else 0)

        def measured(step: Resolved | None) -> Measured:
            """The facts for a step as `step` resolves it (its prefill chunk and running requests): its workspace
            profiled on CUDA (the decode graphs' bytes added), estimated elsewhere; with `step` None, no workspace
            (nothing profiled). plan/prefill_chunk.py asks only for steps it may take."""
            outside = OutsideMemory()
            if device.type == "cuda":
                outside = probe.outside(budget_from_gpu_memory=req.gpu_memory is not None)
            host = mem_available_bytes() if world == 1 else None
            if step is None:
                return Measured(
                    weights, 0, free, "measured", "none", free_source, host_available_bytes=host, outside=outside
                )
            if device.type == "cuda":
                # a chunk too long for this card is a PlanError: the chooser tries a shorter one; a step asked for
                # again (the same chunk under other snapshot counts) is not run again
                step_key = (step.max_prefill_tokens, step.max_running_requests, step.max_model_len)
                if step_key not in workspace_by_step:
                    workspace_by_step[step_key] = profiled_or_plan_error(
                        lambda: profile_workspace_cuda(model, experts, spec, step, device, mtp_head),
                        step.max_prefill_tokens,
                        release=torch.cuda.empty_cache,
                    )
                workspace = workspace_by_step[step_key]
                buckets = graph_buckets(spec.num_experts_per_tok, step.max_running_requests)
                key = _graph_key(step.max_running_requests, step.max_model_len, step.page_size)
                if graphs_wanted and buckets and key not in graph_bytes_by_step:  # the decode graphs' pool and buffers
                    graph_bytes_by_step[key] = profile_decode_graphs_cuda(
                        model, experts, spec, step, device, buckets, mtp_head, graphed_drafts(cfg.plan)
                    )
                source = "profiled"
                if graph_bytes_by_step.get(key) is not None:
                    workspace += graph_bytes_by_step[key]
                    source = f"profiled, {format_bytes(graph_bytes_by_step[key])} of it decode graphs"
                outside = probe.outside(budget_from_gpu_memory=req.gpu_memory is not None)  # profiling loads kernels
            else:
                workspace = workspace_bytes_estimate(
                    spec, r.dtype, step.max_prefill_tokens, step.max_running_requests, step.max_model_len
                )
                source = "estimate"
            if world > 1:  # NCCL's buffers, outside torch's allocator (plan/expert_parallel.py)
                workspace += nccl_workspace_bytes(world) if device.type == "cuda" else 0
            # an expert-parallel rank's banks are checked with the others' (_ranks_host_checked), not alone
            return Measured(
                weights, workspace, free, "measured", source, free_source, host_available_bytes=host, outside=outside
            )

        # an expert-parallel rank streams nothing past its cache (below): no chunk past the default pays there
        plan = plan_with_prefill_chunk(
            store_spec, req, measured, longest=DEFAULT_MAX_PREFILL_TOKENS if world > 1 else None
        )
        if world > 1:
            plan = _ranks_host_checked(plan, cfg, world)
        try:  # the plan's staging slots bound a ring chunk: refused before the banks are pinned
            staging = plan.experts.staging_slots or None
            chunks = (
                ring_chunk(cfg.prefill_ring_chunk, "--prefill-ring-chunk", staging),
                ring_chunk(cfg.long_prefill_ring_chunk, "--long-prefill-ring-chunk", staging),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        banks = _host_banks(store_spec, plan)  # before any pool is allocated (rule 4)
        pools = allocate_pools(store_spec, plan, device)
        store = build_expert_store(
            store_spec,
            plan,
            pools.experts,
            device,
            policy=cfg.expert_policy,
            banks=banks,
            prefetch=cfg.expert_prefetch,
            copy_engine_tokens=copy_engine_tokens(cfg.expert_copy_engine_tokens, _copy_engine_default(banks)),
            ring_chunks=chunks,
        )
        if world > 1:  # the experts this rank owns, its partial sums added over the ranks
            # a rank's share of a step's pairs differs from layer to layer, and a streamed prefill is begun at
            # layer 0 for the whole step: no streaming past the cache under expert parallelism (yet)
            if getattr(store, "ring", None) is not None:
                store.ring = None
            store = ExpertParallelExperts(store, rank, world, spec.num_experts)
        routers = prediction_routers(model)
        if hasattr(store, "set_routers") and routers is not None:
            store.set_routers(*routers)
        experts.bind(store)
        # an offloaded store's experts go to host banks: read them to CPU, never through the device
        expert_device = torch.device("cpu") if banks else device
        graph_key = _graph_key(plan.max_running_requests, plan.max_model_len, plan.kv.page_size)
        booted = Booted(
            model,
            plan,
            pools,
            store,
            graph_bytes_by_step.get(graph_key),
            experts_started=time.monotonic(),
            loading_peak_reserved=loading_peak,
            sampler_seed=cfg.sampler_seed,
            mtp_head=mtp_head,
        )

    dummy = files.load_format == "dummy"
    progress = _progress_bars()
    expert_pass = (lambda: ()) if dummy else (lambda: routed_expert_weights(files, dtype, expert_device, progress))
    model.load_weights(
        chain(resident_weights(files, dtype, device, progress), _then(plan_and_allocate, expert_pass)),
        routed_experts=not dummy,
    )
    if booted is None:  # load_weights reads every tensor it is given, the planning step's tail among them
        raise RuntimeError("the model's load_weights stopped before the routed experts: nothing was planned")
    return booted


def _copy_engine_default(banks) -> bool:
    """Banks whose expert format takes --expert-copy-engine-tokens' default (plain bf16 rows)."""
    return banks is not None and banks.format.copy_engine_default


def _graph_key(max_running_requests: int, max_model_len: int, page_size: int) -> tuple[int, int, int]:
    """What the decode graphs' bytes depend on: their batch sizes (by the running requests) and block tables."""
    return max_running_requests, max_model_len, page_size


def _ranks_host_checked(plan: Plan, cfg: WorkerBootConfig, world: int) -> Plan:
    """Every expert-parallel rank, before it pins a bank: the ranks' banks together against the host as
    rank 0 found it before any rank started (or --host-memory), PlanError on every rank alike where they
    do not fit (plan/expert_parallel.py's check_ranks_host, which `ferry plan --gpus` makes too). Returns the
    plan with the host it was checked against."""
    import torch.distributed as dist

    banks: list = [None] * world
    dist.all_gather_object(banks, plan.host.expert_bank_bytes)  # every rank calls it here, once
    if cfg.plan.host_memory is not None:
        available, source = cfg.plan.host_memory, "--host-memory"
    else:
        available, source = cfg.host_available_bytes, "MemAvailable (before the ranks started)"
    check_ranks_host(banks, plan.host.reserve_bytes, available, source)
    host = dataclasses.replace(
        plan.host, available_bytes=available, available_source=source if available is not None else "unknown"
    )
    return dataclasses.replace(plan, host=host)


def _finish_boot(
    files: ModelFiles,
    booted: Booted,
    r: Resolved,
    device: torch.device,
    req: PlanRequest,
    free: int | None,
    buckets: list[int],
    probe: OutsideAllocatorProbe | None,
    baseline_reserved: int,
) -> tuple[StepExecutor, Plan]:
    """Load dummy experts, warm the offload store's slots, attach the plan's expert backend, capture the
    decode graphs, check the budget was kept (`baseline_reserved`: what the process held before this boot),
    log the plan, and hand back the executor."""
    spec, dtype, model, plan, store = files.spec, TORCH_DTYPES[r.dtype], booted.model, booted.plan, booted.store
    dummy = files.load_format == "dummy"
    if dummy:
        _load_dummy_experts(store, spec, dtype, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the expert pass's staging tensors are not part of the plan
    preloaded = store.preload()  # an offload store warms its free slots; the all-resident one has nothing to do
    log.info(
        "experts_loaded",
        seconds=round(time.monotonic() - booted.experts_started, 3),
        source="dummy" if dummy else "checkpoint",
        preloaded_slots=preloaded,
        expert_format=plan.experts.format,
        expert_store=store.report()["policy"],
    )
    expert_backend_for(plan.expert_backend).attach(store, spec, plan, dtype, device)  # measured on the loaded banks
    if device.type == "cuda":  # first-use compiles and tunings at boot, not inside a request
        t0 = time.monotonic()
        ran = warm_up(
            model,
            booted.pools,
            plan.kv.page_size,
            device,
            warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests),
            real_warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests),
            max_prefill_tokens=plan.max_prefill_tokens,
        )
        log.info("warmed_up", steps=ran, seconds=round(time.monotonic() - t0, 3))
    # decode steps the store copies with the copy engine run eagerly: no graph for them
    # (a smaller set than the one profiled, so within the price)
    below = getattr(store, "copy_engine_tokens", None)
    if below is not None:
        buckets = graph_buckets(spec.num_experts_per_tok, plan.max_running_requests, below=below)
    graphs = (
        _capture_graphs(booted, spec, device, buckets, store, graphed_drafts(req))
        if booted.graph_bytes is not None and buckets
        else None
    )
    if device.type == "cuda":
        _restart_statistics(store)  # the warm-up and the captures ran padding rows only
    _check_budget(device, req, free, booted.loading_peak_reserved, baseline_reserved, probe)
    log.info("plan", **plan_log_fields(plan))
    log.debug(
        "plan_detail",
        **plan_detail_fields(plan),
        model=str(files.model_dir),
        device=str(device),
        load_format=files.load_format,
        cuda_graphs=graphs.buckets if graphs is not None else None,
    )
    return StepExecutor(
        model,
        booted.pools,
        spec,
        plan,
        device,
        store=store,
        graphs=graphs,
        tokenizer_dir=files.model_dir,
        eos_token_ids=eos_token_ids(files.model_dir),
        sampler_seed=booted.sampler_seed,
        mtp_head=booted.mtp_head,
    ), plan


def graphed_drafts(req: PlanRequest) -> int:
    """The drafts a row carries at most where speculation is on (the verify and MTP chain graphs' shapes), else 0;
    a bad --speculative-method or --speculative-tokens is a ConfigError naming the flag."""
    method = req.speculative_method or "off"
    tokens = DEFAULT_SPECULATIVE_TOKENS if req.speculative_tokens is None else req.speculative_tokens
    problems = speculation_problems(method, tokens)
    if problems:
        raise ConfigError("; ".join(problems))
    return 0 if method == "off" else tokens


def _capture_graphs(booted: Booted, spec, device: torch.device, buckets: list[int], store, drafts: int):
    """Capture the decode graphs into the workspace the plan priced for them (measured before the
    plan by capturing the same graphs); if the real capture takes more, it is dropped and every
    step runs eagerly, so the promise of --gpu-memory holds either way."""
    t0 = time.monotonic()
    before = _reserved(device)
    plan, priced = booted.plan, booted.graph_bytes
    graphs = DecodeGraphs(
        booted.model,
        booted.pools,
        plan.kv.page_size,
        plan.max_model_len,
        buckets,
        device,
        spec.vocab_size,
        plan.max_running_requests,
        count_step=store.count_step_on_device,
        mtp_head=booted.mtp_head,
        speculative_tokens=drafts,
    )
    try:
        graphs.capture()
    except RuntimeError as exc:  # profiling captured the same graphs, so this is not expected; stay up anyway
        log.warning("cuda_graphs_unavailable", error=str(exc), message="decode runs eagerly")
        graphs = None
    taken = _reserved(device) - before
    if graphs is None:
        return None
    if taken > priced:
        log.warning(
            "cuda_graphs_dropped",
            taken=taken,
            priced=priced,
            message=f"the decode graphs took {format_bytes(taken)}, more than the {format_bytes(priced)} "
            "the plan holds for them: decode runs eagerly",
        )
        del graphs
        torch.cuda.empty_cache()
        return None
    log.info("cuda_graphs", buckets=buckets, bytes=taken, priced=priced, seconds=round(time.monotonic() - t0, 3))
    return graphs


def _restart_statistics(store) -> None:
    """The expert store's statistics start afresh: what boot ran is not served traffic."""
    store.stats_to_host()
    store.end_step()
    store.stats.reset()


def _check_budget(
    device: torch.device,
    req: PlanRequest,
    free: int | None,
    earlier_peak: int,
    baseline: int = 0,
    probe: OutsideAllocatorProbe | None = None,
) -> None:
    """--gpu-memory is a promise about the whole process: after boot, what this boot ever reserved (beyond what
    the process held before it: `baseline`) plus what it holds outside the allocator must be within it; without
    the flag, within the free memory read at start plus the context it already held then."""
    if device.type != "cuda":
        return
    limit = req.gpu_memory if req.gpu_memory is not None else free
    reserved = max(torch.cuda.max_memory_reserved(device), earlier_peak) - baseline
    outside = 0
    if probe is not None:
        outside = probe.held() - (probe.at_start if req.gpu_memory is None else 0)
    log.info(
        "device_memory",
        reserved_peak=reserved,
        outside_allocator=outside,
        outside_source="NVML" if probe is not None and probe.nvml else "estimate",
        process_total=reserved + outside,
        limit=limit,
    )
    if limit is not None and reserved + outside > limit:
        what = (
            f"--gpu-memory {format_bytes(limit)}"
            if req.gpu_memory is not None
            else f"free memory {format_bytes(limit)}"
        )
        raise MemoryBudgetExceeded(
            f"boot took {format_bytes(reserved + outside)} of device memory ({format_bytes(reserved)} reserved by the "
            f"allocator, {format_bytes(outside)} outside it), more than {what}; lower --memory-ratio to leave the "
            "allocator more headroom"
        )
