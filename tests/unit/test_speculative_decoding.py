"""Speculative decoding (--speculative-method ngram): the real scheduler and the real worker's executor in one
process on CPU, float32, against speculation off.

* Greedy: the same tokens and finish reasons, token for token, on the attention-only model and both hybrids,
  experts resident and offloaded, and on gpt-oss's and Gemma 4's sliding rings, with drafts that are kept
  whole, in part and not at all (a drafter that knows the answer and spoils one draft in turn), and with
  prompt lookup's own drafts. A rollback one position off (the scheduler's count of computed tokens, a
  hybrid's linear state not put back) fails it; so does a page kept past the tokens.
* The worker's answer is held to the drafts sent: a count that is missing or too large fails that request.
* Sampling: the verify rule keeps the target distribution (a chi-square test over many draws, of the first
  token a row produces and of the next one given that the first draft was kept), on made-up logits and on the
  tiny model's own; a bias planted in the acceptance rule fails it.
* Requests that cannot speculate (penalties, logprobs, a seed) decode without drafts, as before.
* The flags are checked, naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services import serve_command
from ferry.services.make_tiny_model import make_tiny_model
from ferry.services.scheduler import batcher as batcher_module
from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.scheduler.config import scheduler_config_from_args
from ferry.services.scheduler.draft_length import PROBE_EVERY, DraftLength
from ferry.services.scheduler.ngram_proposer import TokenArray, propose_ngram
from ferry.services.serve_command import child_commands
from ferry.services.worker import executor as executor_module
from ferry.services.worker import speculative_verify
from ferry.services.worker.boot import boot_worker, graphed_drafts
from ferry.services.worker.executor import StepBatchError, StepExecutor
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.models import build_model
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import allocate_pools
from ferry.services.worker.sampler import RequestSamplingState
from ferry.services.worker.service import pool_report_from_plan
from ferry.shared.errors import ConfigError
from ferry.shared.sampling import SamplingParams
from ferry.shared.speculation import computed_after_verify, speculates, verify_row_tokens
from ferry.shared.step import NewRequest, StepBatch
from ferry.shared.units import MiB
from tests.unit.test_cli_flags import parse
from tests.unit.tiny_models import tiny_model

# tiny models gain nothing from intra-op threads, and on a loaded machine OpenMP's spin waits slow each step
torch.set_num_threads(1)

K = 4
GREEDY = SamplingParams(temperature=0)
PROMPTS = (
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
    [9, 10, 11, 12, 13],
)
MAX_TOKENS = (26, 19, 21)


@pytest.fixture(scope="module")
def more_models(tmp_path_factory):
    """{arch: tiny checkpoint}, made when first asked, of the families the session's tiny models (qwen3_moe,
    qwen3_5_moe) leave out: Qwen3-Next, and gpt-oss and Gemma 4, whose sliding layers keep their K/V in rings."""
    root, made = tmp_path_factory.mktemp("tiny-more"), {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_tiny_model(root / arch, arch, seed=0)
        return made[arch]

    return get


def boot(model_dir, *extra: str):
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    args = [
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--gpu-memory",
        "64MiB",
        "--max-running-requests",
        "64",
        "--max-prefill-tokens",
        "256",
        *extra,
    ]
    return boot_worker(boot_config_from_args(parser.parse_args(args)))


def generate(executor, plan, requests, method="off", k=K, prefix_cache=True, drafter=None):
    """[(tokens, finish reason)] of `requests` ([(prompt, sampling, max_tokens)]) submitted together, and the
    scheduler: schedule, execute, complete, as the served processes do. The sampled tokens' logprobs, for
    requests that ask, are kept in `generate.logprobs` ({rid: [Logprobs]}). `drafter`: BatchScheduler's."""
    sched = BatchScheduler(
        pool_report_from_plan(plan, executor.spec.vocab_size),
        prefix_cache=prefix_cache,
        speculative_method=method,
        speculative_tokens=k,
        drafter=drafter,
    )
    reqs = [
        sched.add(rid, b"t", rid, np.array(p, np.int32), sampling, n)
        for rid, (p, sampling, n) in enumerate(requests, start=1)
    ]
    got = {r.rid: [] for r in reqs}
    reasons = {}
    generate.logprobs = {r.rid: [] for r in reqs}
    while (batch := sched.schedule()) is not None:
        drafts = 0 if batch.draft_lens is None else int(batch.draft_lens.sum())
        # the step's logits rows stay within the sampling logits the plan's workspace holds
        assert int(batch.sample.sum()) + drafts <= plan.max_running_requests
        out = sched.complete(executor.execute(batch))
        assert not out.failed, out.failed
        for r in sched.running:  # pages that held only refused drafts went back
            assert len(r.pages) <= -(-len(r.tokens) // plan.kv.page_size)
        for r, t in out.tokens:
            got[r.rid].append(t)
        for r, lp in out.logprobs:
            generate.logprobs[r.rid].append(lp)
        for r, why in out.finished:
            reasons[r.rid] = why
    assert not (sched.running or sched.waiting)
    assert sched.kv.available == sched.kv.total  # every page back (cached ones are evictable)
    for snaps in (sched.snapshots, sched.holds):  # every snapshot that held a row's state is free again
        assert snaps.free_count + snaps.held == snaps.total
    return [(got[r.rid], reasons[r.rid]) for r in reqs], sched


def knowing_drafter(reference: dict[tuple, list[int]], vocab: int):
    """A drafter that knows each prompt's greedy continuation and spoils one of its drafts in turn (none, the
    first, ..., past the last): rows keep every draft, some or none."""
    calls = []

    def propose(tokens, k):
        for prompt, ref in reference.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                at = len(tokens) - len(prompt)
                drafts = list(ref[at : at + k])
                spoil = len(calls) % (k + 2) - 1
                calls.append(prompt)
                if 0 <= spoil < len(drafts):
                    drafts[spoil] = (drafts[spoil] + 1) % vocab
                return drafts
        raise AssertionError(f"a draft asked for an unknown request: {tokens}")

    propose.calls = calls
    return propose


def greedy_requests(stop_in: int | None = None, reference=None):
    """The prompts, greedy; with `stop_in`, the third request also stops on the `stop_in`-th token of its
    reference (mid-row, where a verify keeps drafts past it)."""
    out = []
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        sampling = GREEDY
        if stop_in is not None and i == 2:
            sampling = SamplingParams(temperature=0, stop_token_ids=(reference[tuple(p)][stop_in],))
        out.append((p, sampling, n))
    return out


def first_new_token(tokens: list[int], at_least: int) -> int:
    """The first index from `at_least` on whose token did not come before it (a stop there stops there)."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


def _check_greedy_equal(executor, plan, monkeypatch):
    base, _ = generate(executor, plan, greedy_requests())
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    stop_in = first_new_token(reference[tuple(PROMPTS[2])], 5)
    requests = greedy_requests(stop_in=stop_in, reference=reference)
    off, _ = generate(executor, plan, requests)
    assert off[2][1] == "stop" and len(off[2][0]) == stop_in + 1
    drafter = knowing_drafter(reference, executor.spec.vocab_size)
    monkeypatch.setattr(batcher_module, "propose_ngram", drafter)
    on, sched = generate(executor, plan, requests, "ngram")
    assert on == off
    assert sched.draft_rows > 10 and 0 < sched.accepted_drafts < sched.drafted_tokens
    return requests, off


@pytest.mark.parametrize(
    "arch, offloaded",
    [
        *((arch, offloaded) for arch in ("qwen3_moe", "qwen3_5_moe", "qwen3_next") for offloaded in (False, True)),
        # sliding layers' rings: a refused draft's K/V overwrote nothing a later row needs
        ("gpt_oss", False),
        ("gemma4", False),
    ],
)
def test_greedy_speculation_gives_the_tokens_of_decoding_one_at_a_time(
    arch, offloaded, tiny_models, more_models, monkeypatch
):
    model_dir = tiny_models[arch] if arch in tiny_models else more_models(arch)
    executor, plan = boot(model_dir, *(["--moe-cache-size", "8"] if offloaded else []))
    assert (plan.experts.slots < plan.experts.total) == offloaded
    if arch in ("gpt_oss", "gemma4"):
        assert pool_report_from_plan(plan, executor.spec.vocab_size).kv_ring_slots > 0
    _check_greedy_equal(executor, plan, monkeypatch)


def test_hybrid_without_snapshots_decodes_without_drafts(tiny_models, monkeypatch):
    """A hybrid model holds a drafting row's state in a snapshot of the planned pool: with none
    (--linear-state-snapshots 0) its rows get no drafts, and decode as before."""
    executor, plan = boot(tiny_models["qwen3_5_moe"], "--linear-state-snapshots", "0")
    requests = greedy_requests()
    off, _ = generate(executor, plan, requests)
    monkeypatch.setattr(batcher_module, "propose_ngram", lambda tokens, k: [1] * k)
    on, sched = generate(executor, plan, requests, "ngram")
    assert on == off and sched.drafted_tokens == 0


def test_hybrid_without_prefix_cache_holds_states_in_the_snapshot_pool(tiny_models, monkeypatch):
    """--no-prefix-cache leaves the worker's snapshot pool to speculation (serve keeps it when speculating)."""
    executor, plan = boot(tiny_models["qwen3_5_moe"])
    base, _ = generate(executor, plan, greedy_requests(), prefix_cache=False)
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    monkeypatch.setattr(batcher_module, "propose_ngram", knowing_drafter(reference, executor.spec.vocab_size))
    on, sched = generate(executor, plan, greedy_requests(), "ngram", prefix_cache=False)
    assert on == base and sched.snapshots.total == 0 < sched.accepted_drafts < sched.drafted_tokens
    for extra, zeroed in (((), True), (("--speculative-method", "ngram"), False)):
        worker = child_commands(parse("serve", "/models/m", "--no-prefix-cache", *extra), "/models/m", Path("/x"))
        assert ("--linear-state-snapshots" in worker["worker"]) == zeroed


def test_few_running_requests_leave_drafts_little_room(tiny_models, monkeypatch):
    """With --max-running-requests 4 and three requests decoding, a step has room for one draft (generate holds
    every step to it), and the tokens are still those of decoding one at a time."""
    executor, plan = boot(tiny_models["qwen3_moe"], "--max-running-requests", "4")
    base, _ = generate(executor, plan, greedy_requests())
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    monkeypatch.setattr(batcher_module, "propose_ngram", knowing_drafter(reference, executor.spec.vocab_size))
    on, sched = generate(executor, plan, greedy_requests(), "ngram")
    assert on == base and sched.drafted_tokens > 0


def test_sampled_requests_speculate_to_their_end(tiny_models, monkeypatch):
    """Unseeded sampled requests (T=1, and T=0.7 with top-k and top-p) take drafts, keep some and refuse some,
    and end at their max_tokens with tokens of the vocabulary (their distribution: the tests below)."""
    executor, plan = boot(tiny_models["qwen3_5_moe"])
    base, _ = generate(executor, plan, greedy_requests())
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    monkeypatch.setattr(batcher_module, "propose_ngram", knowing_drafter(reference, executor.spec.vocab_size))
    sampled = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9), GREEDY]
    requests = [(p, sampling, n) for p, sampling, n in zip(PROMPTS, sampled, MAX_TOKENS)]
    on, sched = generate(executor, plan, requests, "ngram")
    assert [len(t) for t, _ in on] == list(MAX_TOKENS) and all(why == "length" for _, why in on)
    assert all(0 <= t < executor.spec.vocab_size for toks, _ in on for t in toks)
    assert on[2][0] == base[2][0]  # the greedy one beside them: its tokens
    assert 0 < sched.accepted_drafts < sched.drafted_tokens


def test_prompt_lookup_drafts_keep_greedy_tokens(tiny_models):
    """The real drafter on the attention-only tiny model, whose greedy output falls into loops: drafts are
    kept, and the tokens are those of decoding one at a time, in fewer steps."""
    executor, plan = boot(tiny_models["qwen3_moe"])
    requests = greedy_requests()
    off, _ = generate(executor, plan, requests)
    on, sched = generate(executor, plan, requests, "ngram")
    assert on == off
    assert sched.accepted_drafts > 10


def test_rollback_one_position_off_changes_the_tokens(tiny_models, monkeypatch):
    """The scheduler counting one computed position too many after a verify (the refused draft's K/V taken
    for the token that replaced it) is caught: the next row would have no token of its own, and the worker
    refuses its step. (One too few is only a position computed twice, the same K/V again.)"""
    executor, plan = boot(tiny_models["qwen3_moe"])
    requests, off = _check_greedy_equal(executor, plan, monkeypatch)

    def one_past(context, query_len, drafts, accepted, hybrid):
        return computed_after_verify(context, query_len, drafts, accepted, hybrid) + (accepted < drafts)

    monkeypatch.setattr(batcher_module, "computed_after_verify", one_past)
    with pytest.raises(StepBatchError, match="draft_lens|query_lens"):
        generate(executor, plan, requests, "ngram")  # the refused draft's position taken as the new token's


@pytest.mark.parametrize("plant", ["state_kept", "count_kept"])
def test_hybrid_rollback_planted_faults_change_the_tokens(tiny_models, monkeypatch, plant):
    """A hybrid's refused drafts must leave no trace in its linear state: the worker not putting the state
    back, or the scheduler counting the kept positions as computed (the state holds the refused ones too),
    is caught."""
    executor, plan = boot(tiny_models["qwen3_5_moe"])
    requests, off = _check_greedy_equal(executor, plan, monkeypatch)
    if plant == "state_kept":
        monkeypatch.setattr(executor_module.StepExecutor, "_put_back_linear_states", lambda *a: None)
    else:
        monkeypatch.setattr(
            batcher_module,
            "computed_after_verify",
            lambda c, q, d, a, hybrid: computed_after_verify(c, q, d, a, False),
        )
    on, _ = generate(executor, plan, requests, "ngram")
    assert on != off


def test_requests_that_cannot_speculate_decode_as_before(tiny_models, monkeypatch):
    """Penalties, logprobs and a seed: no drafts for them (the drafter is never asked), and their tokens
    (and logprobs) are those without speculation, beside a greedy request that speculates."""
    executor, plan = boot(tiny_models["qwen3_moe"])
    loop = [1, 2, 3, 1, 2, 3, 1, 2]
    requests = [
        (loop, SamplingParams(temperature=0, repetition_penalty=1.3), 12),
        (loop, SamplingParams(temperature=0, logprobs=2), 12),
        (loop, SamplingParams(temperature=0.9, seed=7), 12),
        (loop, SamplingParams(temperature=0.8, top_k=5, seed=3), 12),
        (PROMPTS[0], GREEDY, 20),
    ]
    off, _ = generate(executor, plan, requests)
    off_logprobs = generate.logprobs[2]
    asked = []
    monkeypatch.setattr(batcher_module, "propose_ngram", lambda tokens, k: asked.append(list(tokens)) or [1, 2])
    on, sched = generate(executor, plan, requests, "ngram")
    assert on == off
    assert asked and all(t[: len(PROMPTS[0])] == PROMPTS[0] for t in asked)  # only the greedy request drafts
    assert sched.draft_rows > 0
    on_logprobs = generate.logprobs[2]
    assert [lp.start for lp in on_logprobs] == [lp.start for lp in off_logprobs] == list(range(8, 20))
    for a, b in zip(on_logprobs, off_logprobs):
        assert (a.top_ids == b.top_ids).all()
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=1e-5, atol=1e-6)


# ---- the verify rule's distribution ---------------------------------------------------------------------------


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test of `counts` against `probs`: the p-value (cells of tiny expectation merged into
    one, so every expected count is at least 5)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            counts, expected = counts[:-1], expected[:-1]
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _state(params: SamplingParams) -> RequestSamplingState:
    return RequestSamplingState(params)


def _verify_draws(params: SamplingParams, logits: torch.Tensor, drafts: list[int], n: int, seed: int):
    """n rows of the same position logits and drafts through the verify: (first token a row produces, second
    one or -1) for each."""
    generator = torch.Generator().manual_seed(seed)
    rows = [drafts] * n
    tokens, _, kept = speculative_verify.verify_drafts(
        [_state(params)] * n, logits.repeat(n, 1), rows, generator, logits.shape[1]
    )
    kept = kept.numpy()
    draft_arr = np.array(drafts)
    first = np.where(kept >= 1, draft_arr[0], tokens.numpy())
    second = np.where(kept >= 2, draft_arr[min(1, len(drafts) - 1)], np.where(kept == 1, tokens.numpy(), -1))
    return first, second


def _target(params: SamplingParams, logits: torch.Tensor) -> np.ndarray:
    from ferry.services.worker.sampler import filter_logits, needs_filter

    s = logits / params.temperature
    if needs_filter(params, logits.shape[1]):
        s = filter_logits(s, [params] * len(s))
    return torch.softmax(s, dim=-1).double().numpy()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.95),
]


@pytest.mark.parametrize("params", CASES, ids=["t1", "filtered"])
def test_verify_keeps_the_target_distribution(params, monkeypatch):
    """Made-up logits over 8 tokens at three positions, two drafts (one likely, one not): the first token a row
    produces is distributed as p at the first position, and the second one, where the first draft was kept, as
    p at the second; an acceptance rule biased towards the drafts fails the same test."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    p = _target(params, logits)
    drafts = [int(np.argmax(p[0])), int(np.argsort(p[1])[-3])]
    n = 40_000

    def p_values():
        first, second = _verify_draws(params, logits, drafts, n, seed=1)
        given = second[first == drafts[0]]
        return (
            chi_square_p(np.bincount(first, minlength=8), p[0]),
            chi_square_p(np.bincount(given, minlength=8), p[1]),
        )

    assert min(p_values()) > 1e-3
    monkeypatch.setattr(speculative_verify, "accepts", lambda u, pd: u < pd.sqrt())
    assert p_values()[0] < 1e-6


def memory_executor(arch: str):
    """(executor, plan) over tests/unit/tiny_models.py's model of `arch` (96 tokens, logits of order one: its
    distributions are far from uniform), experts resident, float32."""
    hf, spec = tiny_model(arch, seed=3)
    req = PlanRequest(
        gpu_memory=512 * MiB,
        num_pages=160,
        page_size=16,
        max_running_requests=64,
        max_prefill_tokens=256,
        max_model_len=256,
        dtype="float32",
    )
    plan = make_plan(spec, req, Measured(weights_bytes=0, workspace_bytes=0))
    pools = allocate_pools(spec, plan, "cpu")
    experts = ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
    model = build_model(spec, torch.float32, "cpu", experts)
    model.load_weights(hf.state_dict().items())
    return StepExecutor(model, pools, spec, plan, "cpu"), plan


def test_model_verify_at_t1_matches_decoding_without_drafts(monkeypatch):
    """The tiny model at T=1: rows that share a prompt's K/V and each verify the same two drafts after the same
    token. The first token they produce is distributed as the model's next-token distribution there (its
    logits from a plain step), and the second, where the first draft was kept, as the one after the draft; a
    planted acceptance bias fails it."""
    executor, plan = memory_executor("qwen3_moe")
    ps = plan.kv.page_size
    prompt = [(7 * i + 3) % 50 + 4 for i in range(ps)]  # exactly one page, shared by every row
    vocab = executor.spec.vocab_size
    t1 = SamplingParams(temperature=1.0)
    executor.execute(_step(0, [prompt], [0], [[1]], sample=False))

    def logits_after(tokens):
        step = _step(1, [tokens], [ps], [[1, 2]], sample=True)
        with torch.inference_mode():
            out = executor.model(ForwardBatch.from_step(step, ps, "cpu"), executor.pools)
        return torch.softmax(out[0].double(), dim=-1).numpy()

    x = 11
    p0 = logits_after([x])
    d1 = int(np.argmax(p0))  # kept often enough for the next token's test, refused often too
    p1 = logits_after([x, d1])
    d2 = int(np.argmax(p1))
    rows = 64

    def draws(steps: int, seed: int):
        executor.sampler.generator.manual_seed(seed)
        first, second = [], []
        for s in range(steps):
            rids = list(range(1000, 1000 + rows))
            step = _step(
                10 + s,
                [[x, d1, d2]] * rows,
                [ps] * rows,
                [[1, 2 + i] for i in range(rows)],
                sample=True,
                rids=rids,
                draft_lens=[2] * rows,
                new=[NewRequest(req_id=r, prompt_token_ids=np.array(prompt, np.int32), sampling=t1) for r in rids],
            )
            out = executor.execute(step)
            kept, tok = out.accepted_drafts, out.token_ids
            first += np.where(kept >= 1, d1, tok).tolist()
            second += np.where(kept >= 2, d2, np.where(kept == 1, tok, -1)).tolist()
        return np.array(first), np.array(second)

    first, second = draws(40, seed=5)
    given = second[first == d1]
    assert 0.05 < p0[d1] < 0.95 and len(given) > 100
    assert chi_square_p(np.bincount(first, minlength=vocab), p0) > 1e-3
    assert chi_square_p(np.bincount(given, minlength=vocab), p1) > 1e-3
    monkeypatch.setattr(speculative_verify, "accepts", lambda u, pd: u < pd.sqrt())
    first, _ = draws(10, seed=6)
    assert chi_square_p(np.bincount(first, minlength=vocab), p0) < 1e-6


def _step(step_id, rows, contexts, pages, sample, rids=None, draft_lens=None, new=()):
    rids = rids or list(range(1, len(rows) + 1))
    width = max(len(p) for p in pages)
    table = np.zeros((len(rows), width), np.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = p
    return StepBatch(
        step_id=step_id,
        req_ids=np.array(rids, np.int64),
        tokens=np.array([t for r in rows for t in r], np.int32),
        query_lens=np.array([len(r) for r in rows], np.int32),
        context_lens=np.array(contexts, np.int32),
        page_table=table,
        linear_state_slots=np.zeros(len(rows), np.int32),
        reset_linear_state=np.array([c == 0 for c in contexts], bool),
        sample=np.full(len(rows), sample, bool),
        new_requests=tuple(new),
        draft_lens=None if draft_lens is None else np.array(draft_lens, np.int32),
    )


# ---- drafting, the contract and the flags ----------------------------------------------------------------------


def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    # the 3-gram [2, 3, 4] occurs twice: its latest occurrence's continuation wins over the earlier one
    assert propose_ngram([1, 2, 3, 4, 9, 9, 2, 3, 4, 7, 8, 0, 2, 3, 4], 3) == [7, 8, 0]
    # a longer match wins over a more recent shorter one: [5, 2, 3, 4] occurs once, [2, 3, 4] later
    assert propose_ngram([5, 2, 3, 4, 6, 6, 1, 2, 3, 4, 1, 1, 5, 2, 3, 4], 2) == [6, 6]
    assert propose_ngram([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # fewer than k follow: what there is
    assert propose_ngram([1, 2, 3, 4, 5], 4) == []  # no earlier occurrence of the last two
    assert propose_ngram([1, 2, 1, 2], 0) == []
    assert propose_ngram([3, 3, 3, 3], 2) == [3]  # an occurrence overlapping the suffix counts


def _lookup_by_hand(tokens: list[int], k: int, n_min: int = 2, n_max: int = 4) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for i in range(len(tokens) - n - 1, -1, -1):  # the most recent first, ending before the last token
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_prompt_lookup_matches_a_plain_search_and_its_array_follows_the_tokens():
    rng = np.random.default_rng(0)
    array = TokenArray()
    tokens: list[int] = []
    for _ in range(400):
        tokens.append(int(rng.integers(0, 4)))  # a small alphabet: matches of every length, overlaps too
        k = int(rng.integers(0, 6))
        assert propose_ngram(array.of(tokens), k) == _lookup_by_hand(tokens, k) == propose_ngram(tokens, k)
    assert array.of(tokens).tolist() == tokens


def test_drafts_stay_inside_max_tokens_and_the_pages(tiny_models, monkeypatch):
    """A row never drafts past what the request may still produce (the verify adds one more), and the pages
    grown for refused drafts go back."""
    executor, plan = boot(tiny_models["qwen3_moe"])
    monkeypatch.setattr(batcher_module, "propose_ngram", lambda tokens, k: [1] * k)
    # every row drafts all it may, however few are kept (the controller would stop: draft_length.py)
    monkeypatch.setattr(DraftLength, "best", lambda self, acceptance, rows, step_tokens, limit, eager_paid=False: limit)
    [(tokens, why)], sched = generate(executor, plan, [(PROMPTS[0], GREEDY, 3)], "ngram", k=8)
    assert len(tokens) == 3 and why == "length"
    assert sched.drafted_tokens == 1  # after the first token, two to go: one draft, then none past the end
    # eight drafts a row, mostly refused, over 40 tokens: rows cross page boundaries, and generate checks after
    # every step that no request holds a page past its tokens
    [(tokens, _)], sched = generate(executor, plan, [(PROMPTS[0], GREEDY, 40)], "ngram", k=8)
    assert len(tokens) == 40 and sched.drafted_tokens - sched.accepted_drafts > 100


def test_a_hybrids_rows_after_refusals_stay_within_a_verify_graph(tiny_models, monkeypatch):
    """A hybrid's row after a refusal computes the drafts it kept again (computed_after_verify), so refusals one
    after another lengthen its rows; past the longest verify graph's (speculation.verify_row_tokens) a step would
    run eagerly. Every row drafting all it may, each keeping its first draft and refusing its second: the rows grow
    to that length and no further, and the tokens are still greedy's."""
    executor, plan = boot(tiny_models["qwen3_5_moe"])
    requests = greedy_requests()
    off, _ = generate(executor, plan, requests)
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, off)}

    def second_refused(tokens, k):
        prompt = next(p for p in reference if tuple(tokens[: len(p)]) == p)
        drafts = list(reference[prompt][len(tokens) - len(prompt) :][:k])
        if len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % executor.spec.vocab_size
        return drafts

    monkeypatch.setattr(batcher_module, "propose_ngram", second_refused)
    monkeypatch.setattr(DraftLength, "best", lambda self, acceptance, rows, step_tokens, limit, eager_paid=False: limit)
    rows, execute = [], executor.execute

    def recording(batch):
        if batch.draft_lens is not None:
            rows.extend(batch.query_lens[batch.draft_lens > 0].tolist())
        return execute(batch)

    monkeypatch.setattr(executor, "execute", recording)
    on, sched = generate(executor, plan, requests, "ngram")
    assert on == off
    assert max(rows) == verify_row_tokens(K)
    assert sched.accepted_drafts < sched.drafted_tokens


@pytest.mark.parametrize("accepted", [None, np.array([5, 0], np.int32)], ids=["unsaid", "too_many"])
def test_an_answer_that_misstates_the_drafts_kept_fails_its_request(monkeypatch, accepted):
    """The scheduler holds the worker's answer to its drafting row: no count, or more drafts kept than sent,
    fails the request (never a sequence the KV does not hold), not the step's others."""
    executor, plan = memory_executor("qwen3_moe")
    sched = BatchScheduler(pool_report_from_plan(plan, executor.spec.vocab_size), speculative_method="ngram")
    monkeypatch.setattr(batcher_module, "propose_ngram", lambda tokens, k: [1, 2])
    sched.add(1, b"t", 1, np.array(PROMPTS[0], np.int32), GREEDY, 10)
    sched.add(2, b"t", 2, np.array(PROMPTS[0], np.int32), SamplingParams(temperature=0, seed=1), 10)
    sched.complete(executor.execute(sched.schedule()))  # the prompts
    batch = sched.schedule()
    assert batch.draft_lens.tolist() == [2, 0]  # the seeded one never drafts
    answer = executor.execute(batch)
    out = sched.complete(msgspec.structs.replace(answer, accepted_drafts=accepted))
    assert [r.rid for r, _ in out.failed] == [1] and "drafts" in str(out.failed[0][1])
    assert [r.rid for r, _ in out.tokens] == [2]


def test_contract_refuses_drafts_a_request_cannot_take(tiny_models):
    executor, _ = boot(tiny_models["qwen3_moe"])
    seeded = SamplingParams(temperature=1.0, seed=3)
    new = (NewRequest(req_id=1, prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=seeded),)
    step = _step(1, [[1, 2, 3]], [0], [[1]], sample=True, draft_lens=[1], new=new)
    with pytest.raises(StepBatchError, match="cannot speculate"):
        executor.execute(step)
    new = (NewRequest(req_id=1, prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=GREEDY),)
    with pytest.raises(StepBatchError, match="fewer than its tokens"):
        executor.execute(_step(2, [[1, 2, 3]], [0], [[1]], sample=True, draft_lens=[3], new=new))


def test_contract_refuses_a_hybrid_drafting_row_that_holds_no_state(tiny_models):
    """Without a hold snapshot a hybrid's refused drafts could not be taken out of its linear state."""
    executor, _ = boot(tiny_models["qwen3_5_moe"])
    new = (NewRequest(req_id=1, prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=GREEDY),)
    step = msgspec.structs.replace(
        _step(1, [[1, 2, 3]], [0], [[1]], sample=True, draft_lens=[1], new=new), linear_state_slots=np.ones(1, np.int32)
    )
    with pytest.raises(StepBatchError, match="hold_state"):
        executor.execute(step)


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--speculative-method", "eagle"], "--speculative-method"),
        (["--speculative-method", "ngram", "--speculative-tokens", "0"], "--speculative-tokens"),
        (["--speculative-method", "ngram", "--speculative-tokens", "17"], "--speculative-tokens"),
    ],
)
def test_bad_speculation_flags_name_the_flag(flags, flag):
    with pytest.raises(ConfigError, match=flag):
        scheduler_config_from_args(parse("scheduler", *flags))
    with pytest.raises(ConfigError, match=flag):  # serve refuses them before it starts anything
        serve_command.run(parse("serve", "/models/m", *flags))
    with pytest.raises(ConfigError, match=flag):  # and a worker started alone, before it loads anything
        graphed_drafts(boot_config_from_args(parse("worker", "--model", "/models/m", *flags)).plan)


def test_speculation_flags_reach_the_scheduler_from_serve():
    for extra, method, tokens in (
        ((), "off", 4),
        (("--speculative-method", "ngram", "--speculative-tokens", "6"), "ngram", 6),
        (("--speculative-method", "mtp", "--speculative-tokens", "3"), "mtp", 3),
    ):
        commands = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))
        cfg = scheduler_config_from_args(parse("scheduler", *commands["scheduler"][4:]))
        assert (cfg.speculative_method, cfg.speculative_tokens) == (method, tokens)
        # the worker plans and loads the MTP head with the same flag, and captures the verify graphs for K drafts
        worker = boot_config_from_args(parse("worker", *commands["worker"][4:]))
        assert (worker.plan.speculative_method or "off") == method
        assert graphed_drafts(worker.plan) == (0 if method == "off" else tokens)


def test_which_requests_speculate():
    assert speculates(GREEDY) and speculates(SamplingParams(temperature=0.7, top_p=0.9, logit_bias=((3, 1.0),)))
    for refused in (
        SamplingParams(grammar='{"grammars": []}'),  # structured outputs: the matcher reads each token
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(logprobs=0),
        SamplingParams(seed=1),
    ):
        assert not speculates(refused), refused


def test_computed_after_verify():
    # a row of the last token and 4 drafts from position 10, 2 kept: positions 10..12 are real tokens
    assert computed_after_verify(10, 5, 4, 2, hybrid=False) == 13
    assert computed_after_verify(10, 5, 4, 4, hybrid=False) == 15
    assert computed_after_verify(10, 5, 4, 2, hybrid=True) == 10  # the state went back to the row's start
    assert computed_after_verify(10, 5, 4, 4, hybrid=True) == 15


def test_drafts_never_kept_stop_being_sent_and_the_output_stays_the_same(tiny_models, monkeypatch):
    """The draft-length controller (draft_length.py): a request whose drafts are all refused soon decodes
    without them (bar a one-token probe now and then), and its greedy tokens are those of speculation off."""
    executor, plan = boot(tiny_models["qwen3_moe"])
    request = [(PROMPTS[0], GREEDY, 80)]
    [(off, _)], _ = generate(executor, plan, request)
    vocab = executor.spec.vocab_size
    monkeypatch.setattr(batcher_module, "propose_ngram", lambda tokens, k: [(int(tokens[-1]) + 1) % vocab] * k)
    [(on, _)], sched = generate(executor, plan, request, "ngram", k=8)
    assert on == off
    assert sched.accepted_drafts < 3  # the drafts are wrong (a draft equal to the greedy token is kept)
    assert 0 < sched.drafted_tokens <= 3 * 8 + 80 / PROBE_EVERY + 1
    assert sched.draft_length.decisions >= 40 and sched.draft_length.chosen_drafts >= sched.drafted_tokens


def test_the_pool_report_carries_the_expert_pool_the_controller_prices(tiny_models):
    executor, plan = boot(tiny_models["qwen3_moe"])
    spec = executor.spec
    pool = pool_report_from_plan(plan, spec.vocab_size, spec)
    assert pool.moe_layers == len(spec.moe_layer_indices) > 0
    assert pool.experts_top_k == spec.num_experts_per_tok > 0
    assert (pool.expert_slots, pool.expert_total, pool.expert_bytes) == (
        plan.experts.slots,
        plan.experts.total,
        plan.experts.bytes_per_slot,
    )
    assert pool_report_from_plan(plan, spec.vocab_size).moe_layers == 0  # no spec: misses not priced
