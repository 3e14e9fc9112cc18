"""Boot's warm-up steps (services/worker/warmup.py): within the plan's limits, and touching no request's state."""

from __future__ import annotations

import torch

from ferry.services.worker.boot import boot_worker
from ferry.services.worker.warmup import real_warmup_shapes, warm_up, warmup_shapes, warmup_step
from tests.unit.test_boot_executor import boot_args


def test_shapes_stay_within_the_plan_and_cover_the_integer_classes():
    shapes = warmup_shapes(max_prefill_tokens=64, max_running_requests=4)
    assert shapes and len(set(shapes)) == len(shapes)
    assert all(len(s) <= 4 and sum(s) <= 64 for s in shapes)
    tokens = {sum(s) for s in shapes}
    assert 1 in tokens and any(t % 16 == 0 for t in tokens) and any(t > 1 and t % 2 for t in tokens)
    assert any(len(s) > 1 and max(s) == 1 for s in shapes) and any(len(s) > 1 and max(s) > 1 for s in shapes)
    assert warmup_shapes(max_prefill_tokens=1, max_running_requests=1) == [(1,)]


def test_a_warmup_step_lives_on_the_sentinel_page_and_the_padding_slot():
    step = warmup_step((3, 17, 30), page_size=16)
    assert step.page_table.shape == (3, 2) and not step.page_table.any()
    assert not step.linear_state_slots.any() and step.reset_linear_state.all() and step.sample.all()
    assert step.query_lens.tolist() == [3, 17, 30] and len(step.tokens) == 50 and not step.context_lens.any()


def _inside_steps(pools, plan) -> int:
    """The warm-up's steps that keep a state inside their chunk: a hybrid model's with snapshots."""
    from ferry.services.worker.warmup import save_inside_shapes

    linear = pools.linear_state
    if linear is None or not linear.num_snapshots:
        return 0
    return sum(s[0] <= plan.max_prefill_tokens for s in save_inside_shapes(plan.kv.page_size))


def test_warm_up_runs_every_shape_and_changes_no_request_state(tiny_model):
    """(The device-driven expert store, which reads `real_tokens`, runs on CUDA only: there
    tests/gpu/test_device_decode_cuda.py checks that boot's warm-up staged no expert.)"""
    executor, plan = boot_worker(boot_args(tiny_model, "--gpu-memory", "64MiB"))
    pools = executor.pools
    kv = pools.kv.kv  # [layers, 2, pages + 1, page_size, heads, D]; page 0 is the sentinel
    kv[:, :, 1:] = 1.0
    kv[:, :, 0] = 0.0
    linear = [t for t in (pools.linear_state.conv, pools.linear_state.recurrent)] if pools.linear_state else []
    for t in linear:  # [layers, slots + 1, ...]; slot 0 is the padding slot
        t[:, 1:] = 1.0
    shapes = warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests)
    real = real_warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests)
    assert real == [(1,), (1, 1), (16,)]
    inside = _inside_steps(pools, plan)
    assert (
        warm_up(
            executor.model,
            pools,
            plan.kv.page_size,
            torch.device("cpu"),
            shapes,
            real,
            max_prefill_tokens=plan.max_prefill_tokens,
        )
        == len(shapes) + inside + 3
    )
    assert bool((kv[:, :, 1:] == 1.0).all()), "a warm-up step wrote a usable KV page"
    assert bool(kv[:, :, 0].abs().sum() > 0), "the warm-up never reached attention"
    for t in linear:
        assert bool((t[:, 1:] == 1.0).all()), "a warm-up step wrote a usable linear-state slot"


def test_the_warm_up_ends_with_steps_whose_rows_the_expert_store_counts_as_real(tiny_model):
    """A first request's path through the expert store (real rows: looked up, missed, copied) compiles
    at boot: the last warm-up steps give the store their real row count, the others 0 (padding)."""
    executor, plan = boot_worker(boot_args(tiny_model, "--gpu-memory", "64MiB"))
    seen = []

    class Recording:
        def __call__(self, batch, pools):
            seen.append(int(batch.real_tokens[0]))

    shapes = warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests)
    real = real_warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests)
    padding = len(shapes) + _inside_steps(executor.pools, plan)  # the inside-saving steps are padding too
    warm_up(
        Recording(),
        executor.pools,
        plan.kv.page_size,
        torch.device("cpu"),
        shapes,
        real,
        max_prefill_tokens=plan.max_prefill_tokens,
    )
    assert seen[:padding] == [0] * padding
    assert seen[padding:] == [sum(s) for s in real] == [1, 2, 16]


def test_a_hybrid_model_also_warms_the_prefill_that_keeps_a_state_inside_its_chunk(tiny_models):
    """The prefix cache's snapshot points (StepBatch.save_offset) split the Gated DeltaNet rule of a chunk in
    two: boot runs that path too, one row each whose tail after the point is 1, a page and a page plus one
    tokens, saving into the last snapshot (no request holds one yet) and touching no request's state."""
    from ferry.services.worker.warmup import save_inside_shapes

    executor, plan = boot_worker(boot_args(tiny_models["qwen3_5_moe"], "--gpu-memory", "64MiB"))
    pools, ps = executor.pools, plan.kv.page_size
    linear = pools.linear_state
    assert linear.num_snapshots > 0
    for t in (linear.conv, linear.recurrent):
        t[:, 1:] = 1.0
    linear.snapshot_recurrent.zero_()
    seen = []

    class Recording:
        def __call__(self, batch, pools):
            seen.append(batch.inside_saves)
            return executor.model(batch, pools)

    shapes = warmup_shapes(plan.max_prefill_tokens, plan.max_running_requests)
    ran = warm_up(Recording(), pools, ps, torch.device("cpu"), shapes, (), max_prefill_tokens=plan.max_prefill_tokens)
    assert ran == len(shapes) + 3 and save_inside_shapes(ps) == ((ps + 1,), (2 * ps,), (2 * ps + 1,))
    last = linear.num_snapshots - 1
    assert seen[len(shapes) :] == [((0, ps, last),)] * 3  # row 0 keeps its state after a page, into `last`
    assert bool(linear.snapshot_recurrent[last].abs().sum() > 0), "the state inside the chunk was not kept"
    assert not bool(linear.snapshot_recurrent[:last].abs().sum())  # no other snapshot touched
    for t in (linear.conv, linear.recurrent):
        assert bool((t[:, 1:] == 1.0).all()), "a warm-up step wrote a usable linear-state slot"
    # within the prefill budget only
    assert warm_up(Recording(), pools, ps, torch.device("cpu"), [], (), max_prefill_tokens=ps + 1) == 1
