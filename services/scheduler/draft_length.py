"""How many drafts a decoding row carries (speculative decoding's draft-length controller): per step and request
a k in [0, K], K = --speculative-tokens, chosen so that speculation does not lose to decoding without it.

The rule. Each request keeps an estimate a of the chance that a draft token is kept given the ones before it
were: a Beta prior (ACCEPT_PRIOR) plus the verified rows, each row of d drafts with a kept counting a successes
and one failure unless a == d (the kept drafts are a prefix), old rows decayed by DECAY so a request that turns
repetitive (or stops) is followed. A row given k drafts then yields E(k) = 1 + a + ... + a^k tokens. Its cost is
its share of a plain decode step, S / B (B rows in the step), plus what the k extra positions add:
k x VERIFY_POSITION_S of compute, DRAFT_STEP_OVERHEAD_S (a step with drafts costs more than a decode graph's replay:
eagerly, or a verify graph's replay and the verify rule after it; "the eager step" below),
and with experts offloaded the expected extra expert misses times one miss's copy (expert bytes / PCIE_BYTES_PER_S);
the eager step is charged once a step, to its first drafting row (or to none: see `shared_paid` below).
A step of n tokens touches E_l (1 - (1 - t/E_l)^n) distinct experts a MoE layer (E_l experts, top-t routing,
uniform), each missed with the cache's miss rate (measured from the worker's hit/miss counts, else 1 - slots /
experts); so the k positions added to a step of n tokens miss
    L x miss_rate x E_l x ((1 - t/E_l)^n - (1 - t/E_l)^(n + k))  experts,  L = MoE layers.
S is the plain step's cost by the same terms (DECODE_STEP_S plus the misses of its n tokens).
With --speculative-method mtp (ChainPrices) drafts are not free to make either: besides the eager step, draft j of
a row is the j-th dependent pass of the MTP head's chain, the MTP layer's dense weights and the target's LM head
(vocabulary x hidden bytes) read at HBM_BYTES_PER_S, plus MTP_CHAIN_STEP_OVERHEAD_S, once a chain position a step
(charged to the first row chaining that far: the rows after it pay only the positions past it), and the row's own
routed experts in the layer. The head's K/V, which every step writes (in the decode graph for a plain step), are a
few dense products a token: part of S, whatever k is.
The chosen k maximises E(k) / (S/B + cost(k)) (tokens a second), k = 0 unless some k beats 1 / (S/B), where what
rows before it in the step paid (the eager step, chain positions) is not charged again; the step's drafting rows
first agree on what they pay together (`shared_paid`: the share that makes the whole step yield most, so that the
first row does not bear alone what all share). At acceptance 0 every k > 0 loses, the estimate falls under the
threshold within a few rows, and the row decodes plainly (scheduled ahead, as without speculation). A new request's
estimate starts from the server's (every request's rows, decayed the same way, weighing as much as the prior): where
the last requests' drafts were refused, a new one does not pay a probe's eager step to find out again. Before any
row was verified, a request not measured yet drafts at least one token at once (within its first PROBE_EVERY
decisions), since the prior alone would keep a row of a wide step from drafting. With k = 0 nothing is observed, so
a request's plain decisions are followed by a one-token probe every PROBE_EVERY of them, or more where a probe costs
more (its priced extra over the row's share of a step kept to PROBE_COST_SHARE of the decode time: with experts
offloaded a probe's misses can cost a whole step), letting a request whose text starts repeating speculate again. A
lookup that finds no drafts (prompt lookup with no n-gram to continue) leaves the request dry: it expects none, so
its rows are scheduled ahead, and it looks again when its probe comes due; looking every step would hold each step
for the answer of the one before.

Measured where the worker measures: a decode graph's replay (StepOutput.decode_step_s, on CUDA) stands for S once
seen, misses and all, an MTP chain's seconds a position (StepOutput.chain_position_s) for a chain position's priced
cost, and a step that verified drafts (StepOutput.verify_step_s: a verify graph's where the worker has them, its
eager steps beside them not timed) over the replay for the eager step's, each the mean of the first measurements
then an EWMA (STEP_COST_WEIGHT): the constants and the bytes are only where nothing is measured yet. The same step
is timed by the scheduler too, from its send to its answer, less its chain's device time (`verify_wall_s`), and the
longer of the two stands for it: a drafting step is never sent ahead, so the host's reads between the verify and the
chain and the answer's round trip are paid in full, which the device's replays leave out (a served trace of the
resident hybrid cut: 7.6 ms a drafting step's wall against ~4 ms of replays).
No torch, no clock: the prices are the plan's (PoolReport, with mtp its chain's bytes), the constants below and the
measurements; the scheduler feeds the outcomes (`observe`), the worker's expert counts (`note_expert_lookups`) and
the steps' device and wall times (`note_step_costs`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ferry.shared.messages import PoolReport

# Beta(successes, failures) prior of a request's per-draft acceptance: a mean of 0.7 weighing two rows (prompt
# lookup drafts only where an n-gram matched, which in repetitive text mostly continues), so a request starts at K
# and one that never agrees falls under the resident threshold (~0.25) after three refused rows. The same for mtp:
# an MTP head drafts at every position, but trained for it its first draft is kept about as often (DeepSeek-V3
# reports 85-90 % for its one MTP token, a chain's later drafts less), and the prior only decides the first rows
# (an unmeasured request drafts at once either way): no measurement on Ferry's models sets it apart yet
ACCEPT_PRIOR = (1.4, 0.6)
# the weight a past row keeps at each new one: the estimate follows the last ~10 rows
DECAY = 0.9
# a request decoding without drafts drafts one token at most every this many decisions (its acceptance is
# re-measured), and no more often than keeps the probes' priced cost to PROBE_COST_SHARE of its decode time: with
# the first refused rows, under the 3 % speculation may lose at acceptance 0
PROBE_EVERY = 16
PROBE_COST_SHARE = 0.02
# a plain decode step with every expert resident (a CUDA graph over the layers; batcher.py: ~1.0 ms), seconds
DECODE_STEP_S = 1.0e-3
# one more position in a verify row: a short prefill's compute per token, seconds
VERIFY_POSITION_S = 5.0e-5
# what a step with drafts costs beyond a decode graph's replay (run eagerly, or a verify graph's replay and the verify
# rule after it: an estimate until the worker has measured a verify step and a replay, `eager_overhead_s`), charged
# once a step, to its first drafting row
DRAFT_STEP_OVERHEAD_S = 2.0e-4
# HBM read rate of an MTP chain step's weights, bytes/s (an estimate: ~90 % of a 3.35 TB/s HBM3 peak, what a
# streaming read reaches)
HBM_BYTES_PER_S = 3.0e12
# one MTP chain step's cost besides its bytes: its eager launches (the head's layer, the LM head, the argmax) and
# the host building its slots' batch, seconds (an estimate, as DRAFT_STEP_OVERHEAD_S)
MTP_CHAIN_STEP_OVERHEAD_S = 1.0e-4
# host-to-device copy rate of one missed expert (PCIe 5.0 x16 pinned, bench/bandwidth.py: ~50 GB/s)
PCIE_BYTES_PER_S = 50e9
# the measured miss rate: an EWMA over heartbeats, each new interval's rate weighing this much
MISS_RATE_WEIGHT = 0.3
# what a step's drafting rows may agree to pay together (shared_paid): the eager step and this many chain positions,
# tried in turn (not every depth: the rows' own k fill in between), each row's acceptance taken to ACCEPTANCE_GRAIN
SHARED_DEPTHS = (1, 2, 4, 8, 16)
ACCEPTANCE_GRAIN = 0.05
# the measured step costs (a decode graph's replay, a chain position): an EWMA over the steps that measure them, each
# new one weighing this much (the last ~20: the batch's rows and contexts change slowly)
STEP_COST_WEIGHT = 0.05


@dataclass
class _Acceptance:
    """A request's decayed Beta counts, and its plain decisions since its last draft (for the probe)."""

    kept: float = ACCEPT_PRIOR[0]
    refused: float = ACCEPT_PRIOR[1]
    plain: int = 0
    observed: int = 0  # rows verified
    dry: bool = False  # its last lookup found no drafts: it decodes plainly until its next probe looks again

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.refused)


@dataclass(frozen=True)
class ExpertPrices:
    """What the scheduler knows before a step of the experts' cost: the plan's expert pool (PoolReport)."""

    moe_layers: int = 0  # 0: not reported (no MoE, or an old worker): misses are not priced
    experts_per_layer: int = 0
    top_k: int = 0
    slots: int = 0  # GPU expert slots, all layers
    total: int = 0  # routed experts, all layers
    miss_s: float = 0.0  # one missed expert's copy

    @staticmethod
    def of(pool: PoolReport) -> ExpertPrices:
        if not pool.experts_offloaded or not pool.moe_layers or not pool.experts_top_k or not pool.expert_total:
            return ExpertPrices()
        return ExpertPrices(
            moe_layers=pool.moe_layers,
            experts_per_layer=pool.expert_total // pool.moe_layers,
            top_k=pool.experts_top_k,
            slots=pool.expert_slots,
            total=pool.expert_total,
            miss_s=pool.expert_bytes / PCIE_BYTES_PER_S,
        )

    @property
    def priced(self) -> bool:
        return self.moe_layers > 0 and self.experts_per_layer > 0 and self.miss_s > 0

    def distinct(self, tokens: int) -> float:
        """Expected distinct experts `tokens` tokens route to in one MoE layer (uniform top-k routing)."""
        e = self.experts_per_layer
        return e * (1.0 - (1.0 - min(self.top_k, e) / e) ** max(tokens, 0))


@dataclass(frozen=True)
class ChainPrices:
    """--speculative-method mtp: what the MTP head's draft chain costs (services/worker/mtp_drafts.py), from the
    PoolReport's bytes (plan/mtp_layer.py's MtpChainBytes) read at HBM_BYTES_PER_S. Draft j of a row is chain
    position j, one dependent pass: the MTP layer, then the target's LM head over the vocabulary. The weights' read
    and the launch overhead are paid once a position for all the rows chaining to it; a row's own part is its
    token's routed experts in the layer (GPU-resident)."""

    lm_head_s: float = 0.0  # the LM head's weights read once
    layer_s: float = 0.0  # the MTP layer's dense weights read once
    row_s: float = 0.0  # one row's token's routed experts

    @staticmethod
    def of(pool: PoolReport) -> ChainPrices:
        return ChainPrices(
            lm_head_s=pool.mtp_lm_head_bytes / HBM_BYTES_PER_S,
            layer_s=pool.mtp_layer_bytes / HBM_BYTES_PER_S,
            row_s=pool.mtp_row_expert_bytes / HBM_BYTES_PER_S,
        )

    @property
    def position_s(self) -> float:
        """A chain position's priced cost once a step, whatever the rows chaining to it."""
        return MTP_CHAIN_STEP_OVERHEAD_S + self.lm_head_s + self.layer_s

    def drafts_s(self, drafts: int, paid: int, position_s: float | None = None) -> float:
        """A row's `drafts` chained drafts where rows before it in the step chain `paid` positions already: the
        positions past `paid`, and its own experts' read at each; or with `position_s` (a chain position as
        measured, its rows' experts in it) the positions past `paid` at that."""
        if position_s is not None:
            return max(drafts - paid, 0) * position_s
        return max(drafts - paid, 0) * self.position_s + drafts * self.row_s


@dataclass
class DraftLength:
    """The controller: `choose` per drafting row, `observe` per verified row (the module docstring's rule)."""

    max_drafts: int  # K: --speculative-tokens
    prices: ExpertPrices = field(default_factory=ExpertPrices)
    chain: ChainPrices | None = None  # --speculative-method mtp: drafts priced by the MTP chain; None: ngram's
    miss_rate: float | None = None  # measured (note_expert_lookups); None: 1 - slots / experts
    decode_step_s: float | None = None  # a decode graph's replay, measured (note_step_costs); None: not yet
    chain_position_s: float | None = None  # an MTP chain position, measured (note_step_costs); None: not yet
    verify_step_s: float | None = None  # a step that verified drafts, measured (note_step_costs); None: not yet
    # the same step's wall time from the scheduler's send to its answer, its chain's device time left out
    # (note_step_costs); None: not yet
    verify_wall_s: float | None = None
    pinned: int = 0  # > 0: the bench's fixed k (oracle_drafter.py's FERRY_BENCH_PINNED_DRAFTS): `best` gives it
    _requests: dict[int, _Acceptance] = field(default_factory=dict)
    # every request's verified rows, decayed as a request's are: where a new request's estimate starts (`_fresh`)
    _served: _Acceptance = field(default_factory=_Acceptance)
    _lookups: tuple[int, int] | None = None  # the worker's last (hits, misses), cumulative
    _step_costs_seen: dict[str, int] = field(default_factory=dict)  # measurements of each step cost so far
    # metrics, since the scheduler adopted the worker: rows decided, drafts chosen over them, misses the drafts sent
    # were expected to add
    decisions: int = 0
    chosen_drafts: int = 0
    estimated_misses_added: float = 0.0

    def acceptance(self, rid: int) -> float:
        return self._state(rid).rate

    def current_miss_rate(self) -> float:
        if self.miss_rate is not None:
            return self.miss_rate
        p = self.prices
        return 1.0 - p.slots / p.total if p.total else 0.0

    def misses_added(self, step_tokens: int, drafts: int) -> float:
        """Expected expert misses of `drafts` more positions in a step of `step_tokens` tokens."""
        p = self.prices
        if not p.priced or drafts <= 0:
            return 0.0
        extra = p.distinct(step_tokens + drafts) - p.distinct(step_tokens)
        return p.moe_layers * self.current_miss_rate() * extra

    def step_s(self, step_tokens: int) -> float:
        """A plain step's cost: measured (a decode graph's replay), else estimated: its compute and the misses of
        its tokens."""
        if self.decode_step_s is not None:
            return self.decode_step_s
        p = self.prices
        misses = p.moe_layers * self.current_miss_rate() * p.distinct(step_tokens) if p.priced else 0.0
        return DECODE_STEP_S + misses * p.miss_s

    def best(self, acceptance: float, rows: int, step_tokens: int, limit: int, eager_paid: int = 0) -> int:
        """The k in [0, min(K, limit)] with the most tokens a second for a row of a step of `rows` rows and
        `step_tokens` tokens before its drafts (0 on a tie: drafting must win to be chosen); `eager_paid`: the
        most drafts a row before it in the step carries, or what the step's rows agreed to share (`shared_paid`),
        0 for none. > 0: the eager step is paid; with mtp, the chain positions up to it too."""
        if self.pinned:
            return min(self.pinned, self.max_drafts, limit)
        share = self.step_s(step_tokens) / max(rows, 1)
        best_k, best_rate = 0, 1.0 / share
        tokens = 1.0
        for k in range(1, min(self.max_drafts, limit) + 1):
            tokens += acceptance**k
            cost = share + self.extra_s(step_tokens, k, eager_paid)
            if tokens / cost > best_rate * (1 + 1e-9):
                best_k, best_rate = k, tokens / cost
        return best_k

    def extra_s(self, step_tokens: int, drafts: int, eager_paid: int = 0) -> float:
        """What `drafts` positions added to a row of a step of `step_tokens` tokens cost: their compute, the misses
        they add, and making them: the eager step (once a step: not where `eager_paid`), with mtp their chain too
        (ChainPrices: its positions past `eager_paid`, and the row's own part)."""
        making = 0.0 if eager_paid else self.eager_overhead_s(step_tokens)
        if self.chain is not None:
            making += self.chain.drafts_s(drafts, int(eager_paid), self.chain_position_s)
        return drafts * VERIFY_POSITION_S + making + self.misses_added(step_tokens, drafts) * self.prices.miss_s

    def eager_overhead_s(self, step_tokens: int) -> float:
        """What running a step eagerly (it carries drafts) adds to it: a measured verify step, on the device or
        from send to answer, whichever is longer, over the measured decode graph's replay, else
        DRAFT_STEP_OVERHEAD_S."""
        measured = [s for s in (self.verify_step_s, self.verify_wall_s) if s is not None]
        if not measured or self.decode_step_s is None:
            return DRAFT_STEP_OVERHEAD_S
        return max(max(measured) - self.step_s(step_tokens), 0.0)

    def shared_paid(self, acceptances: list[float], rows: int, step_tokens: int, limit: int) -> int:
        """What a step's drafting rows pay together, as `eager_paid`: the d of 0 and SHARED_DEPTHS up to min(K,
        limit) under which, each row then taking its best k with the eager step and d chain positions paid
        (`best`), the step of `rows` rows yields the most tokens a second (`step_rate`); 0 where no d beats the
        rows deciding alone. `acceptances`: the estimates of the rows that may draft, taken to ACCEPTANCE_GRAIN.
        One row alone would bear the eager step and the whole chain, which several rows share: a step of 8 rows
        whose drafts are kept 80 % of the time drafts together where none would alone."""
        if not acceptances:
            return 0
        counts = Counter(round(a / ACCEPTANCE_GRAIN) * ACCEPTANCE_GRAIN for a in acceptances)
        best_d, best_rate = 0, 0.0
        # with ngram only the eager step is shared: every depth past 1 pays the same
        depths = SHARED_DEPTHS if self.chain is not None else SHARED_DEPTHS[:1]
        for d in [0, *(d for d in depths if d <= min(self.max_drafts, limit))]:
            ks = {a: self.best(a, rows, step_tokens, limit, d) for a in counts}
            rate = self.step_rate(counts, ks, rows, step_tokens)
            if rate > best_rate * (1 + 1e-9):
                best_d, best_rate = d, rate
        return best_d

    def step_rate(self, counts: dict[float, int], ks: dict[float, int], rows: int, step_tokens: int) -> float:
        """Expected tokens a second of a step of `rows` rows of which counts[a] rows of acceptance a carry ks[a]
        drafts: the plain step, what the drafting rows share once (the eager step, with mtp the longest chain's
        positions) and each one's own part, as the rows' `extra_s` add up."""
        tokens, cost, longest = float(rows), self.step_s(step_tokens), 0
        for a, n in counts.items():
            k = ks[a]
            if k:
                tokens += n * sum(a**j for j in range(1, k + 1))
                cost += n * self.extra_s(step_tokens, k, k)
                longest = max(longest, k)
        if longest:
            cost += self.extra_s(step_tokens, longest) - self.extra_s(step_tokens, longest, longest)
        return tokens / cost

    def probe_interval(self, rows: int, step_tokens: int, eager_paid: int = 0) -> int:
        """Plain decisions between two one-token probes: PROBE_EVERY, or more where a probe's extra cost over
        PROBE_COST_SHARE of the row's share of a step asks for more."""
        share = self.step_s(step_tokens) / max(rows, 1)
        return max(PROBE_EVERY, math.ceil(self.extra_s(step_tokens, 1, eager_paid) / (PROBE_COST_SHARE * share)))

    def _unmeasured(self, state: _Acceptance) -> bool:
        """A request none of whose rows was verified yet, within its first PROBE_EVERY decisions, while no row of
        any request was: it drafts at least one token at once, to be measured (the prior alone would keep a row of
        a wide step from drafting until its first probe, which a short request never reaches). Once rows were
        verified, a new request starts from what they showed (`_fresh`)."""
        return state.observed == 0 and state.plain < PROBE_EVERY and self._served.observed == 0

    def _fresh(self) -> _Acceptance:
        """A new request's estimate: the server's (`_served`, every request's rows decayed), weighing as much as
        the prior, or the prior itself before any row was verified: one request's first rows should not pay a
        probe's eager step each where the last requests' drafts were refused."""
        served = self._served
        if served.observed == 0:
            return _Acceptance()
        weight = sum(ACCEPT_PRIOR) / (served.kept + served.refused)
        return _Acceptance(kept=served.kept * weight, refused=served.refused * weight)

    def _state(self, rid: int) -> _Acceptance:
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = self._fresh()
        return state

    def choose(self, rid: int, rows: int, step_tokens: int, limit: int, eager_paid: int = 0) -> int:
        """Drafts for request `rid`'s row now (at most `limit`, what the step leaves), counted in the metrics;
        `eager_paid`: the most drafts a row before it in the step carries (`best`)."""
        state = self._state(rid)
        k = self.best(state.rate, rows, step_tokens, limit, eager_paid)
        if self._unmeasured(state):
            k = max(k, min(limit, 1))  # at least a probe's one draft, at once
            state.plain += 1  # back to 0 once drafts are sent: the count of decisions that sent none
        elif k == 0 and limit >= 1:
            state.plain += 1
            if state.plain >= self.probe_interval(rows, step_tokens, eager_paid):
                k = 1
        self.decisions += 1
        self.chosen_drafts += k
        return k

    def expected(self, rid: int, rows: int, step_tokens: int, limit: int, eager_paid: int = 0) -> int:
        """The k `choose` would give request `rid`'s next row (at most `limit`), its state unchanged: what an MTP
        chain is asked to make ahead of that row, since chain positions past the k chosen then are thrown away. A
        request whose last lookup found nothing (`looked`) expects none until its probe comes due."""
        state = self._requests.get(rid) or self._fresh()
        if state.dry:
            return int(limit >= 1 and state.plain + 1 >= self.probe_interval(rows, step_tokens, eager_paid))
        k = self.best(state.rate, rows, step_tokens, limit, eager_paid)
        if self._unmeasured(state):
            return max(k, min(limit, 1))
        if k == 0 and limit >= 1 and state.plain + 1 >= self.probe_interval(rows, step_tokens, eager_paid):
            return 1
        return k

    def would_draft(self, rid: int, rows: int, step_tokens: int, eager_paid: int = 0) -> bool:
        """Whether `choose` would give request `rid`'s next row drafts (a k > 0, or a probe due), unchanged, with
        `eager_paid` paid (what the step's rows agree to share, `shared_paid`): a row that would not may be
        scheduled ahead (batcher.schedule_ahead), as without speculation."""
        return self.expected(rid, rows, step_tokens, self.max_drafts, eager_paid) > 0

    def looked(self, rid: int, found: int | None) -> None:
        """Request `rid`'s row was looked up for drafts before a step: `found` drafts (> 0: `choose` decides it),
        0 none (a plain decision, and it stays dry: scheduled ahead, it looks again only when a probe comes due,
        since a lookup waits for the step before to answer), None nothing to look at (no MTP chain ran after its
        tokens: a plain decision)."""
        state = self._state(rid)
        if found:
            state.dry = False
            return
        if found == 0:  # the lookup was the probe: the next one comes a probe interval on
            state.dry, state.plain = True, 0
        state.plain += 1
        self.decisions += 1

    def plain(self, rid: int) -> None:
        """Request `rid`'s row went without drafts, undecided by `choose` (scheduled ahead): a plain decision."""
        self._state(rid).plain += 1
        self.decisions += 1

    def sent(self, rid: int, step_tokens: int, drafts: int) -> None:
        """A row of `drafts` drafts goes out in a step of `step_tokens` tokens before it: the misses it adds."""
        self.estimated_misses_added += self.misses_added(step_tokens, drafts)
        self._state(rid).plain = 0

    def observe(self, rid: int, drafts: int, kept: int) -> None:
        """A verified row of `drafts` drafts kept `kept` (a prefix): the request's estimate moves."""
        if drafts <= 0:
            return
        for state in (self._state(rid), self._served):
            state.observed += 1
            state.kept = DECAY * state.kept + kept
            state.refused = DECAY * state.refused + (1 if kept < drafts else 0)

    def forget(self, rid: int) -> None:
        self._requests.pop(rid, None)

    def note_step_costs(
        self, decode_step_s: float, chain_position_s: float, verify_step_s: float = 0.0, verify_wall_s: float = 0.0
    ) -> None:
        """A step's device seconds as the worker measured them (0: not measured): its decode graph's replay, its
        MTP chain's a position, its eager forward and verify (a step with drafts); and that step's wall seconds
        from the scheduler's send to its answer, its chain's device time left out (`verify_wall_s`)."""
        for name, seconds in (
            ("decode_step_s", decode_step_s),
            ("chain_position_s", chain_position_s),
            ("verify_step_s", verify_step_s),
            ("verify_wall_s", verify_wall_s),
        ):
            if seconds > 0:
                n = self._step_costs_seen[name] = self._step_costs_seen.get(name, 0) + 1
                # the mean of the first ones, then the EWMA: a first measurement off the rest (a shape's first
                # replay, a step behind a compilation) weighs 1/n, not 1 - STEP_COST_WEIGHT for the next dozen
                w = max(STEP_COST_WEIGHT, 1.0 / n)
                last = getattr(self, name)
                setattr(self, name, seconds if last is None else (1 - w) * last + w * seconds)

    def note_expert_lookups(self, hits: int, misses: int) -> None:
        """The worker's cumulative expert-cache counts (its heartbeat): the miss rate since the last ones."""
        last, self._lookups = self._lookups, (hits, misses)
        if last is None or hits < last[0] or misses < last[1]:  # the first, or a restarted worker's counts
            return
        dh, dm = hits - last[0], misses - last[1]
        if dh + dm <= 0:
            return
        rate = dm / (dh + dm)
        w = MISS_RATE_WEIGHT
        self.miss_rate = rate if self.miss_rate is None else (1 - w) * self.miss_rate + w * rate
