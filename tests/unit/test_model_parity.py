"""Ferry's models against transformers on the same random weights, float32 on CPU.

Each tiny model is driven through StepBatch/ForwardBatch and the paged pools (shuffled pages,
random slots): a prompt's logits, then 32 greedy tokens, must equal transformers' `generate`
(tokens exactly, logits to 1e-4 of their scale), alone, in chunks, and batched with other
requests at different stages."""

from __future__ import annotations

import pytest
import torch
from model_harness import PagedRunner, assert_logits_close, hf_greedy
from tiny_models import tiny_model

STEPS = 32

# (id, arch, config overrides, page_size)
MODELS = [
    ("moe-default-p16", "qwen3_moe", {}, 16),
    (
        "moe-8e-top3-norm-dense1-odd-p1",
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
        1,
    ),
    (
        "moe-mha-bias-tied-p4",
        "qwen3_moe",
        dict(num_attention_heads=2, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True),
        4,
    ),
    ("next-default-p1", "qwen3_next", {}, 1),
    (
        "next-nonorm-dense0-top1-5layers-p16",
        "qwen3_next",
        dict(
            num_hidden_layers=5,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            mlp_only_layers=[0],
            norm_topk_prob=False,
            num_experts=6,
            num_experts_per_tok=1,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            partial_rotary_factor=0.5,
        ),
        16,
    ),
    ("q35-default-p16", "qwen3_5_moe", {}, 16),
    (
        "q35-8e-top4-4layers-p1",
        "qwen3_5_moe",
        dict(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_experts=8,
            num_experts_per_tok=4,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=8,
            linear_num_key_heads=1,
            linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
        ),
        1,
    ),
    # glm4_moe (tiny_models.py's GLM fields): two expert groups of which the top k come from one, a nonzero
    # e_score_correction_bias, routed weights scaled by 2.5, a dense first layer, q/k/v biases, half of each
    # head rotated
    ("glm-groups-bias-dense1-p4", "glm4_moe", {}, 4),
    (
        "glm-8e-4groups-top3-qknorm-nonorm-p1",
        "glm4_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            use_qk_norm=True,
            norm_topk_prob=False,
            first_k_dense_replace=2,
            num_hidden_layers=4,
        ),
        1,
    ),
    # gpt_oss (tiny_models.py's GPT_OSS fields): a sliding layer (window 8, shorter than the prompts) then a full
    # one, sinks, YaRN, biased router and experts, the clamped SwiGLU at a limit the projections reach
    ("gpt-oss-window8-p4", "gpt_oss", {}, 4),
    (
        "gpt-oss-8e-top3-window5-3layers-p1",
        "gpt_oss",
        dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=5,
            num_experts=8,
            num_experts_per_tok=3,
        ),
        1,
    ),
    # gemma4 (tiny_models.py's GEMMA4 fields): two sliding layers (window 8) then a full one with twice the head
    # size, one KV head that is both K and V, proportional rotary; a gelu dense MLP beside the experts, the scaled
    # router, layer scalars, the embedding multiplier, soft-capped logits
    ("gemma4-window8-keqv-p4", "gemma4", {}, 4),
    (
        "gemma4-8e-top3-window5-kv-4layers-p1",
        "gemma4",
        dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=5,
            attention_k_eq_v=False,
            num_experts=8,
            num_experts_per_tok=3,
        ),
        1,
    ),
]
IDS = [m[0] for m in MODELS]
HYBRID = [m for m in MODELS if m[1] in ("qwen3_next", "qwen3_5_moe")]


def _pick(*indices):
    return pytest.mark.parametrize(
        "name,arch,overrides,page_size", [MODELS[i] for i in indices], ids=[IDS[i] for i in indices]
    )


def _prompt(length: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(hf, prompt, ours, chunks=None, req_id=1):
    prompt_logits, tokens, step_logits = ours.generate(req_id, prompt, STEPS, chunks)
    ref_tokens, ref_step_logits, ref_prompt_logits = hf_greedy(hf, prompt, STEPS)
    assert_logits_close(prompt_logits, ref_prompt_logits)
    assert tokens == ref_tokens
    assert_logits_close(step_logits, ref_step_logits)


@pytest.mark.parametrize("name,arch,overrides,page_size", MODELS, ids=IDS)
def test_prefill_and_greedy_decode_match_transformers(name, arch, overrides, page_size):
    hf, spec = tiny_model(arch, seed=len(name), **overrides)
    _check(hf, _prompt(13, seed=len(name)), PagedRunner(spec, hf, page_size))


@pytest.mark.parametrize("name,arch,overrides,page_size", HYBRID, ids=[m[0] for m in HYBRID])
def test_chunked_prefill_matches_transformers(name, arch, overrides, page_size):
    """70 tokens cross the delta rule's 64-token chunk; pieces of 1 and 2 are shorter than the conv state."""
    hf, spec = tiny_model(arch, seed=3, **overrides)
    _check(hf, _prompt(70, seed=4), PagedRunner(spec, hf, page_size), chunks=[5, 1, 2, 40])


@_pick(1, 3, 6, 8, 10, 12)
def test_prompt_in_uneven_chunks_matches_transformers(name, arch, overrides, page_size):
    hf, spec = tiny_model(arch, seed=5, **overrides)
    _check(hf, _prompt(37, seed=6), PagedRunner(spec, hf, page_size), chunks=[16, 1, 3])


def run_staggered_batch(ours: PagedRunner, prompts: dict[int, list[int]], joins: dict[int, int], chunk: int):
    """A continuous-batching schedule: request r joins at step joins[r], prefills in chunks of
    `chunk`, then decodes greedily; every step batches all active requests. Returns per request
    (prompt logits, generated tokens, logits that chose them)."""
    state = {r: dict(fed=0, tokens=[], prompt_logits=[], step_logits=[]) for r in prompts}
    step = 0
    while any(len(s["tokens"]) < STEPS for s in state.values()):
        items, kinds = [], []
        for r, prompt in prompts.items():
            s = state[r]
            if joins[r] > step or len(s["tokens"]) >= STEPS:
                continue
            if s["fed"] < len(prompt):
                piece = prompt[s["fed"] : s["fed"] + chunk]
                s["fed"] += len(piece)
                items.append((r, piece))
                kinds.append("prefill")
            else:
                items.append((r, [s["tokens"][-1]]))
                kinds.append("decode")
        for (r, _), kind, logits in zip(items, kinds, ours.step(items)):
            s = state[r]
            if kind == "prefill":
                s["prompt_logits"].append(logits)
            if s["fed"] == len(prompts[r]):  # the last row chose the next token
                s["step_logits"].append(logits[-1])
                s["tokens"].append(int(logits[-1].argmax()))
        step += 1
    return {r: (torch.cat(s["prompt_logits"]), s["tokens"], torch.stack(s["step_logits"])) for r, s in state.items()}


@_pick(0, 3, 6, 7, 9, 11)
def test_four_requests_batched_match_each_alone(name, arch, overrides, page_size):
    # seed 8: seed 7 puts a routing tie (top-4/5 probabilities 3e-9 apart) on one decode token of
    # q35-8e-top4, where any rounding difference legitimately picks another expert
    hf, spec = tiny_model(arch, seed=8, **overrides)
    prompts = {10: _prompt(3, 8), 11: _prompt(17, 9), 12: _prompt(1, 10), 13: _prompt(9, 11)}
    joins = {10: 0, 11: 0, 12: 2, 13: 5}
    results = run_staggered_batch(PagedRunner(spec, hf, page_size), prompts, joins, chunk=6)
    for r, prompt in prompts.items():
        prompt_logits, tokens, step_logits = results[r]
        ref_tokens, ref_step_logits, ref_prompt_logits = hf_greedy(hf, prompt, STEPS)
        assert_logits_close(prompt_logits, ref_prompt_logits)
        assert tokens == ref_tokens, f"request {r}"
        assert_logits_close(step_logits, ref_step_logits)
