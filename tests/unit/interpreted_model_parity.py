"""Child process of test_triton_path_parity.py: tiny models served through the CUDA path's kernels
(FERRY_TRITON_ON_CPU=1 under TRITON_INTERPRET=1: fused norms, q/k norm + rotary + KV write, paged
attention and prefill, pair-by-pair experts) against transformers, as test_model_parity.py does
for the CPU path: prompt logits, greedy tokens and their logits. Prints JSON {case: null | failure}."""

from __future__ import annotations

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("FERRY_TRITON_ON_CPU") == "1"

from tests.triton_interpreter_patch import install as install_interpreter_patch  # noqa: E402

install_interpreter_patch()

import torch  # noqa: E402
from model_harness import PagedRunner, assert_logits_close, hf_greedy  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

# greedy tokens a case generates: two decode steps after the 11-token prompt, the second opening a new page at
# both page sizes (4: positions 11, 12; 1: every one); each step runs every kernel a decode runs
STEPS = 3

CASES = {
    "qwen3_moe-norm_topk-gqa": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
        ),
        4,
    ),
    "qwen3_5_moe-gated-partial-rotary": (
        "qwen3_5_moe",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_experts=8,
            num_experts_per_tok=4,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
        ),
        1,
    ),
    # the sigmoid router with groups and a score bias, an ungated shared expert, q/k/v biases: without q/k norms
    # (the attention's torch rotary and K/V write) and with them (the fused norm + partial rotary kernel)
    "glm4_moe-groups-bias-no-qk-norm": ("glm4_moe", {}, 4),
    "glm4_moe-8e-4groups-qk-norm": (
        "glm4_moe",
        dict(num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, use_qk_norm=True),
        1,
    ),
    # gpt-oss: a window of 8 the 11-token prompt outgrows (its second chunk and the decode steps see a window),
    # sinks, YaRN's scaled rotary tables, the router's bias, biased experts with the clamped SwiGLU
    "gpt_oss-window-sinks-biased-clamped": ("gpt_oss", {}, 4),
    # gemma4: two KV groups (sliding 2 x 16, full 1 x 32 with K = V and a value norm), each layer type's rotary tables
    # through the fused norm + rotary kernel (proportional on the full layer), the scaled router through the top-k
    # kernel, gelu-tanh experts through the pair kernels, soft-capped logits
    "gemma4-two-shapes-keqv-gelu": ("gemma4", {}, 4),
    # the 11-token prompt in one step whose mixers run in slices of at most 4 (services/worker/mixer_slices.py)
    "qwen3_5_moe-mixer-slices": (
        "qwen3_5_moe",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_experts=8,
            num_experts_per_tok=4,
        ),
        4,
        4,
    ),
}


def check(arch, overrides, page_size, slice_tokens=None):
    from ferry.plan.costs import MIXER_SLICE_TOKENS
    from ferry.services.worker import forward_batch

    hf, spec = tiny_model(arch, **overrides)
    prompt = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    forward_batch.MIXER_SLICE_TOKENS = slice_tokens or MIXER_SLICE_TOKENS
    chunks = [] if slice_tokens else [6]
    prompt_logits, tokens, step_logits = PagedRunner(spec, hf, page_size).generate(1, prompt, STEPS, chunks)
    ref_tokens, ref_step_logits, ref_prompt_logits = hf_greedy(hf, prompt, STEPS)
    assert_logits_close(prompt_logits, ref_prompt_logits)
    assert tokens == ref_tokens, (tokens, ref_tokens)
    assert_logits_close(step_logits, ref_step_logits)


# --kv-cache-dtype fp8 through the same kernels (the fused K/V write quantizing, the paged kernels
# dequantizing): transformers' greedy tokens fed back, each step's logprob of transformers' top token within
# test_fp8_kv_generation.py's tolerance
FP8_CASES = {f"{name}-fp8-kv": CASES[name] for name in ("qwen3_moe-norm_topk-gqa", "qwen3_5_moe-gated-partial-rotary")}


def check_fp8(arch, overrides, page_size):
    from test_fp8_kv_generation import TOP_LOGPROB_TOLERANCE

    hf, spec = tiny_model(arch, **overrides)
    prompt = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    ref_tokens, ref_step_logits, _ = hf_greedy(hf, prompt, STEPS)
    runner = PagedRunner(spec, hf, page_size, kv_cache_dtype="fp8")
    logits = [runner.step([(1, prompt[:6])])[0][-1], runner.step([(1, prompt[6:])])[0][-1]]
    for token in ref_tokens[:-1]:
        logits.append(runner.step([(1, [token])], all_rows=False)[0][-1])
    ours, ref = torch.log_softmax(torch.stack(logits[1:]), -1), torch.log_softmax(ref_step_logits, -1)
    top = ref.argmax(-1, keepdim=True)
    moved = (ours.gather(1, top) - ref.gather(1, top)).abs().max().item()
    assert 0 < moved <= TOP_LOGPROB_TOLERANCE, moved


# gpt-oss's sliding layers in rings (plan/kv_groups.py): a 23-token prompt in chunks of 5 and greedy steps past it,
# each request's ring 3 pages of 4 (the window of 8 and a 5-token slice), so the ring's rows are reused over and
# over; then in chunks of 12 and 11, which the ring layers run over in sliding slices of at most 5
RING_CASES = {
    "gpt_oss-sliding-rings": ("gpt_oss", {}, 4, [5, 5, 5, 5]),
    "gpt_oss-sliding-slices": ("gpt_oss", {}, 4, [12]),
    "gemma4-sliding-rings": ("gemma4", {}, 4, [5, 5, 5, 5]),
}


def check_rings(arch, overrides, page_size, chunks):
    hf, spec = tiny_model(arch, **overrides)
    prompt = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = PagedRunner(spec, hf, page_size, num_slots=3, ring_slice_tokens=5)
    assert runner.pools.kv.ring_pages(0) == 3
    runner.poison()
    prompt_logits, tokens, step_logits = runner.generate(1, prompt, STEPS, chunks)
    ref_tokens, ref_step_logits, ref_prompt_logits = hf_greedy(hf, prompt, STEPS)
    assert_logits_close(prompt_logits, ref_prompt_logits)
    assert tokens == ref_tokens, (tokens, ref_tokens)
    assert_logits_close(step_logits, ref_step_logits)


if __name__ == "__main__":
    results = {}
    for name, case in CASES.items():
        try:
            check(*case)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    for name, case in FP8_CASES.items():
        try:
            check_fp8(*case)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    for name, case in RING_CASES.items():
        try:
            check_rings(*case)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    json.dump(results, sys.stdout)
