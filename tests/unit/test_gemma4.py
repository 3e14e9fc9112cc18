"""gemma4 (Gemma 4 MoE) beyond the parity list (test_model_parity.py): each of what it adds (the logit soft cap,
proportional rotary on its full layers, K = V, the value norm, the scaled router, layer scalars, the embedding
multiplier, the softmax scale, the sliding window, gelu experts) is what makes Ferry equal transformers (planting
its absence fails the comparison), its rotary frequencies and router are transformers' own, the published
configs (bf16 and nvidia's NVFP4) read as the model they are, what it cannot serve is refused by field, `ferry
plan` prices gemma-4-26b-a4b tensor by tensor and KV group by group, its full-size dummy weights are what the
model loads and its pools what the plan priced, and `ferry generate` with experts offloaded equals resident and
transformers."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_harness import PagedRunner, assert_logits_close, hf_greedy
from tiny_models import redrawn_tiny_checkpoint, tiny_model

from ferry.kernels.expert_epilogue import GELU_TANH_AND_MUL, GELU_TANH_CODE, SILU_AND_MUL, SILU_CODE
from ferry.plan.costs import ALLOC_GRANULE, resident_weight_bytes_from_shapes, resident_weight_shapes
from ferry.plan.expert_backend import host_compute_refusal, physical_cores, plan_expert_backend
from ferry.plan.model_config import load_model_config, parse_model_config
from ferry.plan.model_spec import FULL_ATTENTION, LayerRope
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.shared.errors import ConfigError
from tests.unit.test_generate_e2e import ferry_generate, transformers_greedy

GEMMA4 = Path(__file__).resolve().parents[1] / "data/models/gemma-4-26b-a4b"
GEMMA4_NVFP4 = Path(__file__).resolve().parents[1] / "data/models/gemma-4-26b-a4b-nvfp4"
PROMPT = [(i * 37 + 11) % 96 for i in range(21)]  # longer than the window (8) by far


@pytest.fixture(scope="module")
def model():
    hf, spec = tiny_model("gemma4", seed=3)
    tokens, step_logits, prompt_logits = hf_greedy(hf, PROMPT, 8)
    return hf, spec, (tokens, step_logits, prompt_logits)


@pytest.mark.parametrize("ring_slice_tokens", [0, 6])
def test_prompt_and_greedy_decode_equal_transformers(model, ring_slice_tokens):
    """The sliding layers' K/V paged over the context, or in rings of their own (kvwin's groups): the same."""
    hf, spec, (tokens, step_logits, prompt_logits) = model
    assert spec.attention_head_dims == (16, 16, 32) and spec.attention_kv_heads == (2, 2, 1)
    assert spec.layer_value_is_key == (False, False, True) and spec.attention_windows == (8, 8, 0)
    runner = PagedRunner(spec, hf, page_size=4, ring_slice_tokens=ring_slice_tokens)
    assert bool(runner.pools.kv.ring_pages(0)) == bool(ring_slice_tokens) and runner.pools.kv.ring_pages(2) == 0
    ours_prompt, ours_tokens, ours_steps = runner.generate(1, PROMPT, 8, chunks=[5, 1, 6, 6])
    assert_logits_close(ours_prompt, prompt_logits)
    assert ours_tokens == tokens
    assert_logits_close(ours_steps, step_logits)


@torch.no_grad()
def _plant(runner: PagedRunner, fault: str) -> None:
    model = runner.model
    if fault == "no soft cap":
        model.spec = dataclasses.replace(model.spec, final_logit_softcapping=0.0)
    elif fault == "no embedding multiplier":
        model.spec = dataclasses.replace(model.spec, embedding_multiplier=1.0)
    elif fault == "full layers' rotary not proportional":  # the first quarter of the head turned instead
        for rotary in model.rotaries:
            if rotary.rotary_dim == 32:
                plain = RotaryEmbedding(32, 0.25, 1e6)
                rotary.inv_freq_both, rotary.rotary_dim = plain.inv_freq_both, plain.rotary_dim
    elif fault == "silu experts":
        slots = runner.pools.experts
        slots.gemm13 = dataclasses.replace(slots.gemm13, activation=SILU_AND_MUL)
    for layer in model.layers:
        attention = layer.self_attn
        if fault == "no value norm":
            attention.value_norm_eps = None
        elif fault == "scale head_dim ** -0.5":
            attention.scale = attention.head_dim**-0.5
        elif fault == "no window":
            attention.window = 0
        elif fault == "no per-expert scale":
            layer.router.per_expert_scale.fill_(1.0)
        elif fault == "no layer scalar":
            layer.layer_scalar.fill_(1.0)
        elif fault == "no dense MLP":
            layer.mlp.down_proj.weight.zero_()


FAULTS = [
    "no soft cap",
    "no embedding multiplier",
    "full layers' rotary not proportional",
    "silu experts",
    "no value norm",
    "scale head_dim ** -0.5",
    "no window",
    "no per-expert scale",
    "no layer scalar",
    "no dense MLP",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_each_part_of_gemma4_is_needed_to_equal_transformers(model, fault):
    hf, spec, (_, _, prompt_logits) = model
    runner = PagedRunner(spec, hf, page_size=4)
    _plant(runner, fault)
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_close(runner.step([(1, PROMPT)])[0], prompt_logits)


def test_the_rotary_frequencies_are_transformers_for_each_layer_type():
    """gemma-4-26b-a4b: sliding layers' default rotary over 256 channels, full layers' proportional rotary over
    512 (a quarter of the pairs turning, paired across the whole head)."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    raw = json.loads((GEMMA4 / "config.json").read_text())
    spec = parse_model_config(raw)
    theirs = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**raw["text_config"]))
    for kind, layer in (("sliding_attention", 0), (FULL_ATTENTION, 5)):
        rope, head_dim = spec.layer_ropes[layer], spec.layer_head_dim(layer)
        ours = RotaryEmbedding(head_dim, rope.partial_rotary_factor, rope.theta, proportional=rope.proportional)
        torch.testing.assert_close(ours.inv_freq, getattr(theirs, f"{kind}_inv_freq"), rtol=0, atol=0)
        assert ours.rotary_dim == head_dim
    assert spec.layer_ropes[5] == LayerRope(1e6, 0.25, proportional=True)
    assert int((RotaryEmbedding(512, 0.25, 1e6, proportional=True).inv_freq > 0).sum()) == 64


def test_the_router_is_transformers_gemma4_router():
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    from ferry.services.worker.models.gemma4 import Gemma4Router

    raw = dict(hidden_size=64, num_experts=16, top_k_experts=4, enable_moe_block=True, moe_intermediate_size=8)
    theirs = Gemma4TextRouter(Gemma4TextConfig(**raw))
    _, spec = tiny_model("gemma4", seed=1, hidden_size=64, num_experts=16, num_experts_per_tok=4)
    ours = Gemma4Router(spec, torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mine, name in ((ours.proj.weight, "proj.weight"), (ours.scale, "scale")):
            mine.copy_(torch.randn(mine.shape, generator=g))
            theirs.get_parameter(name).copy_(mine)
        ours.per_expert_scale.copy_(1 + 0.3 * torch.randn(16, generator=g))
        theirs.per_expert_scale.copy_(ours.per_expert_scale)
    x = 3 * torch.randn(200, 64, generator=g)
    _, ref_weights, ref_ids = theirs(x)
    ids, weights = ours(x)
    order, ref_order = ids.sort(dim=-1).indices, ref_ids.sort(dim=-1).indices
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-6)


def test_the_published_configs_read_as_gemma_4_26b_a4b():
    spec = load_model_config(GEMMA4)
    full = tuple(i for i in range(30) if i % 6 == 5)
    assert spec.arch == "gemma4" and spec.num_layers == 30 and spec.tie_word_embeddings
    assert [i for i, w in enumerate(spec.attention_windows) if w == 0] == list(full)
    assert {spec.attention_windows[i] for i in range(30) if i not in full} == {1024}
    assert [spec.layer_head_dim(i) for i in (0, 5)] == [256, 512]
    assert [spec.layer_kv_heads(i) for i in (0, 5)] == [8, 2]
    assert spec.layer_value_is_key == tuple(i in full for i in range(30))
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (128, 8, 704)
    assert spec.intermediate_size == 2112 and spec.moe_beside_dense_mlp
    assert spec.final_logit_softcapping == 30.0 and spec.embedding_multiplier == math.sqrt(2816)
    assert spec.expert_activation == spec.mlp_activation == "gelu_tanh" and spec.attention_scale == 1.0
    assert spec.quantization is None
    nvfp4 = load_model_config(GEMMA4_NVFP4)  # the dense layers excluded by glob, the experts (layers.N.experts) not
    assert nvfp4.quantization.expert_format == "nvfp4"
    assert dataclasses.replace(nvfp4, quantization=None) == spec


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
        (dict(hidden_size_per_layer_input=None), "hidden_size_per_layer_input"),  # transformers' default: 256
        (dict(num_kv_shared_layers=10), "num_kv_shared_layers"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention 'all'"),
        (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
        (dict(enable_moe_block=False), "enable_moe_block is false"),
        (dict(sliding_window=0), "sliding_window must be positive"),
        (dict(layer_types=["chunked_attention"] * 30), "unknown layer_types"),
        (dict(rope_parameters={"full_attention": {"rope_type": "yarn"}}), "rope_type 'yarn'"),
        (dict(rope_parameters={"full_attention": {"rope_type": "proportional", "factor": 8.0}}), "factor 8.0"),
        (dict(per_layer_config={"40": {"head_dim": 128}}), "per_layer_config key '40'"),
        (dict(num_global_key_value_heads=3), "layer 5: 3 KV heads"),
    ],
)
def test_config_json_fields_gemma4_cannot_serve_are_refused_by_field(fields, message):
    raw = json.loads((GEMMA4 / "config.json").read_text())
    raw["text_config"].update(fields)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_model_config(raw)


def _granules(*shape: int) -> int:
    """bf16 bytes of one tensor as the planner counts them: rounded up to the allocator's granule."""
    return -(-2 * math.prod(shape) // ALLOC_GRANULE) * ALLOC_GRANULE


def test_ferry_plan_prices_gemma_4_26b_a4b_tensor_by_tensor():
    """At 24 GiB: the resident weights worked out from the architecture (not from the planner's tables), the two
    KV groups at their own shapes, the experts' slots, and the gelu experts in packed banks the host may compute."""
    hidden, vocab, heads, dense, experts, moe = 2816, 262144, 16, 2112, 128, 704
    sliding = (
        _granules(heads * 256, hidden) + 2 * _granules(8 * 256, hidden)  # q, k, v
        + _granules(hidden, heads * 256) + 2 * _granules(256)  # o, q/k norms
    )  # fmt: skip
    full = _granules(heads * 512, hidden) + _granules(2 * 512, hidden) + _granules(hidden, heads * 512)  # no v
    full += 2 * _granules(512)
    layer = (
        7 * _granules(hidden)  # input, post-attention, pre/post feed-forward, _1, pre/post _2 norms
        + 3 * _granules(dense, hidden)  # the dense MLP
        + _granules(experts, hidden) + _granules(hidden) + _granules(experts) + _granules(1)  # router, layer scalar
    )  # fmt: skip
    expected = _granules(vocab, hidden) + _granules(hidden) + 25 * (layer + sliding) + 5 * (layer + full)  # tied
    out = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "plan", "--model", str(GEMMA4), "--gpu-memory", "24GiB"]
        + ["--host-memory", "128GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["weights_bytes"] == expected
    assert plan["experts"]["total"] == 30 * experts
    assert plan["experts"]["bytes_per_slot"] == 3 * moe * hidden * 2
    groups = {g["window"]: g for g in plan["kv"]["groups"]}
    assert groups[0]["layers"] == [5, 11, 17, 23, 29] and groups[1024]["kv_heads"] == 8
    assert (
        groups[0]["bytes_per_token"] == 5 * 2 * 2 * 512 * 2 and groups[1024]["bytes_per_token"] == 25 * 2 * 8 * 256 * 2
    )
    assert plan["host"]["expert_bank_format"] == "packed"  # the banks carry the gelu for the host to compute
    # the host may compute them: auto decides by this machine's cores alone
    assert plan["expert_backend"]["backend"] == plan_expert_backend(None, None, True, physical_cores()).backend
    assert plan["total_bytes"] <= plan["budget_bytes"]


def test_the_host_computes_gelu_experts_so_every_backend_serves_gemma4(model):
    """The host's kernels compute gelu_tanh(gate) * up (tests/unit/offload/test_host_expert_epilogue.py): the plan
    lets cpu, hybrid and auto's host share take Gemma 4's misses, and its bf16 experts' packed banks (auto's) carry
    the activation for the host to compute."""
    from ferry.services.worker.expert_formats import bank_format_for
    from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

    published = load_model_config(GEMMA4)
    assert host_compute_refusal(published) is None
    for backend, threads in (("cpu", None), ("hybrid", None), ("auto", 8)):
        chosen = plan_expert_backend(backend, threads, True, 64, host_refusal=host_compute_refusal(published))
        assert chosen.backend == ("hybrid" if backend == "auto" else backend)
    _, spec, _ = model
    plan = SimpleNamespace(host=SimpleNamespace(expert_bank_format="auto"), dtype="bfloat16")
    assert bank_format_for(spec, plan).activation == GELU_TANH_AND_MUL
    banks = PackedHostBanks.for_model(spec, "bfloat16", pin=False, progress=False)
    assert banks.format.activation == GELU_TANH_AND_MUL


class _HostComputedExperts:
    """The model's expert store with every routed expert computed by the host's C kernel from host banks holding
    the slots' experts (plain float32, or packed for bf16): what the host share computes of a miss, here of every
    expert (a worker on a CPU device keeps its share off: the model computes every expert there already)."""

    def __init__(self, spec, slots, dtype: torch.dtype):
        from ferry.services.worker.offload.host_compute.host_experts import HostExperts
        from ferry.services.worker.offload.host_memory.host_banks import HostBanks
        from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

        e, i = spec.num_experts, spec.moe_intermediate_size
        layers = len(spec.moe_layer_indices)
        if dtype == torch.float32:
            banks = HostBanks.for_model(spec, "float32", pin=False, progress=False)
            for layer in range(layers):
                banks.w13[layer].copy_(slots.w13[layer * e : (layer + 1) * e])
                banks.w2[layer].copy_(slots.w2[layer * e : (layer + 1) * e])
        else:
            banks = PackedHostBanks.for_model(spec, "bfloat16", pin=False, progress=False)
            for layer in range(layers):
                for expert in range(e):
                    w13, w2 = slots.w13[layer * e + expert], slots.w2[layer * e + expert]
                    banks.load_expert(layer, expert, w13[:i], w13[i : 2 * i], w2)
            banks.seal()
        self.num_experts = e
        self.host = HostExperts(banks, dtype, threads=2, kernel="c")
        assert self.host.backend == "c" and self.host.c_kernel.activation == GELU_TANH_CODE

    def forward(self, moe_layer, x, topk_ids, topk_weights, n_rows=None, summed=True) -> torch.Tensor:
        pairs = [(t, e, w) for t in range(x.shape[0]) for e, w in zip(topk_ids[t].tolist(), topk_weights[t].tolist())]
        return self.host.compute(moe_layer, x.contiguous(), pairs).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generation_with_the_host_computing_the_experts_equals_resident(model, dtype):
    """Tiny Gemma 4 with its routed experts computed on the host (plain float32 banks; bf16's packed banks): the
    tokens all-resident generates and, in float32, its logits (the host's sums run in another order); the host
    computing SiLU instead is caught."""
    hf, spec, _ = model
    resident = PagedRunner(spec, hf, page_size=4, dtype=dtype)
    want_prompt, want_tokens, want_steps = resident.generate(1, PROMPT, 8, chunks=[5, 1, 6, 6])
    runner = PagedRunner(spec, hf, page_size=4, dtype=dtype)
    store = _HostComputedExperts(spec, runner.pools.experts, dtype)
    for layer in runner.model.layers:
        object.__setattr__(layer, "experts", store)
    got_prompt, got_tokens, got_steps = runner.generate(1, PROMPT, 8, chunks=[5, 1, 6, 6])
    assert got_tokens == want_tokens
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    assert_logits_close(got_prompt, want_prompt, rel)
    assert_logits_close(got_steps, want_steps, rel)
    store.host.c_kernel.activation = SILU_CODE
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_close(runner.step([(2, PROMPT)])[0], want_prompt, rel)
    store.host.close()


class _CountingStore:
    """Counts the experts handed to it (the model under test needs somewhere to put them)."""

    def __init__(self, num_experts):
        self.num_experts, self.loaded = num_experts, set()

    def load_expert(self, moe_layer, expert, gate, up, down):
        self.loaded.add((moe_layer, expert))


@pytest.mark.parametrize("config_dir", [GEMMA4, GEMMA4_NVFP4])
def test_full_size_dummy_weights_are_what_the_model_loads_and_the_pools_what_the_plan_priced(config_dir):
    """--load-format dummy at full size: its names and shapes are exactly what the model accepts and its
    parameters take the planned bytes (the meta device: no memory, no compute); the pools allocate what the plan
    priced, both KV groups and the experts' slots in the checkpoint's format."""
    from ferry.services.worker.models import build_model
    from ferry.services.worker.models.weights import routed_expert_shapes
    from ferry.services.worker.pools import allocate_pools

    spec = load_model_config(config_dir)
    store = _CountingStore(spec.num_experts)
    model = build_model(spec, torch.bfloat16, "meta", store)
    shapes = dict(resident_weight_shapes(spec), **routed_expert_shapes(spec))
    model.load_weights((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes.items())
    assert len(store.loaded) == spec.total_experts
    params = sum(_granules(*p.shape) for p in model.parameters())
    fused = 30 + 25 + 30  # q|k(|v) of each attention, gate|up of each MLP: one tensor each, not two or three
    assert abs(params - resident_weight_bytes_from_shapes(spec, "bfloat16")) <= fused * ALLOC_GRANULE
    request = PlanRequest(gpu_memory=24 * 2**30, host_memory=128 * 2**30, max_running_requests=4)
    plan = make_plan(spec, request, Measured(resident_weight_bytes_from_shapes(spec, "bfloat16"), 2 * 2**30))
    pools = allocate_pools(spec, plan, "meta")
    assert pools.kv.pool.nbytes == plan.kv.bytes and pools.experts.pool.nbytes == plan.experts.bytes
    k, v = pools.kv.layer(5)
    assert k.shape[2:] == v.shape[2:] == (2, 512)
    assert pools.kv.layer(0)[0].shape[2:] == (8, 256)


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory) -> Path:
    """`ferry make-tiny-model --arch gemma4`, its weights redrawn as tiny_models.py does (the router's scales and
    the layer scalars off 1) and saved back by transformers: its experts fused beside the dense MLP."""
    return redrawn_tiny_checkpoint(tmp_path_factory.mktemp("gemma4"), "gemma4")


ARGS = ("--prompt-ids", ",".join(str((i * 37 + 11) % 200) for i in range(40)), "--max-tokens", "8", "--ignore-eos")
ARGS += ("--dtype", "float32", "--max-prefill-tokens", "48")


def test_offloaded_generation_equals_resident_and_transformers(gemma_checkpoint, capsys):
    resident = ferry_generate(capsys, gemma_checkpoint, *ARGS)
    experts = resident["plan"]["experts"]
    assert experts["slots"] == experts["total"] == 3 * 8
    assert resident["token_ids"] == transformers_greedy(gemma_checkpoint, resident["prompt_token_ids"], 8)
    offloaded = ferry_generate(capsys, gemma_checkpoint, *ARGS, "--moe-cache-size", str(experts["min_slots"]))
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"]
    assert offloaded["logprobs"] == resident["logprobs"]


def test_dummy_weights_boot_resident_and_offloaded(gemma_checkpoint, capsys):
    dummy = (*ARGS, "--load-format", "dummy")
    resident = ferry_generate(capsys, gemma_checkpoint, *dummy)
    assert len(resident["token_ids"]) == 8 and all(math.isfinite(lp) for lp in resident["logprobs"])
    least = str(resident["plan"]["experts"]["min_slots"])
    offloaded = ferry_generate(capsys, gemma_checkpoint, *dummy, "--moe-cache-size", least)
    assert offloaded["expert_cache"]["misses"] > 0 and offloaded["token_ids"] == resident["token_ids"]


def test_make_bench_model_writes_a_cut_gemma4_that_transformers_and_ferry_read_alike(gemma_checkpoint, tmp_path):
    """`ferry make-bench-model --num-layers 2 --weights random --expert-layout fused` from the published config's
    layout (a layer cut, its last one full as Gemma 4 wants): transformers loads it and Ferry reads it as the
    same model; the published config cut to 6 layers plans."""
    from transformers import AutoModelForCausalLM

    from ferry.services.bench_model import write_bench_model, write_random_weights
    from ferry.services.cli import main

    out = write_bench_model(tmp_path / "cut", gemma_checkpoint / "config.json", num_layers=2)
    write_random_weights(out, routing_skew=1.0, dtype="float32", expert_layout="fused")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.experts.gate_up_proj" in index and "model.layers.2.mlp.down_proj.weight" not in index
    spec = parse_model_config(json.loads((out / "config.json").read_text()))
    assert spec.num_layers == 2 and spec.attention_windows == (8, 0)
    from safetensors.torch import load_file

    tensors = {}
    for shard in set(index.values()):
        tensors.update(load_file(str(out / shard)))

    class Checkpoint:
        def state_dict(self):
            return tensors

    ours = PagedRunner(spec, Checkpoint(), page_size=4).step([(1, PROMPT)])[0]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_close(ours, hf(torch.tensor([PROMPT])).logits[0])
    published = tmp_path / "published"
    assert main(["make-bench-model", str(published), "--config", str(GEMMA4 / "config.json"), "--num-layers", "6"]) == 0
    cut = load_model_config(published)
    assert cut.num_layers == 6 and cut.attention_windows[5] == 0 and cut.layer_head_dim(5) == 512
    assert main(["plan", "--model", str(published), "--gpu-memory", "24GiB", "--json"]) == 0


def test_nvfp4_experts_serve_as_their_dequantized_copy(gemma_checkpoint, tmp_path, capsys):
    """nvidia modelopt's NVFP4 layout (`ferry make-bench-model --format nvfp4` of the tiny config: the experts
    quantized per expert, every other linear excluded), the experts named where Gemma 4 keeps them
    (`layers.N.experts.E.…`, beside the dense `mlp.`): kept in nvfp4 and computed with the gelu epilogue, resident
    and offloaded alike, they give what the checkpoint dequantized to float32 (tests/quantized_models.py's
    definitions) gives through the plain experts."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ferry.services.bench_model import write_bench_model, write_random_weights
    from tests.quantized_models import dequantize_module

    out = write_bench_model(tmp_path / "nvfp4", gemma_checkpoint / "config.json")
    write_random_weights(out, routing_skew=1.0, dtype="float32", fmt="nvfp4")
    tensors = {}
    for shard in sorted(out.glob("model*.safetensors*")):
        if shard.suffix == ".safetensors":
            tensors.update({n.replace(".mlp.experts.", ".experts."): t for n, t in load_file(str(shard)).items()})
        shard.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert load_model_config(out).quantization.expert_format == "nvfp4"
    reference = tmp_path / "dequantized"
    shutil.copytree(out, reference)
    plain, modules = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if ".experts." in name and leaf != "weight" or ".experts." in name and t.dtype == torch.uint8:
            modules.setdefault(module, {})[leaf] = t
        else:
            plain[name] = t
    assert len(modules) == 3 * 8 * 3  # every expert's three projections, and nothing else
    plain.update({f"{module}.weight": dequantize_module(parts) for module, parts in modules.items()})
    for shard in reference.glob("model*.safetensors*"):
        shard.unlink()
    save_file(plain, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    config.pop("quantization_config")
    (reference / "config.json").write_text(json.dumps(config))

    resident = ferry_generate(capsys, out, *ARGS)
    assert resident["plan"]["experts"]["format"] == "nvfp4"
    offloaded = ferry_generate(capsys, out, *ARGS, "--moe-cache-size", str(resident["plan"]["experts"]["min_slots"]))
    assert offloaded["expert_cache"]["misses"] > 0 and offloaded["token_ids"] == resident["token_ids"]
    dequantized = ferry_generate(capsys, reference, *ARGS)
    assert dequantized["plan"]["experts"]["format"] == "float32"
    assert dequantized["token_ids"] == resident["token_ids"]
    assert max(abs(a - b) for a, b in zip(resident["logprobs"], dequantized["logprobs"])) < 1e-4


def test_next_layer_prediction_takes_only_routers_that_are_linears_of_the_experts_input():
    """The offloading store predicts layer L+1's experts by its router applied to layer L's expert input: Gemma 4's
    router reads the layer's normalised, scaled input instead, so it gets none (and boots); qwen3_moe's all."""
    from ferry.services.worker.boot import prediction_routers

    for arch in ("gemma4", "qwen3_moe"):
        hf, spec = tiny_model(arch, seed=2)
        routers = prediction_routers(PagedRunner(spec, hf, page_size=4).model)
        if arch == "gemma4":
            assert routers is None
        else:
            weights, biases = routers
            assert len(weights) == len(spec.moe_layer_indices) and biases is None


def test_make_tiny_model_writes_gemma4_and_a_gguf_of_it(tmp_path, capsys):
    from ferry.services.cli import main

    assert main(["make-tiny-model", str(tmp_path / "g"), "--arch", "gemma4"]) == 0
    spec = load_model_config(tmp_path / "g")
    assert spec.arch == "gemma4" and spec.tie_word_embeddings and spec.attention_head_dims == (16, 16, 32)
    assert main(["make-tiny-model", str(tmp_path / "q"), "--arch", "gemma4", "--gguf", "Q8_0"]) == 0
    written = load_model_config(next((tmp_path / "q").glob("*.gguf")))
    assert written.arch == "gemma4" and written.quantization.expert_format == "gguf-q8_0"
