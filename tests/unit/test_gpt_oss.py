"""gpt_oss beyond the parity list (test_model_parity.py): each of what it adds (sinks, the sliding window, the
clamped SwiGLU, the expert and router biases, YaRN) is what makes Ferry equal transformers (planting its
absence fails the parity check), its checkpoint's fused interleaved experts load, `ferry plan` prices
gpt-oss-120b's published config tensor by tensor with the experts' biases in their slots, what it cannot
serve is refused by field or flag, and `ferry generate` with experts offloaded equals resident and
transformers."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner, assert_logits_close, hf_greedy
from safetensors.torch import load_file
from tiny_models import redrawn_tiny_checkpoint, swiglu_from_config, tiny_model

from ferry.kernels.expert_epilogue import ExpertActivation
from ferry.plan.costs import ALLOC_GRANULE
from ferry.plan.expert_backend import host_compute_refusal, physical_cores, plan_expert_backend
from ferry.plan.kv_groups import ring_pages as kv_ring_pages
from ferry.plan.model_config import parse_model_config
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.shared.errors import ConfigError
from tests.unit.test_generate_e2e import ferry_generate, transformers_greedy

MODELS = Path(__file__).resolve().parents[1] / "data/models"
GPT_OSS_120B = MODELS / "gpt-oss-120b"
PROMPT = [(i * 37 + 11) % 96 for i in range(21)]  # longer than the window (8) by far


def _prompt_logits(runner: PagedRunner) -> torch.Tensor:
    return runner.step([(1, PROMPT)])[0]


@pytest.fixture(scope="module")
def model():
    hf, spec = tiny_model("gpt_oss", seed=3)
    _, _, ref = hf_greedy(hf, PROMPT, 1)
    return hf, spec, ref


def test_prompt_logits_equal_transformers(model):
    hf, spec, ref = model
    assert spec.attention_windows == (8, 0) and spec.attention_sinks and spec.expert_bias
    assert_logits_close(_prompt_logits(PagedRunner(spec, hf, page_size=4)), ref)


def _plant(runner: PagedRunner, fault: str) -> None:
    for layer in runner.model.layers:
        if fault == "no sinks":
            layer.self_attn.sinks = None
        elif fault == "no window":
            layer.self_attn.window = 0
        elif fault == "no router bias":
            layer.mlp.gate.logit_bias.zero_()
    slots = runner.pools.experts
    if fault == "no clamp":  # the SwiGLU with a limit nothing reaches
        activation = ExpertActivation(1e9, slots.gemm13.activation.swiglu_alpha)
        slots.gemm13 = dataclasses.replace(slots.gemm13, activation=activation)
    elif fault == "no expert biases":
        slots.gemm13 = dataclasses.replace(slots.gemm13, bias=None)
        slots.gemm2 = dataclasses.replace(slots.gemm2, bias=None)


@pytest.mark.parametrize("fault", ["no sinks", "no window", "no clamp", "no expert biases", "no router bias"])
def test_each_part_of_gpt_oss_is_needed_to_equal_transformers(model, fault):
    hf, spec, ref = model
    runner = PagedRunner(spec, hf, page_size=4)
    _plant(runner, fault)
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_close(_prompt_logits(runner), ref)


# Sliding layers kept in rings (plan/kv_groups.py): 3 request slots, steps of at most 5 tokens a request, so a ring
# of ceil((8 - 1 + 5) / 4) = 3 pages of 4 holds 12 positions; the prompts are longer than the window and the ring
RING_STEP = 5
LONG_PROMPTS = {1: [(i * 37 + 11) % 96 for i in range(45)], 2: [(i * 53 + 5) % 96 for i in range(33)]}


def _ring_runner(hf, spec) -> PagedRunner:
    runner = PagedRunner(spec, hf, page_size=4, num_slots=3, ring_slice_tokens=RING_STEP)
    runner.poison()  # every row a request reads must be one it wrote
    return runner


def _interleaved_prompt_logits(runner: PagedRunner) -> dict[int, torch.Tensor]:
    """Both long prompts prefilled side by side in chunks of RING_STEP tokens, each in its own slot's ring."""
    logits = {rid: [] for rid in LONG_PROMPTS}
    for start in range(0, max(map(len, LONG_PROMPTS.values())), RING_STEP):
        items = [(rid, p[start : start + RING_STEP]) for rid, p in LONG_PROMPTS.items() if start < len(p)]
        for (rid, _), out in zip(items, runner.step(items)):
            logits[rid].append(out)
    return {rid: torch.cat(parts) for rid, parts in logits.items()}


@pytest.fixture(scope="module")
def long_refs(model):
    hf, _, _ = model
    return {rid: hf_greedy(hf, prompt, 4) for rid, prompt in LONG_PROMPTS.items()}


def test_sliding_layers_in_rings_equal_transformers_past_the_window_and_the_ring(model, long_refs):
    hf, spec, _ = model
    runner = _ring_runner(hf, spec)
    assert runner.pools.kv.ring_pages(0) == 3 and runner.pools.kv.ring_pages(1) == 0  # layer 0 slides
    assert all(len(p) > 3 * 4 > spec.attention_window(0) for p in LONG_PROMPTS.values())
    for rid, logits in _interleaved_prompt_logits(runner).items():
        assert_logits_close(logits, long_refs[rid][2])
    for rid, (tokens, step_logits, _) in long_refs.items():  # then decode, past the prompt
        for i in range(len(tokens) - 1):
            out = runner.step([(rid, [tokens[i]])], all_rows=False)[0][-1]
            assert_logits_close(out, step_logits[i + 1])


@pytest.mark.parametrize("fault", ["ring index one page on", "ring one page short"])
def test_a_ring_off_by_one_fails_to_equal_transformers(model, long_refs, monkeypatch, fault):
    from ferry.kernels import kv_ring
    from ferry.plan import pool_layout
    from ferry.services.worker.layers import attention

    hf, spec, _ = model
    if fault == "ring index one page on":  # the writes a page past where the kernels read
        monkeypatch.setattr(attention, "ring_rows", lambda pos, slots, n, ps: kv_ring.ring_rows(pos + ps, slots, n, ps))
    else:
        monkeypatch.setattr(pool_layout, "ring_pages", lambda w, step, ps: kv_ring_pages(w, step, ps) - 1)
    runner = _ring_runner(hf, spec)
    with pytest.raises(AssertionError, match="logits differ"):
        for rid, logits in _interleaved_prompt_logits(runner).items():
            assert_logits_close(logits, long_refs[rid][2])


# Sliding slices (plan/kv_groups.py): rings of ceil((8 - 1 + 4) / 4) = 3 pages hold a slice of 4 tokens, while
# each step gives both long prompts many more, side by side; the ring layers cut the step in slices of at most 4,
# some cutting a prompt, some holding the end of one and the start of the other.
RING_SLICE = 4
SLICED_STEPS = ({1: slice(0, 30), 2: slice(0, 9)}, {2: slice(9, None), 1: slice(30, None)})


def _sliced_ring_runner(hf, spec) -> PagedRunner:
    runner = PagedRunner(spec, hf, page_size=4, num_slots=3, ring_slice_tokens=RING_SLICE)
    runner.poison()
    return runner


def _sliced_prompt_logits(runner: PagedRunner) -> dict[int, torch.Tensor]:
    logits = {rid: [] for rid in LONG_PROMPTS}
    for parts in SLICED_STEPS:
        items = [(rid, LONG_PROMPTS[rid][part]) for rid, part in parts.items()]
        for (rid, _), out in zip(items, runner.step(items)):
            logits[rid].append(out)
    return {rid: torch.cat(parts) for rid, parts in logits.items()}


def test_ring_layers_in_sliding_slices_equal_transformers_with_two_prompts_in_one_step(model, long_refs, monkeypatch):
    from ferry.services.worker.forward_batch import ForwardBatch

    hf, spec, _ = model
    runner = _sliced_ring_runner(hf, spec)
    assert runner.pools.kv.ring_pages(0) == kv_ring_pages(8, RING_SLICE, 4) == 3  # 12 rows: 7 keys and a slice
    assert runner.pools.kv.slice_tokens(0) == RING_SLICE
    assert runner.pools.kv.slice_tokens(1) == 0  # the full layer runs over the whole step
    cut = []
    slices = ForwardBatch.slices

    def recorded(batch, max_tokens=None, rows_only=False):
        out = slices(batch, max_tokens, rows_only)
        if max_tokens == RING_SLICE and out:
            cut.append([(a, b, part.step.req_ids.tolist()) for a, b, part in out])
        return out

    monkeypatch.setattr(ForwardBatch, "slices", recorded)
    for rid, logits in _sliced_prompt_logits(runner).items():
        assert_logits_close(logits, long_refs[rid][2])
    assert len(cut) == 2 and all(b - a <= RING_SLICE for step in cut for a, b, _ in step)
    assert any(rids == [1, 2] for _, _, rids in cut[0])  # a slice holding the end of one prompt, the start of the other
    assert any(0 < b < 30 for _, b, _ in cut[0])  # a cut inside the first prompt's 30 tokens
    tokens = {rid: ref[0] for rid, ref in long_refs.items()}
    for i in range(len(tokens[1]) - 1):  # then decode both in one step, never cut
        outs = runner.step([(rid, [tokens[rid][i]]) for rid in LONG_PROMPTS], all_rows=False)
        for rid, out in zip(LONG_PROMPTS, outs):
            assert_logits_close(out[-1], long_refs[rid][1][i + 1])
    assert len(cut) == 2


@pytest.mark.parametrize("fault", ["slice writes the whole step before attending", "ring one page short"])
def test_a_sliding_slice_larger_than_its_ring_fails_to_equal_transformers(model, long_refs, monkeypatch, fault):
    from ferry.plan import pool_layout
    from ferry.services.worker.pools import KvTensorPool

    hf, spec, _ = model
    if fault == "ring one page short":  # window - 1 + slice positions on fewer rows
        monkeypatch.setattr(pool_layout, "ring_pages", lambda w, n, ps: kv_ring_pages(w, n, ps) - 1)
    runner = _sliced_ring_runner(hf, spec)
    if fault == "slice writes the whole step before attending":  # the ring as sized, the step never cut
        monkeypatch.setattr(KvTensorPool, "slice_tokens", lambda pool, layer: 1000 if pool.ring_pages(layer) else 0)
    with pytest.raises(AssertionError, match="logits differ"):
        for rid, logits in _sliced_prompt_logits(runner).items():
            assert_logits_close(logits, long_refs[rid][2])


def test_a_ring_layer_refuses_a_step_not_cut_in_sliding_slices(model, monkeypatch):
    from ferry.services.worker.layers.context import StepContext

    hf, spec, _ = model
    runner = _sliced_ring_runner(hf, spec)
    monkeypatch.setattr(StepContext, "slices", lambda ctx, max_tokens=None, rows_only=False: ())
    with pytest.raises(ValueError, match="rings hold 4 new tokens a request, the step gives 9"):
        runner.step([(1, LONG_PROMPTS[1][:9])])


def test_yarn_frequencies_and_factor_are_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    raw = json.loads((GPT_OSS_120B / "config.json").read_text())
    raw.pop("quantization_config")
    spec = parse_model_config(raw)
    theirs = GptOssRotaryEmbedding(GptOssConfig(**{k: v for k, v in raw.items() if k != "rope_scaling"}))
    ours = RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta, yarn=spec.rope_yarn)
    assert theirs.rope_type == "yarn"
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=0, atol=0)
    assert ours.scaling == pytest.approx(theirs.attention_scaling, rel=1e-12) and ours.scaling > 1.3


def _granules(*shape: int) -> int:
    n = 2 * math.prod(shape)
    return -(-n // ALLOC_GRANULE) * ALLOC_GRANULE


def _unquantized(tmp_path: Path, model: Path = GPT_OSS_120B) -> Path:
    """The published config without its quantization_config: the same model with bf16 experts (the MXFP4
    format is served apart)."""
    raw = json.loads((model / "config.json").read_text())
    raw.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("name,layers,experts", [("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32)])
def test_ferry_plan_prices_gpt_oss_tensor_by_tensor(tmp_path, name, layers, experts):
    """gpt-oss at 24 GiB: the resident weights from the architecture (biases on q/k/v/o, a sink per head, the
    router's bias), and every expert slot holding its biases after its weights."""
    hidden, vocab, heads, kv_heads, head_dim, inter = 2880, 201088, 64, 8, 64, 2880
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = (
        _granules(q, hidden) + _granules(q) + 2 * (_granules(kv, hidden) + _granules(kv))
        + _granules(hidden, q) + _granules(hidden) + _granules(heads)
    )  # fmt: skip
    layer = attention + 2 * _granules(hidden) + _granules(experts, hidden) + _granules(experts)
    expected = 2 * _granules(vocab, hidden) + _granules(hidden) + layers * layer
    out = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "plan", "--model", str(_unquantized(tmp_path, MODELS / name))]
        + ["--gpu-memory", "24GiB", "--host-memory", "512GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["weights_bytes"] == expected
    assert plan["experts"]["total"] == layers * experts
    # w13 [2I, H] + one row of its 2I biases (2I / H = 2), w2 [H, I] + one row of its H biases
    assert plan["experts"]["bytes_per_slot"] == 2 * ((2 * inter + 2) * hidden + (hidden + 1) * inter)
    assert plan["host"]["expert_bank_format"] == "plain"  # packed banks hold no biases
    # the host may compute them: auto decides by this machine's cores alone
    assert plan["expert_backend"]["backend"] == plan_expert_backend(None, None, True, physical_cores()).backend
    assert plan["total_bytes"] <= plan["budget_bytes"]


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(layer_types=["sliding_attention"] * 36, sliding_window=0), "sliding_window must be positive"),
        (dict(layer_types=["chunked_attention"] * 36), "unknown layer_types"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_scaling.rope_type 'longrope'"),
        (dict(swiglu_limit=0), "swiglu_limit must be positive"),
    ],
)
def test_config_json_fields_gpt_oss_cannot_serve_are_refused_by_field(fields, message):
    raw = json.loads((GPT_OSS_120B / "config.json").read_text())
    raw.pop("quantization_config")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_model_config({**raw, **fields})


def test_the_host_computes_biased_clamped_experts_so_every_backend_serves_them(model):
    """The host's kernels compute the biases and the clamped SwiGLU (tests/unit/offload/test_host_expert_epilogue.py):
    auto shares gpt-oss's misses with the host where the cores allow, cpu and hybrid are taken; an activation
    the host kernels lack is still refused."""
    _, spec, _ = model
    assert host_compute_refusal(spec) is None
    assert plan_expert_backend(None, None, offloaded=True, cores=64, host_refusal=None).backend == "hybrid"
    for backend, threads in (("cpu", None), ("hybrid", None), ("auto", 8)):
        assert plan_expert_backend(backend, threads, True, 64).backend == ("hybrid" if backend == "auto" else backend)
    other = host_compute_refusal(dataclasses.replace(spec, expert_activation="gelu"))
    assert other is not None and "gelu" in other
    with pytest.raises(ConfigError, match="use --expert-backend gpu"):
        plan_expert_backend("cpu", None, True, 64, host_refusal=other)


def test_ferry_plan_shares_gpt_oss_120b_with_a_server_host_under_auto(monkeypatch, capsys):
    """gpt-oss-120b (mxfp4, biases in the rows) at 24 GiB on a host of 32 physical cores: auto takes hybrid."""
    from ferry.plan import planner
    from ferry.services.cli import main

    monkeypatch.setattr(planner, "physical_cores", lambda: 32)
    argv = ["plan", "--model", str(GPT_OSS_120B), "--gpu-memory", "24GiB", "--host-memory", "512GiB", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["experts"]["format"] == "mxfp4" and plan["experts"]["slots"] < plan["experts"]["total"]
    assert plan["expert_backend"]["backend"] == "hybrid" and plan["expert_backend"]["host_threads"] == 28


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory) -> Path:
    """`ferry make-tiny-model --arch gpt_oss`, its weights redrawn as tiny_models.py does (sinks and biases
    nonzero) and saved back by transformers: fused experts, gate and up interleaved."""
    out = redrawn_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")
    assert load_file(out / "model.safetensors")["model.layers.0.mlp.experts.gate_up_proj_bias"].abs().min() > 0
    return out


ARGS = ("--prompt-ids", ",".join(str((i * 37 + 11) % 200) for i in range(40)), "--max-tokens", "8", "--ignore-eos")
ARGS += ("--dtype", "float32", "--max-prefill-tokens", "48")


def test_offloaded_generation_equals_resident_and_transformers(gpt_oss_checkpoint, capsys):
    resident = ferry_generate(capsys, gpt_oss_checkpoint, *ARGS)
    experts = resident["plan"]["experts"]
    assert experts["slots"] == experts["total"] == 2 * 8
    assert resident["token_ids"] == transformers_greedy(gpt_oss_checkpoint, resident["prompt_token_ids"], 8)
    offloaded = ferry_generate(capsys, gpt_oss_checkpoint, *ARGS, "--moe-cache-size", str(experts["min_slots"]))
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"]
    assert offloaded["logprobs"] == resident["logprobs"]


def _transformers_logprobs(model_dir, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probability of each generated token, recomputing the whole sequence (no cache)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    return [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(tokens)]


# a prompt of 150 tokens in chunks of 24: the sliding layers' rings hold ceil((8 - 1 + 24) / 16) = 2 pages
RING_ARGS = ("--prompt-ids", ",".join(str((i * 53 + 7) % 200) for i in range(150)), "--max-tokens", "8")
RING_ARGS += ("--ignore-eos", "--dtype", "float32", "--max-prefill-tokens", "24")


def test_generation_with_rings_equals_transformers_resident_and_offloaded(gpt_oss_checkpoint, capsys):
    resident = ferry_generate(capsys, gpt_oss_checkpoint, *RING_ARGS)
    kv = resident["plan"]["kv"]
    sliding = next(g for g in kv["groups"] if g["window"])
    assert kv["ring_slots"] == 4 and sliding["ring_pages"] == 2 and sliding["pages"] == (4 + 1) * 2
    assert len(resident["prompt_token_ids"]) > 2 * 16  # longer than the ring
    tokens = transformers_greedy(gpt_oss_checkpoint, resident["prompt_token_ids"], 8)
    assert resident["token_ids"] == tokens
    expected = _transformers_logprobs(gpt_oss_checkpoint, resident["prompt_token_ids"], tokens)
    assert max(abs(a - b) for a, b in zip(resident["logprobs"], expected)) < 1e-4
    slots = str(resident["plan"]["experts"]["min_slots"])
    offloaded = ferry_generate(capsys, gpt_oss_checkpoint, *RING_ARGS, "--moe-cache-size", slots)
    assert offloaded["expert_cache"]["misses"] > 0 and offloaded["plan"]["kv"]["ring_slots"] == 4
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]


HOST_LOGPROB_TOLERANCE = 1e-4  # the host's sums run in another order than the resident kernels' (test_gguf_checkpoints)


def test_generation_with_the_host_backend_equals_resident(gpt_oss_checkpoint, capsys):
    """--expert-backend cpu serves gpt-oss (the plan no longer keeps its biased clamped experts on the GPU) and
    generates what resident does. On this CPU device the worker computes every expert itself, so the host's
    kernels are held to the twin in tests/unit/offload/test_host_expert_epilogue.py."""
    resident = ferry_generate(capsys, gpt_oss_checkpoint, *ARGS)
    slots = str(resident["plan"]["experts"]["min_slots"])
    host = ferry_generate(capsys, gpt_oss_checkpoint, *ARGS, "--moe-cache-size", slots, "--expert-backend", "cpu")
    assert host["plan"]["expert_backend"]["backend"] == "cpu" and host["expert_cache"]["misses"] > 0
    assert host["token_ids"] == resident["token_ids"]
    assert max(abs(a - b) for a, b in zip(host["logprobs"], resident["logprobs"])) < HOST_LOGPROB_TOLERANCE


def test_dummy_weights_boot_resident_and_offloaded(gpt_oss_checkpoint, capsys):
    """--load-format dummy from config.json alone: all-resident (per-name dummy tensors, zero biases) and
    offloaded (the banks' seeded fill, bias rows included), the latter the same at two cache sizes."""
    dummy = (*ARGS, "--load-format", "dummy")
    resident = ferry_generate(capsys, gpt_oss_checkpoint, *dummy)
    assert len(resident["token_ids"]) == 8 and all(math.isfinite(lp) for lp in resident["logprobs"])
    least = resident["plan"]["experts"]["min_slots"]
    small = ferry_generate(capsys, gpt_oss_checkpoint, *dummy, "--moe-cache-size", str(least))
    larger = ferry_generate(capsys, gpt_oss_checkpoint, *dummy, "--moe-cache-size", str(least + 4))
    assert small["expert_cache"]["misses"] > larger["expert_cache"]["misses"] > 0
    assert small["token_ids"] == larger["token_ids"] and small["logprobs"] == larger["logprobs"]
    assert all(math.isfinite(lp) for lp in small["logprobs"])


def test_make_bench_model_writes_gpt_oss_as_transformers_and_ferry_read_it(gpt_oss_checkpoint, tmp_path):
    """`ferry make-bench-model --weights random --expert-layout fused`: gpt-oss's published layout (experts
    transposed, gate and up interleaved, biases beside them), which transformers loads and Ferry reads as the
    same model; the per-expert layout (with per-expert biases) Ferry reads too. A quantized --format whose rows
    hold no biases (fp8) is refused."""
    from transformers import AutoModelForCausalLM

    from ferry.services.bench_model import write_bench_model, write_random_weights
    from ferry.services.cli import main

    config = gpt_oss_checkpoint / "config.json"
    logits = {}
    for layout in ("fused", "per-expert"):
        out = write_bench_model(tmp_path / layout, config)
        write_random_weights(out, routing_skew=1.0, dtype="float32", expert_layout=layout)
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert ("model.layers.1.mlp.experts.gate_up_proj_bias" in index) == (layout == "fused")
        spec = parse_model_config(json.loads((out / "config.json").read_text()))
        from safetensors.torch import load_file

        tensors = {}
        for shard in set(index.values()):
            tensors.update(load_file(str(out / shard)))

        class Checkpoint:
            def state_dict(self):
                return tensors

        runner = PagedRunner(spec, Checkpoint(), page_size=4)
        logits[layout] = runner.step([(1, PROMPT)])[0]
        if layout == "fused":
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            swiglu_from_config(hf)
            with torch.no_grad():
                assert_logits_close(logits[layout], hf(torch.tensor([PROMPT])).logits[0])
    assert torch.equal(logits["fused"], logits["per-expert"])
    args = ["make-bench-model", str(tmp_path / "q"), "--config", str(config), "--format", "fp8"]
    assert main(args) == 2


def test_a_format_that_holds_no_expert_biases_is_refused_by_the_config(model):
    from ferry.plan import expert_formats as F
    from ferry.plan.model_config import _validate
    from ferry.plan.quantization import QuantScheme

    _, spec, _ = model
    unbiased = next(f for f in F.registered() if f.quantized and not f.holds_biases)
    scheme = QuantScheme(method="test", algo="test", expert_format=unbiased.name, source="config.json")
    with pytest.raises(ConfigError, match=f"which {unbiased.name} experts are not held or computed with"):
        _validate(dataclasses.replace(spec, quantization=scheme), "config.json")


def test_no_flash_gather_buffers_are_priced_for_attention_with_sinks(model):
    """FlashAttention never takes gpt-oss's attention (sinks): the long prefill's gather buffers are not taken."""
    from ferry.services.worker.workspace_profile import gathered_context_bytes

    _, spec, _ = model
    assert gathered_context_bytes(spec, "bfloat16", 4096, 16) == 0
    plain = dataclasses.replace(spec, attention_sinks=False, attention_windows=())
    assert gathered_context_bytes(plain, "bfloat16", 4096, 16) == 2 * 4096 * spec.num_kv_heads * spec.head_dim * 2


def test_packed_banks_which_hold_no_biases_are_refused_and_auto_keeps_plain_banks(model):
    from ferry.plan.host_memory import bank_format

    assert bank_format("auto", "bfloat16", None, biases=True) == "plain"
    assert bank_format("auto", "bfloat16", None, biases=False) == "packed"
    with pytest.raises(ValueError, match="--expert-bank-format packed keeps bf16 experts without biases"):
        bank_format("packed", "bfloat16", None, biases=True)


def test_the_family_declares_harmony_so_auto_picks_it_without_a_harmony_template(tmp_path):
    from types import SimpleNamespace

    from ferry.services.api.tokenizer import chat_format_of

    (tmp_path / "config.json").write_text((GPT_OSS_120B / "config.json").read_text())
    assert chat_format_of("auto", str(tmp_path), SimpleNamespace(chat_template=None)) == "harmony"
    assert chat_format_of("template", str(tmp_path), SimpleNamespace(chat_template=None)) == "template"


def openai_layout(spec, tensors: dict) -> dict:
    """Per-expert mxfp4 tensors (QuantizedWeights and biases) as openai's gpt-oss release stores them: per layer
    `experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] and `_scales` [E, 2I, H/32] with the gate's and the
    up's rows interleaved, `down_proj_blocks` / `_scales` [E, H, ...], and the biases fused (gate/up's
    interleaved)."""
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    interleave = lambda gate, up: torch.stack([gate, up], dim=2).flatten(1, 2)  # noqa: E731  [E, I, ...] -> [E, 2I, ...]
    for layer in spec.moe_layer_indices:
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(spec.num_experts)

        def stacked(proj: str, leaf: str, p=p, experts=experts):
            return torch.stack([getattr(tensors[f"{p}.{e}.{proj}.weight"], leaf) for e in experts])

        blocks = lambda q: q.view(*q.shape[:2], -1, 16)  # noqa: E731  codes [E, O, IN/2] -> [E, O, IN/32, 16]
        out[f"{p}.gate_up_proj_blocks"] = blocks(interleave(stacked("gate_proj", "q"), stacked("up_proj", "q")))
        out[f"{p}.gate_up_proj_scales"] = interleave(stacked("gate_proj", "scale"), stacked("up_proj", "scale"))
        out[f"{p}.down_proj_blocks"] = blocks(stacked("down_proj", "q"))
        out[f"{p}.down_proj_scales"] = stacked("down_proj", "scale")
        biases = {
            proj: torch.stack([tensors[f"{p}.{e}.{proj}.bias"] for e in experts])
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        out[f"{p}.gate_up_proj_bias"] = torch.stack([biases["gate_proj"], biases["up_proj"]], dim=-1).flatten(-2)
        out[f"{p}.down_proj_bias"] = biases["down_proj"]
    return out


def test_mxfp4_gpt_oss_equals_its_dequantized_weights_resident_and_offloaded(gpt_oss_checkpoint, tmp_path, capsys):
    """gpt-oss with mxfp4 experts (`make-bench-model --format mxfp4`: per-expert e2m1 codes and e8m0 scales, the
    biases beside them): the biases live in a float32 part of each slot row, the kernels add them and apply the
    clamped SwiGLU, so the model equals itself on the dequantized weights; the same experts in openai's
    published layout load as the same model; offloaded equals resident."""
    from ferry.plan import expert_formats as F
    from ferry.plan.model_config import load_model_config
    from ferry.services.bench_model import write_bench_model, write_random_weights
    from ferry.services.worker.checkpoint import iter_checkpoint_tensors
    from ferry.services.worker.quantized_weight import QuantizedWeight

    out = write_bench_model(tmp_path / "mxfp4", gpt_oss_checkpoint / "config.json")
    write_random_weights(out, dtype="float32", fmt="mxfp4")
    spec = load_model_config(out)
    assert F.format_of(spec).name == "mxfp4" and spec.expert_bias
    quantized = dict(iter_checkpoint_tensors(out, lambda name: True, "checkpoint", progress=False))
    assert isinstance(quantized["model.layers.0.mlp.experts.3.up_proj.weight"], QuantizedWeight)
    g = torch.Generator().manual_seed(7)
    for name in [n for n in quantized if ".mlp.experts." in n and n.endswith(".bias")]:  # the recipe's are zero
        quantized[name] = 0.5 * torch.randn(quantized[name].shape, generator=g)
    dense = {
        n: t.dequantize(torch.float32, "cpu") if isinstance(t, QuantizedWeight) else t for n, t in quantized.items()
    }

    class Checkpoint:
        def __init__(self, tensors):
            self.tensors = tensors

        def state_dict(self):
            return self.tensors

    ours = PagedRunner(spec, Checkpoint(quantized), page_size=4).step([(1, PROMPT)])[0]
    plain = dataclasses.replace(spec, quantization=None)
    assert_logits_close(ours, PagedRunner(plain, Checkpoint(dense), page_size=4).step([(1, PROMPT)])[0])
    published = PagedRunner(spec, Checkpoint(openai_layout(spec, quantized)), page_size=4).step([(1, PROMPT)])[0]
    assert torch.equal(published, ours)
    resident = ferry_generate(capsys, out, *ARGS)
    assert resident["plan"]["experts"]["format"] == "mxfp4"
    slots = str(resident["plan"]["experts"]["min_slots"])
    offloaded = ferry_generate(capsys, out, *ARGS, "--moe-cache-size", slots)
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]
    host = ferry_generate(capsys, out, *ARGS, "--moe-cache-size", slots, "--expert-backend", "cpu")
    assert host["plan"]["expert_backend"]["backend"] == "cpu" and host["token_ids"] == resident["token_ids"]
    assert max(abs(a - b) for a, b in zip(host["logprobs"], resident["logprobs"])) < HOST_LOGPROB_TOLERANCE
    for extra in ((), ("--moe-cache-size", slots)):  # --load-format dummy: mxfp4 rows filled, their biases zero
        dummy = ferry_generate(capsys, out, *ARGS, "--load-format", "dummy", *extra)
        assert dummy["plan"]["experts"]["format"] == "mxfp4" and all(math.isfinite(lp) for lp in dummy["logprobs"])


def test_make_bench_model_writes_mxfp4_gpt_oss_fused_as_openai_publishes_it(gpt_oss_checkpoint, tmp_path, capsys):
    """`make-bench-model --format mxfp4 --expert-layout fused`: the routed experts as openai's release stores them
    (the six tensors a layer other engines' gpt-oss readers require, `openai_layout` above), the same model as the
    per-expert checkpoint of the same draw."""
    from safetensors.torch import load_file

    from ferry.plan.model_config import load_model_config
    from ferry.services.bench_model import write_bench_model, write_random_weights
    from ferry.services.worker.checkpoint import iter_checkpoint_tensors

    per_expert = write_bench_model(tmp_path / "p", gpt_oss_checkpoint / "config.json")
    fused = write_bench_model(tmp_path / "f", gpt_oss_checkpoint / "config.json")
    write_random_weights(per_expert, dtype="float32", fmt="mxfp4")
    write_random_weights(fused, dtype="float32", fmt="mxfp4", expert_layout="fused")
    spec = load_model_config(fused)
    written = {}
    for shard in sorted(fused.glob("*.safetensors")):
        written.update(load_file(str(shard)))
    quantized = dict(iter_checkpoint_tensors(per_expert, lambda name: True, "checkpoint", progress=False))
    want = {n: t for n, t in openai_layout(spec, quantized).items() if ".mlp.experts." in n}
    got = {n: t for n, t in written.items() if ".mlp.experts." in n}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    assert got["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
    assert got["model.layers.0.mlp.experts.down_proj_scales"].shape == (e, h, i // 32)
    served = [ferry_generate(capsys, m, *ARGS) for m in (fused, per_expert)]
    assert served[0]["token_ids"] == served[1]["token_ids"] and served[0]["logprobs"] == served[1]["logprobs"]


def test_ferry_plan_prices_the_published_mxfp4_gpt_oss_120b_with_its_biases():
    """The release as published (quantization_config mxfp4): each slot row holds e2m1 codes, e8m0 scales of 32
    inputs and the float32 biases, each part at 16 bytes; auto's backend as this machine's cores decide it (the
    host kernels compute the biases)."""
    hidden, inter = 2880, 2880
    w13 = 2 * inter * hidden // 2 + 2 * inter * hidden // 32 + 2 * inter * 4
    w2 = hidden * inter // 2 + hidden * inter // 32 + hidden * 4
    out = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "plan", "--model", str(GPT_OSS_120B)]
        + ["--gpu-memory", "24GiB", "--host-memory", "512GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["experts"]["format"] == "mxfp4" and plan["experts"]["bytes_per_slot"] == w13 + w2
    assert plan["host"]["expert_bank_bytes"] == 36 * 128 * (w13 + w2)
    assert plan["expert_backend"]["backend"] == plan_expert_backend(None, None, True, physical_cores()).backend
    assert plan["total_bytes"] <= plan["budget_bytes"]
