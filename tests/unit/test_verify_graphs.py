"""Speculative verify steps and the MTP chain through their graphs (services/worker/verify_graphs.py,
mtp_chain_graphs.py), checked on the CPU, where each replay runs the graph's body eagerly on its padded inputs:

* which steps a verify graph takes (rows all one length, every row sampling, none fed or starting) and the shapes;
* a verify graph's padding rows (n tokens each) touch only the sentinel page and the padding slot, and its real
  rows' logits are the eager step's;
* greedy speculation with the verify steps replayed gives speculation off's tokens, rows that kept every draft,
  some and none among them (a hybrid's rows after a refusal, its kept drafts computed again, replayed too);
* the MTP head's drafts chained by the chain graphs are the head's over the whole sequence, rows asking different
  numbers of drafts in one chain among them."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from model_harness import PagedRunner, assert_logits_close
from tiny_models import tiny_model

from ferry.services.scheduler import batcher as batcher_module
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.mtp_chain_graphs import chain_shapes
from ferry.services.worker.verify_graphs import VERIFY_MAX_ROWS, VerifyGraphs, verify_shapes
from ferry.shared.speculation import verify_row_tokens
from ferry.shared.step import StepBatch
from tests.unit.test_mtp_drafting import _assert_the_heads_drafts, _chained, cpu_decode_graphs
from tests.unit.test_speculative_decoding import PROMPTS, boot, generate, greedy_requests, knowing_drafter

torch.set_num_threads(1)

K = 4


def _with_speculation_graphs(executor, plan) -> dict[str, list]:
    """Give a CPU executor decode graphs with the verify graphs (and the MTP chain's, with a head) for K drafts;
    returns the shapes each kind replayed, in order."""
    graphs = cpu_decode_graphs(executor, plan, speculative_tokens=K)
    replayed = {"verify": [], "chain": [], "verify_rows": []}
    verify_run = graphs.verify.run

    def counted_verify(step, shape):
        replayed["verify"].append(shape)
        replayed["verify_rows"].append(len(step.req_ids))
        return verify_run(step, shape)

    graphs.verify.run = counted_verify
    if graphs.chains is not None:
        chain_run = graphs.chains.run

        def counted_chain(shape, *args):
            replayed["chain"].append((shape, len(args[2])))
            return chain_run(shape, *args)

        graphs.chains.run = counted_chain
    executor.graphs = graphs
    return replayed


def _verify_step(query_lens, draft_lens, sample=None, feed=False) -> StepBatch:
    r = len(query_lens)
    return StepBatch(
        step_id=1,
        req_ids=np.arange(r, dtype=np.int64),
        tokens=np.ones(int(sum(query_lens)), np.int32),
        query_lens=np.array(query_lens, np.int32),
        context_lens=np.full(r, 5, np.int32),
        page_table=np.ones((r, 2), np.int32),
        linear_state_slots=np.arange(1, r + 1, dtype=np.int32),
        reset_linear_state=np.zeros(r, bool),
        sample=np.ones(r, bool) if sample is None else np.array(sample),
        draft_lens=np.array(draft_lens, np.int32),
    )


def test_the_shapes_and_which_verify_steps_a_graph_takes():
    assert verify_shapes([1, 2, 4, 8], 2) == [(1, 2), (2, 2), (4, 2), (1, 3), (2, 3), (1, 4), (2, 4)]
    assert all(rows <= VERIFY_MAX_ROWS and rows * n <= 8 for rows, n in verify_shapes([1, 2, 4, 8], 4))
    assert max(n for _, n in verify_shapes([1, 64], 16)) == 17  # what the decode kernels take as a row
    # the scheduler's bound on a drafting row's tokens is the longest verify graph's rows
    for k in range(1, 17):
        assert verify_row_tokens(k) == max(n for _, n in verify_shapes([1, 2, 4, 8, 64], k))
    assert verify_shapes([], 4) == [] and chain_shapes([1, 2, 16], 2) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    g = VerifyGraphs(None, None, 16, 4, verify_shapes([1, 2, 4, 16], 3), "cpu", 32, 8)
    g.graphs = {shape: object() for shape in g.shapes}  # as if captured
    assert g.shape_for(_verify_step([3, 3, 3], [2, 2, 2]), None) == (4, 3)
    assert g.shape_for(_verify_step([4], [1]), None) == (1, 4)  # a hybrid's kept draft again, its token, a draft
    assert g.shape_for(_verify_step([3, 3], [2, 1]), np.array([-1, -1])) == (2, 3)
    assert g.shape_for(_verify_step([3, 2], [2, 1]), None) is None  # rows of two lengths
    assert g.shape_for(_verify_step([3, 3], [2, 2]), np.array([-1, 0])) is None  # a row fed from the step before
    assert g.shape_for(_verify_step([3, 3], [2, 0], sample=[True, False]), None) is None  # a chunk that does not sample
    assert g.shape_for(_verify_step([3] * 5, [2] * 5), None) is None  # more rows than the graphs hold
    assert g.shape_for(_verify_step([7], [6]), None) is None  # longer than any graph's rows


@pytest.mark.parametrize("arch,page_size", [("qwen3_moe", 4), ("qwen3_5_moe", 16)])
def test_a_verify_graphs_padding_rows_touch_only_the_sentinel_page_and_padding_slot(arch, page_size):
    """A verify step of two rows of 3 tokens in a graph of 4 rows (two rows of padding, 3 tokens each), over pools
    poisoned with NaN: the real rows' logits are the eager step's, and nothing but the sentinel page and the
    padding slot was written besides what the requests own."""
    hf, spec = tiny_model(arch, seed=13)
    clean = PagedRunner(spec, hf, page_size, num_pages=40, num_slots=6)
    padded = PagedRunner(spec, hf, page_size, num_pages=40, num_slots=6)
    padded.poison()
    prefill = [(1, [4, 8, 15, 16, 23]), (2, [42, 7])]
    verify = [(1, [7, 3, 9]), (2, [9, 9, 2])]
    for runner in (clean, padded):
        runner.step(prefill, all_rows=False)
    step = clean.step_batch(verify)
    drafting = msgspec.structs.replace(step, draft_lens=np.array([2, 2], np.int32))
    want = clean.model.logits(
        clean.model.hidden_states(ForwardBatch.from_step(drafting, page_size, "cpu"), clean.pools)
    )
    graphs = VerifyGraphs(padded.model, padded.pools, page_size, 4, [(4, 3)], "cpu", spec.vocab_size, spec.hidden_size)
    graphs.capture(None)
    step = padded.step_batch(verify)
    with torch.inference_mode():
        got, hidden, tokens = graphs.run(msgspec.structs.replace(step, draft_lens=np.array([2, 2], np.int32)), (4, 3))
    assert torch.isfinite(got).all() and got.shape == want.shape == (6, spec.vocab_size)
    assert_logits_close(got, want, rel=1e-5)
    assert hidden.shape[0] == 6 and tokens.tolist() == [7, 3, 9, 9, 9, 2]
    padded.assert_poisoned_past_padding()


def _one_at_a_time(executor, plan, method: str = "off", **options):
    """Each greedy request alone (a single stream: every verify step one row, as a graph takes it): its tokens, and
    the schedulers' drafted and kept drafts summed."""
    out, drafted, kept = [], 0, 0
    for request in greedy_requests():
        (result,), sched = generate(executor, plan, [request], method, k=K, **options)
        out.append(result)
        drafted += sched.drafted_tokens
        kept += sched.accepted_drafts
    return out, drafted, kept


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_greedy_speculation_through_verify_graphs_gives_the_tokens_of_speculation_off(arch, tiny_models, monkeypatch):
    executor, plan = boot(tiny_models[arch])
    base, _, _ = _one_at_a_time(executor, plan)
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    replayed = _with_speculation_graphs(executor, plan)
    monkeypatch.setattr(batcher_module, "propose_ngram", knowing_drafter(reference, executor.spec.vocab_size))
    on, drafted, kept = _one_at_a_time(executor, plan, "ngram")
    assert on == base
    assert 0 < kept < drafted
    assert len(replayed["verify"]) > 10
    if arch == "qwen3_5_moe":  # rows after a refusal: the kept drafts computed again, more than K + 1 tokens
        assert any(n > K + 1 for _, n in replayed["verify"])


def test_mtp_drafts_chained_in_graphs_are_the_heads(mtp_model, monkeypatch):
    """Rows that kept every draft, some and none (the bench oracle's way: the head's tokens replaced while it runs),
    the drafts chained by the chain graphs (rows asking different numbers in one chain) and the steps verified
    by the verify graphs: the chains are the head's over the whole sequence, and the tokens speculation off's."""
    executor, plan = boot(mtp_model, "--speculative-method", "mtp")
    base, _ = generate(executor, plan, greedy_requests())
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    knowing = knowing_drafter(reference, executor.spec.vocab_size)
    replayed = _with_speculation_graphs(executor, plan)
    # together: chains of several rows (padded to a bucket), each asking its own number of drafts
    on, sched, unique = _chained(executor, plan, greedy_requests(), lambda req, k: knowing(req.tokens, k), monkeypatch)
    assert on == base and 0 < sched.accepted_drafts < sched.drafted_tokens
    assert any(rows > real for (rows, _), real in replayed["chain"])  # padding rows in a chain
    # one at a time: every verify step one row, replayed
    for request in greedy_requests():
        (result,), _, alone = _chained(executor, plan, [request], lambda req, k: knowing(req.tokens, k), monkeypatch)
        assert result == base[PROMPTS.index(request[0])]
        unique |= alone
    assert len(replayed["chain"]) > 10 and len(replayed["verify"]) > 10
    assert len(unique) >= 10 and max(map(len, unique.values())) >= 2
    _assert_the_heads_drafts(executor, plan, mtp_model, unique)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "glm4_moe"])
def mtp_model(tmp_path_factory, request):
    from ferry.services.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp") / request.param, request.param, seed=0, mtp=True)
