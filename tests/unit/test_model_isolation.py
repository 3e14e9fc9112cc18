"""A request reads and writes only its own pages and linear-state slot.

Every KV row and linear-state slot starts as NaN: a request that read anything but its own
freshly written rows, or a linear-state slot it did not reset, would produce NaN logits or differ from
the clean run; a write anywhere else would leave a non-NaN in a page or slot nobody owns."""

from __future__ import annotations

import pytest
import torch
from model_harness import PagedRunner, assert_logits_close, hf_greedy
from tiny_models import tiny_model

CONFIGS = [("qwen3_moe", {}, 4), ("qwen3_next", {}, 1), ("qwen3_5_moe", {}, 16)]


def _schedule(runner: PagedRunner) -> list[torch.Tensor]:
    """Two requests prefill together, a third joins mid-decode with a chunked prompt."""
    g = torch.Generator().manual_seed(0)
    p1, p2, p3 = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 12, 10))
    outs = runner.step([(1, p1), (2, p2[:5])])
    outs += runner.step([(1, [3]), (2, p2[5:])])
    outs += runner.step([(1, [4]), (2, [5]), (3, p3[:6])])
    outs += runner.step([(3, p3[6:]), (2, [6]), (1, [7])])
    outs += runner.step([(3, [8]), (1, [9])])
    return outs


@pytest.mark.parametrize("arch,overrides,page_size", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_poisoned_pools_change_nothing_and_stay_poisoned_outside_owned(arch, overrides, page_size):
    hf, spec = tiny_model(arch, seed=11, **overrides)
    clean = _schedule(PagedRunner(spec, hf, page_size, num_pages=40, num_slots=6))
    runner = PagedRunner(spec, hf, page_size, num_pages=40, num_slots=6)
    runner.poison()
    poisoned = _schedule(runner)
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=0, atol=0)

    pages, slots = runner.owned()
    k_and_v = runner.pools.kv.kv  # [layers, 2, pages + sentinel, page_size, heads, dim]
    for page in range(k_and_v.shape[2]):
        if page not in pages:  # includes the sentinel page 0
            assert torch.isnan(k_and_v[:, :, page]).all(), f"page {page} was written by a request that does not own it"
    if runner.pools.linear_state is not None:
        conv, recurrent = runner.pools.linear_state.conv, runner.pools.linear_state.recurrent
        for slot in range(conv.shape[1]):
            if slot not in slots:  # includes the padding slot 0
                assert torch.isnan(conv[:, slot]).all() and torch.isnan(recurrent[:, slot]).all(), f"slot {slot}"


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_reused_slot_and_pages_start_clean(arch):
    """A request handed the slot and pages of a finished one (stale state and K/V) matches transformers."""
    hf, spec = tiny_model(arch, seed=12)
    runner = PagedRunner(spec, hf, page_size=4, num_slots=1)
    runner.generate(1, [5, 6, 7, 8, 9, 10], steps=8)
    runner.release(1)
    prompt = [11, 3, 40, 2, 2, 17, 90]
    prompt_logits, tokens, step_logits = runner.generate(2, prompt, steps=8)
    ref_tokens, ref_step_logits, ref_prompt_logits = hf_greedy(hf, prompt, 8)
    assert_logits_close(prompt_logits, ref_prompt_logits)
    assert tokens == ref_tokens
    assert_logits_close(step_logits, ref_step_logits)


@pytest.mark.parametrize("arch,overrides,page_size", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_padded_rows_touch_only_the_sentinel_page_and_padding_slot(arch, overrides, page_size):
    """Padding rows (sentinel page table, padding slot, poisoned) leave real requests unchanged."""
    hf, spec = tiny_model(arch, seed=13, **overrides)
    clean = PagedRunner(spec, hf, page_size, num_pages=40, num_slots=6)
    padded = PagedRunner(spec, hf, page_size, num_pages=40, num_slots=6)
    padded.poison()
    steps = [[(1, [4, 8, 15, 16, 23]), (2, [42])], [(1, [7]), (2, [9, 9])], [(2, [1]), (1, [2])]]
    for items in steps:
        want = clean.step(items, all_rows=False)
        got = padded.step(items, all_rows=False, padding=3)
        for a, b in zip(want, got):
            assert torch.isfinite(b).all()
            assert_logits_close(b, a, rel=1e-5)  # not bitwise: more rows change the GEMM blocking
    padded.assert_poisoned_past_padding()
