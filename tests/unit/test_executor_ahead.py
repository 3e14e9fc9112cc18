"""The executor's launch/finish split and rows fed from the step before (StepBatch.feed_sampled), on CPU:
a step launched before the previous one finished gives the same tokens as running them one by one."""

from __future__ import annotations

import numpy as np
import pytest

from ferry.services.worker.boot import boot_worker
from ferry.services.worker.executor import StepBatchError
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch
from tests.unit.test_boot_executor import boot_args

PROMPTS = {11: [5, 17, 33, 2, 8], 12: [7, 7, 3, 250, 1, 64, 9]}


def _step(step_id, tokens: dict[int, list[int]], context: dict[int, int], page_size, fed=False, news=()):
    rids = list(tokens)
    pages = max(-(-(context[r] + len(tokens[r])) // page_size) for r in rids)
    table = np.array([[1 + 8 * i + j for j in range(pages)] for i in range(len(rids))], np.int32)
    return StepBatch(
        step_id=step_id,
        req_ids=np.array(rids, np.int64),
        tokens=np.array([t for r in rids for t in tokens[r]], np.int32),
        query_lens=np.array([len(tokens[r]) for r in rids], np.int32),
        context_lens=np.array([context[r] for r in rids], np.int32),
        page_table=table,
        linear_state_slots=np.arange(1, len(rids) + 1, dtype=np.int32),
        reset_linear_state=np.array([context[r] == 0 for r in rids]),
        sample=np.ones(len(rids), bool),
        new_requests=tuple(news),
        feed_sampled=np.ones(len(rids), bool) if fed else None,
    )


def _decode(model_dir, ahead: bool, steps=6, **sampling):
    executor, plan = boot_worker(boot_args(model_dir, "--gpu-memory", "64MiB"))
    return decode_two_requests(executor, ahead, steps, **sampling), executor


def decode_two_requests(executor, ahead: bool, steps=6, **sampling) -> dict[int, list[int]]:
    """Prefill two requests, then decode 2 * steps tokens: one step at a time, or (`ahead`) each pair of
    steps launched together, the second fed the first's samples, finished in order."""
    ps = executor.plan.kv.page_size
    news = [
        NewRequest(
            req_id=r, prompt_token_ids=np.array(p, np.int32), sampling=SamplingParams(**{"temperature": 0, **sampling})
        )
        for r, p in PROMPTS.items()
    ]
    context = {r: 0 for r in PROMPTS}
    out = executor.execute(_step(1, dict(PROMPTS), context, ps, news=news))
    last = dict(zip(out.req_ids.tolist(), out.token_ids.tolist()))
    got = {r: [last[r]] for r in PROMPTS}
    context = {r: len(p) for r, p in PROMPTS.items()}
    for s in range(steps):
        if ahead:  # step s+2 fed from s+1, launched before s+1 finishes
            first = executor.launch(_step(2 + 2 * s, {r: [last[r]] for r in PROMPTS}, context, ps))
            context = {r: c + 1 for r, c in context.items()}
            second = executor.launch(_step(3 + 2 * s, {r: [0] for r in PROMPTS}, context, ps, fed=True))
            context = {r: c + 1 for r, c in context.items()}
            outs = [executor.finish(first), executor.finish(second)]
        else:
            outs = []
            for k in range(2):
                outs.append(executor.execute(_step(2 + 2 * s + k, {r: [last[r]] for r in PROMPTS}, context, ps)))
                last = dict(zip(outs[-1].req_ids.tolist(), outs[-1].token_ids.tolist()))
                context = {r: c + 1 for r, c in context.items()}
        for o in outs:
            last = dict(zip(o.req_ids.tolist(), o.token_ids.tolist()))
            for r in PROMPTS:
                got[r].append(last[r])
    return got


def test_rows_fed_from_the_step_before_decode_as_the_tokens_themselves(tiny_model):
    want, _ = _decode(tiny_model, ahead=False)
    got, _ = _decode(tiny_model, ahead=True)
    assert got == want and len(got[11]) == 13


def test_a_fed_row_is_refused_without_the_step_before_or_when_its_sampling_reads_its_output(tiny_model):
    _, executor = _decode(tiny_model, ahead=False, steps=1)
    ps = executor.plan.kv.page_size
    executor.execute(StepBatch.empty(step_id=50))  # a step that sampled nothing: no token to feed from
    with pytest.raises(StepBatchError, match="feeds rows"):
        executor.execute(_step(51, {11: [0]}, {11: 8}, ps, fed=True))
    _, executor = _decode(tiny_model, ahead=False, steps=1, repetition_penalty=1.3)
    with pytest.raises(StepBatchError, match="reads its own output"):
        executor.execute(_step(60, {11: [0]}, {11: 8}, ps, fed=True))


def test_the_contract_holds_feed_sampled_to_its_shape_and_to_rows_that_continue_a_request():
    from ferry.shared.contract import StepLimits, step_problems

    limits = StepLimits(
        kv_pages=64,
        page_size=16,
        linear_state_slots=4,
        max_running_requests=8,
        max_prefill_tokens=64,
        max_model_len=256,
        vocab_size=512,
    )
    known = {11: None, 12: None}
    good = _step(1, {11: [0], 12: [0]}, {11: 5, 12: 7}, 16, fed=True)
    assert step_problems(good, limits, known) == []
    import msgspec

    for bad, why in (
        (msgspec.structs.replace(good, feed_sampled=np.ones(2, np.int32)), "1-D bool"),
        (msgspec.structs.replace(good, feed_sampled=np.ones(3, bool)), "3 entries for 2"),
        (_step(2, {11: [0, 0]}, {11: 5}, 16, fed=True), "already started"),
        (_step(3, {11: [0]}, {11: 0}, 16, fed=True), "already started"),
    ):
        assert any(why in p for p in step_problems(bad, limits, known)), why
