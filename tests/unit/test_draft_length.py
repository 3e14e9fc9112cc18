"""The draft-length controller (services/scheduler/draft_length.py): k per row from the measured acceptance and
the priced cost of the verify positions, their expert misses included. Deterministic: no model, no clock."""

from __future__ import annotations

from collections import deque

import msgspec
import numpy as np
import pytest

from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.scheduler.draft_length import (
    DRAFT_STEP_OVERHEAD_S,
    MTP_CHAIN_STEP_OVERHEAD_S,
    PROBE_EVERY,
    VERIFY_POSITION_S,
    ChainPrices,
    DraftLength,
    ExpertPrices,
)
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
    positions' cost alone. Before any row was verified a request never measured drafts at once (its prior alone
    would not, here)."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    assert ctl.best(0.7, rows=8, step_tokens=8, limit=K) == 0
    assert ctl.best(0.7, rows=8, step_tokens=8, limit=K, eager_paid=True) > 0
    ctl.choose(4, rows=8, step_tokens=8, limit=K)  # unmeasured, no drafts proposed: asked again
    assert ctl.would_draft(4, rows=8, step_tokens=8) and ctl.choose(4, rows=8, step_tokens=8, limit=K) == 1
    for _ in range(PROBE_EVERY):  # never a draft to send: after PROBE_EVERY decisions it waits for its probes
        ctl.choose(4, rows=8, step_tokens=8, limit=K)
    assert not ctl.would_draft(4, rows=8, step_tokens=8)
    assert ctl.choose(3, rows=8, step_tokens=8, limit=K) == 1  # unmeasured: a probe at once
    ctl.sent(3, 8, 1)
    ctl.observe(3, 1, 0)
    assert ctl.choose(3, rows=8, step_tokens=8, limit=K) == 0  # measured: its estimate decides


def test_a_new_request_starts_from_what_the_servers_rows_showed():
    """Once rows were verified a new request's estimate is the server's (all requests' rows, decayed), weighing as
    much as the prior: after refused drafts a new request does not probe at once (each probe an eager step), after
    kept ones it drafts all it may from its first row."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    assert ctl.acceptance(1) == 0.7
    run(ctl, 20, alpha=0.0)  # request 7's drafts refused
    assert ctl.acceptance(1) == 0.7  # known before: its own estimate
    assert ctl.acceptance(2) < 0.2 and ctl.choose(2, rows=1, step_tokens=1, limit=K) == 0
    assert not ctl.would_draft(3, rows=1, step_tokens=1)
    for rid in range(10, 30):  # requests whose drafts are all kept
        ctl.sent(rid, 1, K)
        ctl.observe(rid, K, K)
    assert ctl.acceptance(40) > 0.9 and ctl.choose(40, rows=1, step_tokens=1, limit=K) == K
    # the estimate weighs as much as the prior: a new request's own refused rows move it as fast
    fresh = DraftLength(K, ExpertPrices.of(RESIDENT))
    for c in (ctl, fresh):
        c.observe(41, K, 0)
    assert ctl.acceptance(41) > fresh.acceptance(41)
    assert ctl._requests[41].kept + ctl._requests[41].refused == pytest.approx(
        fresh._requests[41].kept + fresh._requests[41].refused
    )


def test_a_request_forgotten_starts_again_from_what_the_server_saw():
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    run(ctl, 20, alpha=0.0)
    assert ctl.acceptance(7) < 0.2
    ctl.forget(7)
    assert ctl.acceptance(7) == ctl.acceptance(8) < 0.2
    assert DraftLength(K, ExpertPrices.of(RESIDENT)).acceptance(7) == 0.7


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


def decode_all(sched: BatchScheduler) -> tuple[list[int], int, int]:
    """Decode every running request to its end, each step scheduled ahead where the batcher allows: (drafts of
    each step the full policy sent, steps sent ahead, steps in all)."""
    in_flight: deque = deque()
    drafted, ahead, steps = [], 0, 0
    while sched.running:
        if not sched.step_in_flight:
            in_flight.append(batch := sched.schedule())
            drafted.append(0 if batch.draft_lens is None else int(batch.draft_lens.sum()))
        while (batch := sched.schedule_ahead()) is not None:
            in_flight.append(batch)
            ahead += 1
        sched.complete(answer(in_flight.popleft()))
        steps += 1
    return drafted, ahead, steps


def test_a_request_whose_lookups_find_nothing_is_scheduled_ahead_and_looks_again_at_its_probes():
    """Prompt lookup over text with no n-gram to continue finds no drafts: the request, never measured, must not
    hold every step for the answer of the one before (where its next lookup would wait): it decodes ahead as
    without speculation, looking again once a probe interval, and drafts once its text gives something to find."""
    looks: list[int] = []

    def drafter(req, k):  # nothing to find until the request's 200th token
        looks.append(len(req.tokens))
        return [3] * k if len(req.tokens) - req.prompt_len >= 200 else []

    sched = BatchScheduler(RESIDENT, speculative_method="ngram", speculative_tokens=K, drafter=drafter)
    sched.add(1, b"t", 1, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 300)
    sched.complete(answer(sched.schedule()))  # the prompt
    drafted, ahead, steps = decode_all(sched)
    early = [n for n in looks if n - 8 < 200]
    assert len(early) <= 200 / PROBE_EVERY + 2  # looked for at its probes, not every step
    assert ahead > 0.8 * steps  # decoded ahead of the answers meanwhile
    assert max(drafted) > 0 and sched.drafted_tokens == sum(drafted)  # found once there was something to find


def test_an_mtp_row_whose_drafts_come_back_empty_asks_no_chain_until_its_probe():
    """--speculative-method mtp with a drafter that finds nothing (the bench's oracle off its recorded path):
    the rows stop asking the worker for chains whose drafts they would not get, and go ahead of the answers."""
    sched = BatchScheduler(MTP_SMALL, speculative_method="mtp", speculative_tokens=K, drafter=lambda r, k: [])
    sched.add(1, b"t", 1, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 300)
    in_flight: deque = deque([sched.schedule()])
    asked = ahead = steps = 0
    while sched.running or in_flight:
        if not in_flight:
            in_flight.append(sched.schedule())
        while (batch := sched.schedule_ahead()) is not None:
            in_flight.append(batch)
            ahead += 1
        batch = in_flight.popleft()
        asked += 0 if batch.mtp_drafts is None else 1
        sched.complete(mtp_answer(batch, 0))
        steps += 1
    assert asked <= 300 / PROBE_EVERY + 2 and ahead > 0.8 * steps


# --speculative-method mtp: the MTP chain's bytes (plan/mtp_layer.py's MtpChainBytes). Qwen3.6's: a 248k x 2048 bf16
# LM head (~1 GB a chain step), ~80 MB of the layer's dense weights, eight 6 MiB experts a row
MTP_QWEN = pool(mtp_lm_head_bytes=248_320 * 2048 * 2, mtp_layer_bytes=80 << 20, mtp_row_expert_bytes=8 * (6 << 20))
# a small model's chain: a 32k x 1024 LM head
MTP_SMALL = pool(mtp_lm_head_bytes=32_000 * 1024 * 2, mtp_layer_bytes=20 << 20, mtp_row_expert_bytes=8 * (1 << 20))


def mtp(report: PoolReport = MTP_SMALL) -> DraftLength:
    return DraftLength(K, ExpertPrices.of(report), ChainPrices.of(report))


def test_mtp_a_costlier_chain_gives_shorter_drafts_at_the_same_acceptance():
    """Each draft is a dependent pass of the MTP layer and the LM head: where a chain step reads more, fewer drafts
    pay at the same acceptance. Pricing MTP drafts as ngram's (free to make) drafts K for both and fails."""
    small, qwen = mtp(MTP_SMALL), mtp(MTP_QWEN)
    assert qwen.extra_s(1, 1) > small.extra_s(1, 1) > VERIFY_POSITION_S
    for acceptance in (0.6, 0.8):
        assert qwen.best(acceptance, rows=1, step_tokens=1, limit=K) < small.best(acceptance, 1, 1, K)
    assert small.best(0.9, rows=1, step_tokens=1, limit=K) == K
    assert 0 < qwen.best(0.95, rows=1, step_tokens=1, limit=K)  # a high acceptance still pays for the chain
    chosen_small, chosen_qwen = run(small, 200, alpha=0.8), run(mtp(MTP_QWEN), 200, alpha=0.8)
    assert sum(chosen_qwen) < sum(chosen_small)


def test_mtp_at_acceptance_zero_drafting_stops_within_a_few_rows():
    for report in (MTP_SMALL, MTP_QWEN):
        ctl = mtp(report)
        chosen = run(ctl, 400, alpha=0.0)
        assert chosen[0] >= 1  # unmeasured: it drafts at once
        first_plain = chosen.index(0)
        assert first_plain <= 6
        assert sum(chosen[:first_plain]) <= 3 * K
        after = chosen[first_plain:]
        assert set(after) <= {0, 1} and sum(after) <= len(after) / PROBE_EVERY + 1  # then only the probes
        assert ctl.best(0.0, rows=1, step_tokens=1, limit=K) == 0
        extra = sum(ctl.extra_s(1, k) for k in chosen if k)
        assert 0 < extra < 0.03 * len(chosen) * ctl.step_s(1)


def test_mtp_a_draft_pays_the_eager_step_and_its_chain_and_a_plain_step_is_a_graphs():
    """Under mtp a plain step replays its decode graph (the head's K/V written in it): it costs what ngram's plain
    step does, and a draft pays the eager step as ngram's does, plus its chain position and the row's experts in
    the layer. Sinking the eager step or the layer's pass into every step (as when mtp ran every step eagerly)
    fails."""
    ngram = DraftLength(K, ExpertPrices.of(RESIDENT))
    ctl = mtp(MTP_SMALL)
    c = ctl.chain
    assert ctl.step_s(2) == ngram.step_s(2)
    assert ctl.extra_s(2, 1) == VERIFY_POSITION_S + DRAFT_STEP_OVERHEAD_S + c.position_s + c.row_s
    assert ctl.extra_s(2, 1, eager_paid=1) == VERIFY_POSITION_S + c.row_s  # a row before it paid both
    assert c.position_s == pytest.approx(c.lm_head_s + c.layer_s + MTP_CHAIN_STEP_OVERHEAD_S)
    for acceptance in (0.4, 0.6, 0.8):  # never cheaper than ngram's free drafts
        assert ctl.best(acceptance, rows=2, step_tokens=2, limit=K) <= ngram.best(acceptance, 2, 2, K)


def test_mtp_a_chain_position_is_paid_once_a_step():
    """The LM head's and the layer's reads are paid once a chain position for the rows chaining to it: a row
    after one chaining k in the same step pays only its own part up to k, so it drafts at a lower acceptance."""
    ctl = mtp(MTP_QWEN)
    c = ctl.chain
    own = 2 * VERIFY_POSITION_S + 2 * c.row_s
    assert ctl.extra_s(1, 2, eager_paid=2) == own
    assert ctl.extra_s(1, 2, eager_paid=1) == pytest.approx(own + c.position_s)
    assert ctl.extra_s(1, 2) == pytest.approx(own + DRAFT_STEP_OVERHEAD_S + 2 * c.position_s)
    assert ctl.best(0.6, rows=4, step_tokens=4, limit=K) == 0
    assert ctl.best(0.6, rows=4, step_tokens=4, limit=K, eager_paid=K) > 0


def test_the_scheduler_prices_mtp_drafts_by_the_chain_and_ngram_drafts_as_before():
    ngram = BatchScheduler(MTP_QWEN, speculative_method="ngram", speculative_tokens=K)
    assert ngram.draft_length.chain is None
    assert ngram.draft_length.extra_s(1, 1) == VERIFY_POSITION_S + DRAFT_STEP_OVERHEAD_S
    sched = BatchScheduler(MTP_QWEN, speculative_method="mtp", speculative_tokens=K)
    assert sched.draft_length.chain == ChainPrices.of(MTP_QWEN)
    assert sched.draft_length.chain.lm_head_s > 3e-4  # ~1 GB read at HBM rate


def test_a_step_tells_each_row_the_chain_positions_rows_before_it_pay(monkeypatch):
    """The scheduler passes each drafting row the most drafts a row before it in the step carries (at least what
    the rows agreed to pay together), so with mtp the chain positions those pay are not charged again (a flag
    alone would charge every position but the eager step's to each row)."""
    seen = []
    choose = DraftLength.choose

    def recording(self, rid, rows, step_tokens, limit, eager_paid=0):
        seen.append(eager_paid)
        return choose(self, rid, rows, step_tokens, limit, eager_paid)

    monkeypatch.setattr(DraftLength, "choose", recording)
    sched = BatchScheduler(MTP_SMALL, speculative_method="mtp", speculative_tokens=K, drafter=lambda r, k: [3] * k)
    for rid in (1, 2):
        sched.add(rid, b"t", rid, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 50)
    sched.complete(answer(sched.schedule()))  # the prompts
    for _ in range(5):
        sched.draft_length.observe(1, K, K)  # the first row's drafts have all been kept: it chains far
    batch = sched.schedule()
    drafts = batch.draft_lens.tolist()
    assert drafts[0] >= 2 and seen[1] == max(seen[0], drafts[0])


def test_an_mtp_row_asks_the_worker_for_the_drafts_its_next_row_is_expected_to_get():
    """The worker chains what the scheduler asks; a chain position past the k the controller then gives the next
    row is a pass of the MTP layer and the LM head thrown away. A request held at k = 0 asks for none (but its due
    probe's one), one whose drafts are all kept asks for K (a small model's chain: with Qwen's 1 GB LM head a
    step's first chaining row bears the whole chain and, of two rows, declines). Asking --speculative-tokens always
    fails."""
    sched = BatchScheduler(MTP_SMALL, speculative_method="mtp", speculative_tokens=K, drafter=lambda r, k: [3] * k)
    for rid in (1, 2):
        sched.add(rid, b"t", rid, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 400)
    prompts = sched.schedule()
    assert prompts.mtp_drafts.min() >= 1  # unmeasured: drafts at once
    sched.complete(answer(prompts))
    ctl = sched.draft_length
    for _ in range(20):
        ctl.observe(1, K, K)  # request 1's drafts are all kept
        ctl.observe(2, K, 0)  # request 2's never
    asked = {1: [], 2: []}
    for _ in range(3 * PROBE_EVERY):
        batch = sched.schedule()
        rows = batch.req_ids[batch.sample]
        for rid, k in zip(rows.tolist(), batch.mtp_drafts if batch.mtp_drafts is not None else [0] * len(rows)):
            asked[rid].append(int(k))
        out = answer(batch)
        if batch.draft_lens is not None:  # request 1 keeps all its drafts, request 2 none
            out.accepted_drafts[:] = np.where(rows == 1, batch.draft_lens[batch.sample], 0)
        sched.complete(out)
    assert set(asked[1]) == {K}
    assert asked[2].count(0) > 2 * PROBE_EVERY and set(asked[2]) <= {0, 1}
    assert ctl.expected(2, 2, 2, K) == 0 < ctl.expected(1, 2, 2, K)


def test_measured_step_costs_replace_the_constants_and_move_the_choice():
    """A decode graph's replay measured at 4 ms (a big model's step, not DECODE_STEP_S's 1 ms) makes Qwen's chain
    cheap beside it: one stream at acceptance 0.8 drafts longer than priced alone; a chain position measured dear
    makes it draft shorter. Each is an EWMA of the steps that measure it (0: not measured, ignored)."""
    priced = mtp(MTP_QWEN)
    measured = mtp(MTP_QWEN)
    measured.note_step_costs(4e-3, 0.0)
    assert measured.step_s(1) == 4e-3 and measured.chain_position_s is None
    assert measured.best(0.8, rows=1, step_tokens=1, limit=K) > priced.best(0.8, rows=1, step_tokens=1, limit=K)
    dear = mtp(MTP_QWEN)
    dear.note_step_costs(4e-3, 3e-3)  # a chain position three quarters of a step, its rows' experts in it
    assert dear.extra_s(1, 2, eager_paid=0) == pytest.approx(2 * VERIFY_POSITION_S + DRAFT_STEP_OVERHEAD_S + 2 * 3e-3)
    assert dear.best(0.8, rows=1, step_tokens=1, limit=K) < measured.best(0.8, rows=1, step_tokens=1, limit=K)
    for _ in range(200):  # the estimate follows what the worker measures now
        dear.note_step_costs(2e-3, 0.0)
    assert dear.step_s(1) == pytest.approx(2e-3, rel=1e-3) and dear.chain_position_s == 3e-3


def test_a_measured_verify_step_prices_the_eager_step_a_draft_pays():
    """A step with drafts runs eagerly: where the worker measured one (its forward and verify) at 9 ms beside a 1 ms
    graph replay, a draft pays those 8 ms, not DRAFT_STEP_OVERHEAD_S's estimate, and one stream at acceptance 0.8
    that drafts all it may at the estimate drafts nothing; where the eager step costs what a replay does, nothing."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    assert ctl.best(0.8, rows=1, step_tokens=1, limit=K) == K
    ctl.note_step_costs(1e-3, 0.0, 9e-3)
    assert ctl.eager_overhead_s(1) == pytest.approx(8e-3)
    assert ctl.extra_s(1, 1) == pytest.approx(VERIFY_POSITION_S + 8e-3)
    assert ctl.best(0.8, rows=1, step_tokens=1, limit=K) == 0
    assert ctl.extra_s(1, 1, eager_paid=1) == pytest.approx(VERIFY_POSITION_S)  # paid by a row before it
    cheap = DraftLength(K, ExpertPrices.of(RESIDENT))
    cheap.note_step_costs(1e-3, 0.0, 0.9e-3)
    assert cheap.eager_overhead_s(1) == 0.0
    unmeasured = DraftLength(K, ExpertPrices.of(RESIDENT))
    unmeasured.note_step_costs(0.0, 0.0, 9e-3)  # no replay measured to set it against: the estimate stands
    assert unmeasured.eager_overhead_s(1) == DRAFT_STEP_OVERHEAD_S


def test_a_drafting_steps_wall_prices_it_where_the_device_leaves_part_out():
    """A drafting step is never sent ahead: where it takes 6.6 ms from send to answer (its chain left out) against a
    2.7 ms verify on the device and a 1 ms replay, a draft pays the 5.6 ms, and one stream at acceptance 0.8 that
    drafts at the device's price drafts nothing; a wall shorter than the device's verify leaves the device's."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    ctl.note_step_costs(1e-3, 0.0, 2.7e-3)
    assert ctl.eager_overhead_s(1) == pytest.approx(1.7e-3)
    assert ctl.best(0.8, rows=1, step_tokens=1, limit=K) > 0
    ctl.note_step_costs(1e-3, 0.0, 2.7e-3, 6.6e-3)
    assert ctl.verify_wall_s == 6.6e-3 and ctl.eager_overhead_s(1) == pytest.approx(5.6e-3)
    assert ctl.best(0.8, rows=1, step_tokens=1, limit=K) == 0
    quick = DraftLength(K, ExpertPrices.of(RESIDENT))
    quick.note_step_costs(1e-3, 0.0, 2.7e-3, 2.0e-3)
    assert quick.eager_overhead_s(1) == pytest.approx(1.7e-3)


def test_a_first_measurement_off_the_rest_is_outweighed_as_soon_as_others_come():
    """A step cost's first measurement (a cold replay, say 30 ms against the 2 ms of the rest) weighs as one of the
    measurements so far, not 1 - STEP_COST_WEIGHT (95 %) of the next: after ten more the verify price is within 3 ms
    of the rest, where an EWMA seeded by the first would still price ~19 ms and refuse every draft."""
    ctl = DraftLength(K, ExpertPrices.of(RESIDENT))
    ctl.note_step_costs(1e-3, 0.0, 30e-3)
    for _ in range(10):
        ctl.note_step_costs(1e-3, 0.0, 2e-3)
    assert ctl.verify_step_s == pytest.approx((30e-3 + 10 * 2e-3) / 11)
    for _ in range(200):
        ctl.note_step_costs(1e-3, 0.0, 2e-3)
    assert ctl.verify_step_s == pytest.approx(2e-3, rel=1e-3)


def test_the_scheduler_takes_the_workers_measured_step_costs():
    sched = BatchScheduler(MTP_QWEN, speculative_method="mtp", speculative_tokens=K)
    sched.add(1, b"t", 1, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 50)
    batch = sched.schedule()
    out = answer(batch)
    sched.complete(msgspec.structs.replace(out, decode_step_s=3e-3, chain_position_s=5e-4, verify_step_s=9e-3))
    assert sched.draft_length.decode_step_s == 3e-3 and sched.draft_length.chain_position_s == 5e-4
    assert sched.draft_length.verify_step_s == 9e-3


def test_the_scheduler_prices_a_drafting_step_by_its_wall_less_its_chain():
    """The service's send-to-answer seconds reach the controller for a step the worker timed as a drafting step,
    less the chain positions the step ran at the measured chain price; a plain step's wall prices nothing."""
    sched = BatchScheduler(MTP_QWEN, speculative_method="mtp", speculative_tokens=K)
    sched.add(1, b"t", 1, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 50)
    batch = sched.schedule()
    chained = int(batch.mtp_drafts.max())
    assert chained > 0  # a new request's first row asks the head for drafts
    sched.complete(answer(batch), wall_s=5e-3)  # no drafts verified: not a drafting step's price
    assert sched.draft_length.verify_wall_s is None
    batch = sched.schedule()
    chained = int(batch.mtp_drafts.max()) if batch.mtp_drafts is not None else 0
    out = msgspec.structs.replace(answer(batch), decode_step_s=1e-3, chain_position_s=5e-4, verify_step_s=3e-3)
    sched.complete(out, wall_s=9e-3)
    assert sched.draft_length.verify_wall_s == pytest.approx(9e-3 - chained * 5e-4)


@pytest.mark.parametrize(
    "field, value", [("decode_step_s", -1.0), ("chain_position_s", float("nan")), ("verify_step_s", 1e9)]
)
def test_an_answer_with_a_malformed_step_cost_is_unusable(field, value):
    sched = BatchScheduler(MTP_QWEN, speculative_method="mtp", speculative_tokens=K)
    sched.add(1, b"t", 1, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 50)
    batch = sched.schedule()
    outcome = sched.complete(msgspec.structs.replace(answer(batch), **{field: value}))
    assert outcome.failed and field in str(outcome.failed[0][1])
    assert sched.draft_length.decode_step_s is None


def test_rows_that_share_a_chain_draft_together_where_none_would_alone():
    """Eight rows whose drafts are kept 80 % of the time, Qwen's chain, a step measured at 5 ms and a chain
    position at 0.5 ms: any one row alone would bear the eager step and the whole chain against an eighth of a step,
    and declines; agreeing to pay them together (`shared_paid`), every row drafts and the step yields more tokens a
    second than plainly. Rows whose drafts are never kept do not join, and at acceptance 0 nothing is shared."""
    ctl = mtp(MTP_QWEN)
    ctl.note_step_costs(5e-3, 5e-4)
    rows = 8
    assert ctl.best(0.8, rows, rows, K) == 0
    d = ctl.shared_paid([0.8] * rows, rows, rows, K)
    k = ctl.best(0.8, rows, rows, K, d)
    assert d > 0 and k > 0
    assert ctl.step_rate({0.8: rows}, {0.8: k}, rows, rows) > 1.2 * ctl.step_rate({0.8: rows}, {0.8: 0}, rows, rows)
    mixed = [0.8] * 4 + [0.0] * 4
    d = ctl.shared_paid(mixed, rows, rows, K)
    assert [ctl.best(a, rows, rows, K, d) > 0 for a in mixed] == [True] * 4 + [False] * 4
    assert ctl.shared_paid([0.0] * rows, rows, rows, K) == 0
    ngram = DraftLength(K, ExpertPrices.of(RESIDENT))  # ngram's shared part is the eager step
    assert ngram.best(0.7, rows, rows, K) == 0 < ngram.shared_paid([0.7] * rows, rows, rows, K)


def mtp_answer(batch, accepted: int) -> StepOutput:
    """`answer`, up to `accepted` of each drafting row's drafts kept, with the MTP chains the rows asked for (token 7
    each)."""
    out = answer(batch)
    if batch.draft_lens is not None:
        kept = np.minimum(batch.draft_lens[batch.sample], accepted).astype(np.int32)
        out = msgspec.structs.replace(out, accepted_drafts=kept)
    if batch.mtp_drafts is None:
        return out
    asked = batch.mtp_drafts[batch.sample]
    chains = np.full((len(asked), int(asked.max())), -1, np.int32)
    for i, k in enumerate(asked):
        chains[i, :k] = 7
    return msgspec.structs.replace(out, mtp_drafts=chains)


def test_the_rows_of_a_wide_step_draft_together_and_no_chain_is_asked_in_vain():
    """Eight requests whose MTP drafts are mostly kept, run as the service runs the scheduler (steps ahead of the
    answers where it may): each alone would not draft (Qwen's chain against an eighth of a measured step), together
    they do: chains are asked for, as many as the next step's logits rows leave room for, and sent as drafts. A
    step sent ahead asks for no chain the full policy would not turn into drafts: going ahead and the shared price
    agree (else the chains are made and thrown away)."""
    wide = msgspec.structs.replace(MTP_QWEN, max_running_requests=16)  # room for eight rows' drafts
    sched = BatchScheduler(wide, speculative_method="mtp", speculative_tokens=K)
    for rid in range(1, 9):
        sched.add(rid, b"t", rid, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 200)
    sched.complete(mtp_answer(sched.schedule(), 0))  # the prompts
    ctl = sched.draft_length
    ctl.note_step_costs(5e-3, 5e-4)
    for rid in range(1, 9):
        for _ in range(10):
            ctl.observe(rid, K, 3)  # three of four kept
    assert ctl.expected(1, 8, 8, K) == 0  # alone, no
    in_flight: deque = deque()
    asked = sent = 0
    for _ in range(40):
        if not sched.step_in_flight:
            in_flight.append(batch := sched.schedule())
            sent += 0 if batch.draft_lens is None else int(batch.draft_lens.sum())
        while (batch := sched.schedule_ahead()) is not None:
            assert batch.mtp_drafts is None  # nothing asked ahead: its chain could not be drafts
            in_flight.append(batch)
        batch = in_flight.popleft()
        asked += 0 if batch.mtp_drafts is None else int(batch.mtp_drafts.sum())
        sched.complete(mtp_answer(batch, 3))
    assert asked > 0 and sent > 0.7 * asked  # the chains asked for went out as drafts


def test_a_step_whose_rows_would_draft_together_is_not_sent_ahead():
    """A decode step without drafts whose rows would draft together (not alone): the next step waits for its
    answer, whose chains become its drafts, rather than going ahead (judged row by row) and asking for chains
    no row can carry."""
    wide = msgspec.structs.replace(MTP_QWEN, max_running_requests=16)
    sched = BatchScheduler(wide, speculative_method="mtp", speculative_tokens=K)
    for rid in range(1, 9):
        sched.add(rid, b"t", rid, np.arange(10, 18, dtype=np.int32), SamplingParams(temperature=0), 200)
    sched.complete(answer(sched.schedule()))  # the prompts, answered without chains: no drafts to carry yet
    ctl = sched.draft_length
    ctl.note_step_costs(5e-3, 5e-4)
    for rid in range(1, 9):
        for _ in range(10):
            ctl.observe(rid, K, 3)
    batch = sched.schedule()
    assert batch.draft_lens is None and batch.mtp_drafts is not None  # it asks for chains together
    assert sched.schedule_ahead() is None


def test_a_steps_rate_charges_what_the_rows_charge_one_after_another():
    """step_rate's cost (the shared part once, each row's own part) is what `extra_s` charges rows in step order,
    each with the most drafts a row before it carries, whatever the order."""
    ctl = mtp(MTP_QWEN)
    counts, ks = {0.9: 1, 0.6: 2, 0.3: 1}, {0.9: 3, 0.6: 1, 0.3: 2}
    rows = 6
    tokens = rows + 0.9 + 0.9**2 + 0.9**3 + 2 * 0.6 + 0.3 + 0.3**2
    for order in ([0.9, 0.6, 0.6, 0.3], [0.3, 0.6, 0.9, 0.6]):
        cost, paid = ctl.step_s(rows), 0
        for a in order:
            cost += ctl.extra_s(rows, ks[a], paid)
            paid = max(paid, ks[a])
        assert ctl.step_rate(counts, ks, rows, rows) == pytest.approx(tokens / cost)
