"""The draft-length controller (services/scheduler/draft_length.py): k per row from the measured acceptance and
the priced cost of the verify positions, their expert misses included. Deterministic: no model, no clock."""

from __future__ import annotations

from collections import deque

import numpy as np

from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.scheduler.draft_length import PROBE_EVERY, DraftLength, ExpertPrices
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import StepOutput

K = 4


def pool(**experts) -> PoolReport:
    return PoolReport(
        kv_pages=64,
        page_size=16,
        linear_state_slots=0,
        max_running_requests=8,
        max_prefill_tokens=256,
        max_model_len=1024,
        **experts,
    )


RESIDENT = pool()
# a 48-layer MoE of 128 experts a layer, top-8, a quarter of them on the GPU, 12 MiB an expert (~0.25 ms a copy)
OFFLOADED = pool(
    experts_offloaded=True,
    expert_slots=48 * 32,
    expert_total=48 * 128,
    moe_layers=48,
    experts_top_k=8,
    expert_bytes=12 << 20,
)


def run(ctl: DraftLength, steps: int, alpha: float, seed: int = 0) -> list[int]:
    """One request decoding alone for `steps` steps, each draft kept with chance `alpha` given the ones before
    it were (a fixed seed): the k chosen each step."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(steps):
        k = ctl.choose(7, rows=1, step_tokens=1, limit=K)
        chosen.append(k)
        if k:
            ctl.sent(7, 1, k)
            kept = 0
            while kept < k and rng.random() < alpha:
                kept += 1
            ctl.observe(7, k, kept)
    return chosen


def test_at_acceptance_zero_drafting_stops_within_a_few_steps_and_only_probes_after():
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    chosen = run(ctl, 400, alpha=0.0)
    assert chosen[0] == K  # the prior: a request starts drafting
    first_plain = chosen.index(0)
    assert first_plain <= 4
    after = chosen[first_plain:]
    # only the probes draft, one token each, one decision in PROBE_EVERY
    assert set(after) <= {0, 1}
    assert sum(after) <= len(after) / PROBE_EVERY + 1
    # extra positions over the whole run: a few rows at the start, then the probes
    assert sum(chosen) <= 3 * K + len(chosen) / PROBE_EVERY + 1
    assert ctl.decisions == 400 and ctl.chosen_drafts == sum(chosen)


def test_at_acceptance_zero_speculation_costs_under_three_percent_of_plain_decode():
    """Every draft refused, over a long decode: the drafted rows' priced extra cost (the first rows, the probes)
    stays under 3 % of the plain steps' cost, resident or offloaded (an offloaded probe's misses cost nearly a
    step, so it probes less often). A probe every PROBE_EVERY steps whatever it costs fails the offloaded case."""
    for prices in (ExpertPrices.of(RESIDENT), ExpertPrices.of(OFFLOADED)):
        ctl = DraftLength(K, prices)
        chosen = run(ctl, 2000, alpha=0.0)
        extra = sum(ctl.extra_s(1, k) for k in chosen if k)
        assert 0 < extra < 0.03 * len(chosen) * ctl.step_s(1)
        assert ctl.probe_interval(1, 1) >= PROBE_EVERY


def test_high_acceptance_with_resident_experts_drafts_all_it_may():
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    chosen = run(ctl, 200, alpha=0.95)
    assert chosen.count(K) >= 190
    assert ctl.estimated_misses_added == 0.0  # nothing offloaded: no miss is priced


def test_expensive_misses_cut_the_drafts_at_the_same_acceptance():
    """The same high acceptance: K with every expert resident, fewer where each extra position's experts
    must be copied over PCIe. A controller that ignores the miss cost drafts K here and fails."""
    resident = DraftLength(K, ExpertPrices.of(RESIDENT))
    offloaded = DraftLength(K, ExpertPrices.of(OFFLOADED))
    assert resident.best(0.9, rows=1, step_tokens=1, limit=K) == K
    assert offloaded.best(0.9, rows=1, step_tokens=1, limit=K) < K
    assert offloaded.misses_added(1, 1) > 0
    # a very high acceptance still pays for some drafts (the misses of more positions grow less than linearly)
    assert offloaded.best(0.99, rows=1, step_tokens=1, limit=K) >= 1
    chosen = run(offloaded, 200, alpha=0.9)
    assert sum(chosen) < 0.75 * K * len(chosen)
    assert offloaded.estimated_misses_added > 0


def test_the_measured_miss_rate_prices_the_misses():
    """The worker's hit and miss counts replace the plan's slot share: a cache that hits almost always makes
    drafting pay where the slot share alone would not."""
    ctl = DraftLength(K, ExpertPrices.of(OFFLOADED))
    assert ctl.current_miss_rate() == 0.75  # before any count: 1 - slots / experts
    before = ctl.best(0.9, rows=1, step_tokens=1, limit=K)
    ctl.note_expert_lookups(1000, 1000)  # the first counts set the base
    assert ctl.miss_rate is None
    for i in range(1, 30):
        ctl.note_expert_lookups(1000 + 990 * i, 1000 + 10 * i)  # 1 % misses since
    assert abs(ctl.current_miss_rate() - 0.01) < 0.005
    assert ctl.best(0.9, rows=1, step_tokens=1, limit=K) > before
    ctl.note_expert_lookups(5, 5)  # a restarted worker's counts start over: a new base, no rate from them
    assert abs(ctl.current_miss_rate() - 0.01) < 0.005


def test_a_wider_step_needs_a_higher_acceptance_and_the_limit_binds():
    """A row's share of a step of many rows is small, so its extra positions must earn more; never past `limit`."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    assert ctl.best(0.5, rows=1, step_tokens=1, limit=K) > 0
    assert ctl.best(0.5, rows=8, step_tokens=8, limit=K) == 0
    assert ctl.best(0.99, rows=1, step_tokens=1, limit=2) == 2
    assert ctl.best(0.0, rows=1, step_tokens=1, limit=K) == 0


def test_the_eager_step_is_paid_once_and_an_unmeasured_request_drafts_once():
    """In a wide step the first drafting row pays for the eager step; the rows after it draft for their own
    positions' cost alone. A request never measured drafts at once (its prior alone would not, here)."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    assert ctl.best(0.7, rows=8, step_tokens=8, limit=K) == 0
    assert ctl.best(0.7, rows=8, step_tokens=8, limit=K, eager_paid=True) > 0
    assert ctl.choose(3, rows=8, step_tokens=8, limit=K) == 1  # unmeasured: a probe at once
    ctl.sent(3, 8, 1)
    ctl.observe(3, 1, 0)
    assert ctl.choose(3, rows=8, step_tokens=8, limit=K) == 0  # measured: its estimate decides
    ctl.choose(4, rows=8, step_tokens=8, limit=K)  # unmeasured, no drafts proposed: asked again
    assert ctl.would_draft(4, rows=8, step_tokens=8) and ctl.choose(4, rows=8, step_tokens=8, limit=K) == 1
    for _ in range(PROBE_EVERY):  # never a draft to send: after PROBE_EVERY decisions it waits for its probes
        ctl.choose(4, rows=8, step_tokens=8, limit=K)
    assert not ctl.would_draft(4, rows=8, step_tokens=8)


def test_a_request_forgotten_starts_again_from_the_prior():
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    run(ctl, 20, alpha=0.0)
    assert ctl.acceptance(7) < 0.2
    ctl.forget(7)
    assert ctl.acceptance(7) == 0.7


def test_a_request_that_starts_repeating_is_found_again_by_the_probes():
    """Drafting stopped (nothing kept), then the text repeats: a probe's kept draft raises the estimate and
    the request drafts again within a couple of probe periods."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    chosen = run(ctl, 40, alpha=0.0)
    assert chosen[-1] == 0
    again = run(ctl, 2 * PROBE_EVERY + 8, alpha=1.0)
    assert again[-1] == K


def answer(batch, accepted: int = 0) -> StepOutput:
    """The worker's answer: token 7 for every sampling row, `accepted` drafts kept of each drafting row's."""
    rows = batch.req_ids[batch.sample]
    return StepOutput(
        step_id=batch.step_id,
        req_ids=rows,
        token_ids=np.full(len(rows), 7, np.int32),
        logprobs=np.zeros(len(rows), np.float32),
        accepted_drafts=None if batch.draft_lens is None else np.full(len(rows), accepted, np.int32),
    )


def test_a_request_held_at_no_drafts_is_scheduled_ahead_until_its_probe():
    """Speculation off schedules decode steps ahead of the answers (batcher.schedule_ahead); a request whose
    drafts are refused must not lose that: while the controller holds it at k = 0 its steps go ahead, and the
    pipeline stops for each probe, which the full policy drafts."""
    sched = BatchScheduler(RESIDENT, speculative_method="ngram", speculative_tokens=K, drafter=lambda r, k: [3] * k)
    sched.add(1, b"t", 1, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 300)
    sched.complete(answer(sched.schedule()))  # the prompt
    in_flight: deque = deque()
    drafted, ahead = [], 0  # drafts of each step the full policy sent; steps sent ahead
    while sched.running:
        if not sched.step_in_flight:
            in_flight.append(batch := sched.schedule())
            drafted.append(0 if batch.draft_lens is None else int(batch.draft_lens.sum()))
        while (batch := sched.schedule_ahead()) is not None:
            assert batch.draft_lens is None
            in_flight.append(batch)
            ahead += 1
        sched.complete(answer(in_flight.popleft()))
    assert drafted[0] == K  # the prior: it drafts first
    assert ahead > 200  # then decodes as without speculation, steps ahead of the answers
    probes = drafted[drafted.index(0) :]
    assert 300 / (3 * PROBE_EVERY) < probes.count(1) <= 300 / PROBE_EVERY + 1  # the pipeline stopped for them
    assert set(probes) <= {0, 1} and sched.drafted_tokens == sum(drafted)
