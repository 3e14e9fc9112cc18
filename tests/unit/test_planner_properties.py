"""Property tests: for random model shapes, budgets and flags, a plan either fails in the plan or
keeps every promise — total within budget, requirements exact, floors met, and each pool's
allocated bytes equal to its priced bytes."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.plan import pool_layout as L
from ferry.plan.model_config import parse_model_config
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.worker.pools import allocate_pool
from ferry.shared.errors import ConfigError, PlanError
from ferry.shared.units import ceil_div


@st.composite
def model_configs(draw):
    hybrid = draw(st.booleans())
    kv_heads = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 7))
    raw = {
        "model_type": "qwen3_5_moe_text" if hybrid else "qwen3_moe",
        "vocab_size": draw(st.integers(8, 5000)),
        "hidden_size": draw(st.sampled_from([16, 32, 48, 64])),
        "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * draw(st.integers(1, 4)),
        "num_key_value_heads": kv_heads,
        "head_dim": draw(st.sampled_from([8, 16, 32])),
        "num_experts": draw(st.integers(1, 64)),
        "moe_intermediate_size": draw(st.integers(1, 96)),
        "max_position_embeddings": draw(st.integers(16, 4096)),
        "torch_dtype": draw(st.sampled_from(["bfloat16", "float32"])),
    }
    raw["num_experts_per_tok"] = draw(st.integers(1, raw["num_experts"]))
    quantized = draw(st.sampled_from([None, "nvfp4", "fp8", "mxfp4", "gguf"]))
    if quantized == "nvfp4":  # NVFP4 groups 16 inputs: both projections' input sizes are multiples of 16
        raw["moe_intermediate_size"] = 16 * draw(st.integers(1, 6))
        raw["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    elif quantized == "mxfp4":  # MXFP4 groups 32 inputs
        raw["hidden_size"] = draw(st.sampled_from([32, 64]))
        raw["moe_intermediate_size"] = 32 * draw(st.integers(1, 3))
        raw["quantization_config"] = {"quant_method": "mxfp4"}
    elif quantized == "gguf":  # a GGUF file's experts in one ggml type: rows of whole blocks (32 or 256 inputs)
        ggml_type, block = draw(
            st.sampled_from([("Q8_0", 32), ("Q4_0", 32), ("Q5_1", 32), ("Q4_K", 256), ("Q6_K", 256)])
        )
        raw["hidden_size"] = block * draw(st.integers(1, 2))
        raw["moe_intermediate_size"] = block * draw(st.integers(1, 2))
        raw["quantization_config"] = {"quant_method": "gguf", "ggml_type": ggml_type}
    elif quantized == "fp8":
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if hybrid:
        interval = draw(st.integers(1, 4))
        raw["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 or i == layers - 1 else "linear_attention"
            for i in range(layers)
        ]
        nk = draw(st.integers(1, 4))
        raw |= {
            "linear_conv_kernel_dim": draw(st.integers(2, 5)),
            "linear_num_key_heads": nk,
            "linear_num_value_heads": nk * draw(st.integers(1, 3)),
            "linear_key_head_dim": draw(st.sampled_from([4, 8, 16])),
            "linear_value_head_dim": draw(st.sampled_from([4, 8, 16])),
            "shared_expert_intermediate_size": draw(st.integers(1, 64)),
        }
    return raw


@st.composite
def requests(draw, spec):
    opt = st.none
    kv_choice = draw(st.sampled_from(["none", "tokens", "pages"]))
    moe_choice = draw(st.sampled_from(["none", "size", "rate"]))
    return PlanRequest(
        gpu_memory=draw(st.integers(1, 400 * 2**20)),
        memory_ratio=draw(opt() | st.floats(0.05, 1.0)),
        num_tokens=draw(st.integers(1, 40_000)) if kv_choice == "tokens" else None,
        num_pages=draw(st.integers(1, 3000)) if kv_choice == "pages" else None,
        kv_reserve_tokens=draw(opt() | st.integers(0, 40_000)),
        moe_cache_size=draw(st.integers(spec.num_experts, spec.total_experts)) if moe_choice == "size" else None,
        moe_cache_rate=draw(st.floats(0.001, 1.0)) if moe_choice == "rate" else None,
        page_size=draw(opt() | st.sampled_from([1, 4, 16, 64])),
        max_running_requests=draw(opt() | st.integers(1, 64)),
        max_prefill_tokens=draw(opt() | st.integers(1, 8192)),
        max_model_len=draw(opt() | st.integers(1, spec.max_position_embeddings)),
        host_memory=draw(opt() | st.integers(1, 4 * 2**30)),
        expert_bank_format=draw(opt() | st.sampled_from(["auto", "packed", "plain"])),
        linear_state_snapshots=draw(opt() | st.integers(0, 200)),
        kv_cache_dtype=draw(opt() | st.sampled_from(["auto", "fp8"])),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plan_keeps_its_promises_or_fails_in_the_plan(data):
    spec = parse_model_config(data.draw(model_configs()))
    req = data.draw(requests(spec))
    measured = Measured(
        weights_bytes=data.draw(st.integers(0, 50 * 2**20)), workspace_bytes=data.draw(st.integers(0, 20 * 2**20))
    )
    try:
        plan = make_plan(spec, req, measured)
    except ConfigError as exc:  # the only config error reachable here: a rate below the floor
        assert "--moe-cache-rate" in str(exc)
        return
    except PlanError as exc:
        message = str(exc)
        assert (
            ("budget" in message and "terms:" in message)
            or "host RAM" in message
            or "--expert-bank-format packed keeps bf16 experts" in message
        ), message
        return

    assert plan.total_bytes <= plan.budget_bytes and plan.headroom_bytes >= 0
    assert plan.total_bytes == (
        plan.weights_bytes
        + plan.workspace_bytes
        + plan.kv.bytes
        + plan.linear_state.bytes
        + plan.linear_state_snapshots.bytes
        + plan.experts.bytes
    )
    ps = plan.kv.page_size
    if req.num_pages is not None:
        assert plan.kv.pages == req.num_pages
    elif req.num_tokens is not None:
        assert plan.kv.pages == ceil_div(req.num_tokens, ps)
    else:
        floor = req.kv_reserve_tokens if req.kv_reserve_tokens is not None else plan.max_model_len
        assert plan.kv.tokens >= floor
    assert plan.kv.tokens == plan.kv.pages * ps
    assert plan.kv.cache_dtype == (req.kv_cache_dtype or "auto")
    assert plan.kv.bytes_per_token == L.kv_bytes_per_token(spec, plan.dtype, plan.kv.cache_dtype)
    if req.moe_cache_size is not None:
        assert plan.experts.slots == req.moe_cache_size
    elif req.moe_cache_rate is None:
        assert spec.num_experts <= plan.experts.slots <= spec.total_experts
    assert plan.linear_state.slots == (plan.max_running_requests if spec.linear_attention_layers else 0)
    _snapshots_are_a_requirement_or_a_default_that_only_shrinks(spec, req, plan)
    _host_banks_are_priced_in_the_expert_format(spec, req, plan)

    # each pool allocates exactly what it priced (small enough to allocate on CPU here)
    layouts = [
        (L.kv_pool_layout(spec, plan.dtype, plan.kv.pages, ps, plan.kv.cache_dtype), plan.kv.bytes),
        (L.linear_state_layout(spec, plan.dtype, plan.linear_state.slots), plan.linear_state.bytes),
        (L.expert_slot_layout(spec, plan.dtype, plan.experts.slots, plan.max_prefill_tokens), plan.experts.bytes),
        (
            L.linear_state_snapshot_layout(spec, plan.dtype, plan.linear_state_snapshots.snapshots),
            plan.linear_state_snapshots.bytes,
        ),
    ]
    _expert_pool_is_named_to_the_byte(spec, plan)
    for layout, priced in layouts:
        assert layout.nbytes == priced
        if priced <= 64 * 2**20:
            pool = allocate_pool(layout, "cpu")
            assert pool.nbytes == priced
            for t in layout.tensors:
                assert tuple(pool.views[t.name].shape) == t.shape


def _snapshots_are_a_requirement_or_a_default_that_only_shrinks(spec, req, plan) -> None:
    """--linear-state-snapshots N gives N exactly (hybrid models; none otherwise); the default is two per
    running request, fewer only when those did not fit beside the floors."""
    from ferry.plan.planner import DEFAULT_SNAPSHOT_BUDGET_SHARE, DEFAULT_SNAPSHOTS_PER_RUNNING_REQUEST

    s = plan.linear_state_snapshots
    if not spec.linear_attention_layers:
        assert s.snapshots == s.bytes == 0
        return
    assert s.bytes_per_snapshot == (L.linear_state_bytes_per_slot(spec, plan.dtype) if s.snapshots else 0)
    if req.linear_state_snapshots is not None:
        assert s.snapshots == req.linear_state_snapshots and s.source == "--linear-state-snapshots"
    else:
        default = DEFAULT_SNAPSHOTS_PER_RUNNING_REQUEST * plan.max_running_requests
        assert s.snapshots == default or (
            ("fewer to fit" in s.source or "capped" in s.source) and s.snapshots < default
        )
        assert s.bytes <= plan.budget_bytes // DEFAULT_SNAPSHOT_BUDGET_SHARE


def _host_banks_are_priced_in_the_expert_format(spec, req, plan) -> None:
    """Banks only when the plan offloads, in the slots' format for quantized experts (a packed request
    for them fails in the plan), within --host-memory less the reserve when it is given."""
    from ferry.plan import expert_formats as F
    from ferry.plan import host_memory as H

    host = plan.host
    if plan.experts.slots == plan.experts.total:
        assert host.expert_bank_bytes == 0
        return
    if F.slot_format(spec) != F.BF16:
        assert host.expert_bank_format == "plain" and plan.experts.format == F.slot_format(spec)
    assert host.expert_bank_bytes == H.expert_bank_bytes(spec, plan.dtype, host.expert_bank_format)
    if req.host_memory is not None:
        assert host.expert_bank_bytes + H.HOST_RESERVE_BYTES <= req.host_memory


def _expert_pool_is_named_to_the_byte(spec, plan) -> None:
    """The expert pool's bytes as `ferry plan` names them (table and --json): its slots, the prefill's
    staging slots and the device cache's state (when it offloads), and the alignment between and after
    them, which add up to the pool; each part read from the layout's own tensors."""
    e = plan.experts
    assert e.slots * e.bytes_per_slot + e.staging_bytes + e.cache_state_bytes + e.padding_bytes == e.bytes
    layout = L.expert_slot_layout(spec, plan.dtype, e.slots, plan.max_prefill_tokens)
    offloads = e.slots < e.total
    assert e.staging_slots == (L.prefill_staging_slots(spec, plan.dtype) if offloads else 0)
    assert e.staging_bytes == e.staging_slots * e.bytes_per_slot
    state = L.expert_cache_state(spec, e.slots, plan.max_prefill_tokens) if offloads else ()
    assert e.cache_state_bytes == sum(t.nbytes for t in state)
    assert 0 <= e.padding_bytes < L.POOL_ALIGN + L.VIEW_ALIGN * len(layout.tensors)
    assert e.padding_bytes == layout.nbytes - sum(t.nbytes for t in layout.tensors)
