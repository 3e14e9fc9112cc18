"""MTP drafting (--speculative-method mtp, services/worker/mtp_drafts.py): the real scheduler and the real worker's
executor in one process on CPU, float32, on a tiny Qwen3.5 MoE with an MTP layer (`ferry make-tiny-model --mtp`).

* Greedy decoding with the MTP head's drafts gives the tokens of speculation off, and the drafts are the head's:
  the step outputs carry them and rows are sent with them.
* The drafts the worker chains with its cached MTP K/V equal the head's chained greedy drafts computed over the
  whole sequence without a cache, after rows that kept every draft, some and none (a drafter that knows the answer
  replaces the head's tokens, as the bench's oracle does, while the head runs).
* The plan prices the MTP layer's K/V (and `ferry plan` its weights): the pools allocate what was planned.
* A model without an MTP layer is refused, naming the flag."""

from __future__ import annotations

import argparse
import json

import msgspec
import numpy as np
import pytest
import torch

from ferry.plan import plan_command
from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.model_config import load_model_config
from ferry.plan.mtp_layer import MtpChainBytes, mtp_kv_bytes_per_token, mtp_kv_layer, mtp_name, mtp_resident_bytes
from ferry.plan.pool_layout import kv_bytes_per_token
from ferry.services.make_tiny_model import make_tiny_model
from ferry.services.scheduler import batcher as batcher_module
from ferry.services.scheduler import draft_length
from ferry.services.worker.decode_graphs import DecodeGraphs, graph_buckets
from ferry.services.worker.executor import StepBatchError
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.service import pool_report_from_plan
from ferry.shared.errors import ConfigError
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch
from tests.unit.test_speculative_decoding import (
    GREEDY,
    PROMPTS,
    _step,
    boot,
    generate,
    greedy_requests,
    knowing_drafter,
)

torch.set_num_threads(1)  # tiny models gain nothing from intra-op threads

K = 4


@pytest.fixture(scope="module", params=["qwen3_5_moe", "glm4_moe"])
def mtp_model(tmp_path_factory, request):
    """A hybrid with its MTP layer under `mtp.`, and a full-attention model with its NextN layer after the decoder's."""
    return make_tiny_model(tmp_path_factory.mktemp("mtp") / request.param, request.param, seed=0, mtp=True)


@pytest.fixture(scope="module")
def booted(mtp_model):
    return boot(mtp_model, "--speculative-method", "mtp")


def _recording(executor, monkeypatch) -> list:
    """[(batch, output)] of every step the executor runs from now on."""
    steps = []
    execute = executor.execute

    def record(batch):
        out = execute(batch)
        steps.append((batch, out))
        return out

    monkeypatch.setattr(executor, "execute", record)
    return steps


def test_greedy_mtp_drafts_keep_the_tokens_of_speculation_off(booted, monkeypatch):
    executor, plan = booted
    off, _ = generate(executor, plan, greedy_requests())
    steps = _recording(executor, monkeypatch)
    on, sched = generate(executor, plan, greedy_requests(), "mtp", k=K)
    assert on == off
    # the worker chained drafts after the sampling rows (as many as the controller expects to use), and the
    # scheduler sent them as rows' drafts
    chained = [out.mtp_drafts for _, out in steps if out.mtp_drafts is not None]
    assert chained and all(1 <= d.shape[1] <= K and (d >= 0).any() for d in chained)
    assert sched.drafted_tokens > 0
    # every row's drafts are the first of those the head chained for its request in the step before
    last: dict[int, list[int]] = {}
    rows = 0
    for batch, out in steps:
        if batch.draft_lens is not None:
            ends = np.cumsum(batch.query_lens)
            for i in np.flatnonzero(batch.draft_lens):
                d, rid = int(batch.draft_lens[i]), int(batch.req_ids[i])
                assert batch.tokens[ends[i] - d : ends[i]].tolist() == last[rid][:d]
                rows += 1
        if out.mtp_drafts is not None:
            last.update((int(r), [t for t in d if t >= 0]) for r, d in zip(out.req_ids, out.mtp_drafts.tolist()))
    assert rows == sched.draft_rows > 0
    kept = sum(int(out.accepted_drafts.sum()) for _, out in steps if out.accepted_drafts is not None)
    assert kept == sched.accepted_drafts  # the scheduler counts what the verify kept


def _target_hidden(executor, plan, tokens: list[int]) -> torch.Tensor:
    """The target's final-normed hidden states of `tokens`, computed whole from position 0 (one row, one chunk)."""
    n, ps = len(tokens), plan.kv.page_size
    step = StepBatch(
        step_id=1,
        req_ids=np.array([1], np.int64),
        tokens=np.array(tokens, np.int32),
        query_lens=np.array([n], np.int32),
        context_lens=np.zeros(1, np.int32),
        page_table=np.arange(1, -(-n // ps) + 1, dtype=np.int32)[None],
        linear_state_slots=np.ones(1, np.int32),
        reset_linear_state=np.ones(1, bool),
        sample=np.zeros(1, bool),
    )
    with torch.inference_mode():
        return executor.model.hidden_states(ForwardBatch.from_step(step, ps, "cpu"), executor.pools)


def _reference_drafts(head, model, hidden: torch.Tensor, tokens: list[int], k: int, vocab: int = 0) -> list[int]:
    """The head's k chained greedy drafts after `tokens`, over the whole sequence and without a cache: position t's
    input is h_{t-1} and the embedding of token t, a draft's input the head's own output before it and that draft;
    with `vocab`, the argmax of the full logits' first `vocab` ids (--speculative-draft-vocab)."""
    h, ids, drafts = hidden[: len(tokens) - 1], list(tokens[1:]), []
    with torch.inference_mode():
        for _ in range(k):
            out = head(h, model.embed(torch.tensor(ids)), torch.arange(1, len(ids) + 1))
            logits = model.logits(out[-1:])
            drafts.append(int((logits[:, :vocab] if vocab else logits).argmax()))
            h, ids = torch.cat([h, out[-1:]]), ids + [drafts[-1]]
    return drafts


def cpu_decode_graphs(executor, plan, speculative_tokens: int = 0) -> DecodeGraphs:
    """Decode graphs for a CPU executor as boot makes them (off CUDA each replay runs the graph's body eagerly),
    the MTP head's K/V written in them where it has one; with `speculative_tokens` the verify graphs (and with a head
    the chain's) too. Captured, not yet given to the executor."""
    spec = executor.spec
    graphs = DecodeGraphs(
        executor.model,
        executor.pools,
        plan.kv.page_size,
        plan.max_model_len,
        graph_buckets(spec.num_experts_per_tok, plan.max_running_requests),
        "cpu",
        spec.vocab_size,
        plan.max_running_requests,
        mtp_head=executor.mtp.head if executor.mtp is not None else None,
        speculative_tokens=speculative_tokens,
    )
    graphs.capture()
    return graphs


def _with_decode_graphs(executor, plan) -> list[int]:
    """Give a CPU executor decode graphs (`cpu_decode_graphs`); returns a list that counts the steps replayed."""
    graphs = cpu_decode_graphs(executor, plan)
    replayed, run = [], graphs.run
    graphs.run = lambda step, *a: replayed.append(len(step.req_ids)) or run(step, *a)
    executor.graphs = graphs
    return replayed


def _biased_requests():
    """The greedy requests, the third with a logit bias, which the graph's own sampling does not apply (the
    sampler's choice then stands, and the graph's K/V of the head are written again with it)."""
    requests = greedy_requests()
    prompt, _, n = requests[2]
    requests[2] = (prompt, SamplingParams(temperature=0, logit_bias=LOGIT_BIAS), n)
    return requests


# tokens the tiny models' greedy continuations of the third prompt take now and then, raised so that the bias
# changes some of its argmaxes (the tests check it does)
LOGIT_BIAS = tuple((t, 2.0) for t in range(0, 640, 7))


@pytest.mark.parametrize("chunked", [False, True])
def test_cached_mtp_drafts_equal_the_heads_drafts_over_the_whole_sequence(booted, mtp_model, monkeypatch, chunked):
    """After prefills (whole, or in chunks of 8 tokens: a chunk that does not sample is given the prompt's next
    token), rows that kept every draft, some and none (a hybrid's linear state put back), the drafts the worker sent
    back are what the head drafts from the whole sequence: its cached K/V stand where they should."""
    executor, plan = booted
    if chunked:
        executor, plan = boot(mtp_model, "--speculative-method", "mtp", "--max-prefill-tokens", "8")
    base, _ = generate(executor, plan, greedy_requests())
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    knowing = knowing_drafter(reference, executor.spec.vocab_size)
    # it replaces the head's tokens (as the bench's oracle does); the head still runs and drafts
    on, sched, unique = _chained(executor, plan, greedy_requests(), lambda req, k: knowing(req.tokens, k), monkeypatch)
    assert on == base and 0 < sched.accepted_drafts < sched.drafted_tokens
    assert len(unique) >= 10 and max(map(len, unique.values())) >= 2  # chained: the head ran past its own output
    _assert_the_heads_drafts(executor, plan, mtp_model, unique)


def test_a_request_that_stops_drafting_keeps_the_heads_kv_in_the_decode_graphs(mtp_model, monkeypatch):
    """Drafts that are always refused: after its first rows a request decodes plainly, its steps replayed as
    graphs that write the head's K/V and chain nothing, until a probe chains from them: those drafts too are the
    head's over the whole sequence (a graph that wrote the K/V with another token, or left them written with its
    own sample where the sampler's choice stood, fails)."""
    executor, plan = boot(mtp_model, "--speculative-method", "mtp")
    replayed = _with_decode_graphs(executor, plan)
    # the biased request ends first: its steps' K/V are written again after the sampler, the later ones not
    requests = [(prompt, sampling, 40 if i == 2 else 80) for i, (prompt, sampling, _) in enumerate(_biased_requests())]
    base, _ = generate(executor, plan, requests)
    unbiased, _ = generate(executor, plan, [(p, GREEDY, n) for p, _, n in requests])
    assert base[2] != unbiased[2]  # the sampler's choice differs from the graph's own sample somewhere
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    vocab = executor.spec.vocab_size

    def refused(req, k):  # the target's own continuation, every token shifted: never kept
        prompt = next(p for p in reference if tuple(req.tokens[: len(p)]) == p)
        at = len(req.tokens) - len(prompt)
        return [(t + 1) % vocab for t in reference[prompt][at : at + k]]

    # a probe every PROBE_EVERY plain decisions, whatever it costs: a short run sees several
    monkeypatch.setattr(draft_length, "PROBE_COST_SHARE", 1.0)
    replayed.clear()
    starts = _chain_starts(executor, monkeypatch)
    on, sched, unique = _chained(executor, plan, requests, refused, monkeypatch)
    assert on == base and sched.drafted_tokens > 0 and sched.accepted_drafts == 0
    assert len(replayed) > 40  # most steps plain, replayed
    # probes after plain stretches chain from K/V the graphs wrote: the biased request's, written again after the
    # sampler, and the others' after it ended, written with the graph's own samples
    generated = [(i, len(t) - len(p)) for t in unique for i, p in enumerate(PROMPTS) if t[: len(p)] == tuple(p)]
    assert any(i == 2 and n > 8 for i, n in generated) and any(i < 2 and n > 40 for i, n in generated)
    _assert_the_heads_drafts(executor, plan, mtp_model, unique)
    # more finely than a draft's argmax: the head's output where each chain starts, its inputs the real sequence's
    scratch, _ = boot(mtp_model)
    sequences = {rid: list(PROMPTS[rid - 1]) + tokens for rid, (tokens, _) in enumerate(on, start=1)}
    whole = {rid: _whole_sequence_head(executor.mtp.head, scratch, plan, seq) for rid, seq in sequences.items()}
    assert {rid for rid, _, _ in starts} == {1, 2, 3}
    for rid, position, out in starts:
        assert torch.allclose(out, whole[rid][position - 1], atol=1e-5), (rid, position)


def _chain_starts(executor, monkeypatch) -> list[tuple[int, int, torch.Tensor]]:
    """A list the run fills with (request, rotary position, the head's output) of each chain's first pass, whose
    inputs are the target's (a hidden state and a real token): it attends over every slot the request wrote."""
    starts, first = [], []
    chain, forward = executor.mtp._chain, executor.mtp.head.forward

    def recording_chain(*args):
        first.append(True)
        return chain(*args)

    def recording_forward(hidden, next_embeds, positions, layer=0, cache=None):
        out = forward(hidden, next_embeds, positions, layer, cache)
        if first:
            first.clear()
            rids = cache.batch.step.req_ids.tolist()
            starts.extend((int(rid), int(p), o) for rid, p, o in zip(rids, positions.tolist(), out))
        return out

    monkeypatch.setattr(executor.mtp, "_chain", recording_chain)
    monkeypatch.setattr(executor.mtp.head, "forward", recording_forward)
    return starts


def _whole_sequence_head(head, scratch, plan, tokens: list[int]) -> torch.Tensor:
    """The head's outputs over the whole sequence without a cache: row t from h_t and token t + 1."""
    hidden = _target_hidden(scratch, plan, tokens)
    with torch.inference_mode():
        return head(hidden[:-1], scratch.model.embed(torch.tensor(tokens[1:])), torch.arange(1, len(tokens)))


def _chained(executor, plan, requests, drafter, monkeypatch):
    """(outputs, scheduler, {tokens: the head's drafts after them}) of `requests` generated with MTP speculation,
    `drafter` standing in for the head's drafts in the rows (the head still chains its own, recorded)."""
    seen: list[tuple[list[int], tuple[int, ...]]] = []
    complete = batcher_module.BatchScheduler.complete

    def recording_complete(self, output):
        out = complete(self, output)
        for req in self.by_rid.values():
            if req.mtp_drafts_at == len(req.tokens) and req.mtp_drafts:
                seen.append((list(req.tokens), req.mtp_drafts))
        return out

    monkeypatch.setattr(batcher_module.BatchScheduler, "complete", recording_complete)
    on, sched = generate(executor, plan, requests, "mtp", k=K, prefix_cache=False, drafter=drafter)
    return on, sched, {tuple(t): d for t, d in seen}


def _assert_the_heads_drafts(executor, plan, mtp_model, unique: dict, vocab: int = 0) -> None:
    """Each recorded chain is what the head drafts from the whole sequence, without a cache (among the first `vocab`
    ids where given)."""
    scratch, _ = boot(mtp_model)  # its pools hold the whole-sequence forwards
    head = executor.mtp.head
    for tokens, drafts in unique.items():
        hidden = _target_hidden(scratch, plan, list(tokens))
        want = _reference_drafts(head, scratch.model, hidden, list(tokens), len(drafts), vocab)
        assert list(drafts) == want, tokens


@pytest.mark.parametrize("graphed", [False, True])
def test_a_draft_vocabulary_drafts_the_heads_argmax_among_its_first_ids(mtp_model, monkeypatch, graphed):
    """--speculative-draft-vocab N: every chained draft is the argmax of the head's full logits over the first N
    ids, eagerly and in the chain graphs (their bodies, off CUDA), so the chain reads N rows of the LM head; the
    output is still speculation off's, and the pool report prices N rows."""
    vocab = load_model_config(mtp_model).vocab_size // 8  # a random head's argmax lies past it 7 times in 8
    executor, plan = boot(mtp_model, "--speculative-method", "mtp", "--speculative-draft-vocab", str(vocab))
    assert executor.mtp.head.draft_vocab == vocab
    if graphed:
        executor.graphs = cpu_decode_graphs(executor, plan, speculative_tokens=K)
    base, _ = generate(executor, plan, greedy_requests())
    reference = {tuple(p): toks for p, (toks, _) in zip(PROMPTS, base)}
    knowing = knowing_drafter(reference, executor.spec.vocab_size)
    on, sched, unique = _chained(executor, plan, greedy_requests(), lambda req, k: knowing(req.tokens, k), monkeypatch)
    assert on == base and sched.drafted_tokens > 0
    assert len(unique) >= 10 and all(0 <= t < vocab for d in unique.values() for t in d)
    _assert_the_heads_drafts(executor, plan, mtp_model, unique, vocab)
    spec, itemsize = executor.spec, DTYPE_BYTES[plan.dtype]
    pool = pool_report_from_plan(plan, spec.vocab_size, spec, vocab)
    assert (
        pool.mtp_lm_head_bytes
        == vocab * spec.hidden_size * itemsize
        == MtpChainBytes.of(spec, plan.dtype, vocab).lm_head
    )


def test_a_draft_vocabulary_is_refused_where_it_cannot_apply(mtp_model, tiny_models):
    """--speculative-draft-vocab is refused at boot, naming the flag: without mtp, past the model's vocabulary, or
    negative."""
    vocab = load_model_config(mtp_model).vocab_size
    with pytest.raises(ConfigError, match="--speculative-draft-vocab sizes the MTP head's drafts"):
        boot(mtp_model, "--speculative-method", "ngram", "--speculative-draft-vocab", "64")
    with pytest.raises(ConfigError, match=f"--speculative-draft-vocab {vocab + 1} is more than the model's {vocab}"):
        boot(mtp_model, "--speculative-method", "mtp", "--speculative-draft-vocab", str(vocab + 1))
    with pytest.raises(ConfigError, match="--speculative-draft-vocab must be 0"):
        boot(mtp_model, "--speculative-method", "mtp", "--speculative-draft-vocab", "-3")


def test_the_plan_prices_the_mtp_layers_kv_and_weights(mtp_model, booted, tmp_path, capsys):
    executor, plan = booted
    plain_exec, plain_plan = boot(mtp_model)
    spec = load_model_config(mtp_model)
    planned = executor.spec
    assert planned.mtp_kv_layers == 1 and plain_exec.spec.mtp_kv_layers == 0
    per_token = kv_bytes_per_token(planned, plan.dtype) - kv_bytes_per_token(spec, plan.dtype)
    assert per_token == mtp_kv_bytes_per_token(spec, plan.dtype) > 0
    # the MTP layer's K/V are a layer of the pool's full-attention tensor, paged with the target's pages
    k_cache, _ = executor.pools.kv.layer(mtp_kv_layer(spec, 0))
    assert k_cache.shape == executor.pools.kv.layer(spec.layer_types.index("full_attention"))[0].shape
    assert executor.pools.nbytes == plan.kv.bytes + plan.linear_state.bytes + plan.linear_state_snapshots.bytes + (
        plan.experts.bytes
    )
    assert plan.kv.bytes // plan.kv.tokens > plain_plan.kv.bytes // plain_plan.kv.tokens

    # `ferry plan` prices the head's weights as the worker measures them
    def plan_json(*extra):
        parser = argparse.ArgumentParser()
        plan_command.add_arguments(parser)
        args = parser.parse_args([str(mtp_model), "--json", "--gpu-memory", "4GiB", "--dtype", "float32", *extra])
        capsys.readouterr()  # the boots' logs before
        assert plan_command.run(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    drafting, plain = plan_json("--speculative-method", "mtp"), plan_json()
    assert drafting["weights_bytes"] - plain["weights_bytes"] == mtp_resident_bytes(spec, "float32")
    assert "the MTP layer's" in drafting["weights_source"] and "MTP" not in plain["weights_source"]


def test_the_pool_report_carries_what_an_mtp_chain_step_reads(mtp_model, booted):
    """The draft-length controller prices an MTP draft from the PoolReport (draft_length.py's ChainPrices): the
    LM head's bytes and the layer's dense bytes, once a chain step, and one row's routed experts; zero served
    without mtp."""
    executor, plan = booted
    spec, itemsize = executor.spec, DTYPE_BYTES[plan.dtype]
    pool = pool_report_from_plan(plan, spec.vocab_size, spec)
    chain = MtpChainBytes.of(spec, plan.dtype)
    assert (pool.mtp_lm_head_bytes, pool.mtp_layer_bytes, pool.mtp_row_expert_bytes) == (
        chain.lm_head,
        chain.layer,
        chain.row_experts,
    )
    assert chain.lm_head == spec.vocab_size * spec.hidden_size * itemsize
    h, i = spec.hidden_size, spec.moe_intermediate_size
    assert chain.row_experts == spec.num_experts_per_tok * 3 * h * i * itemsize
    # the dense weights of one layer, the fc and norms: the resident bytes less the routed experts, unrounded
    routed = spec.mtp_draft_layers * spec.num_experts * 3 * h * i * itemsize
    assert 0 < chain.layer <= mtp_resident_bytes(spec, plan.dtype) - routed
    assert chain.layer > 2 * h * h * itemsize  # the fc alone
    plain_exec, plain_plan = boot(mtp_model)
    plain = pool_report_from_plan(plain_plan, plain_exec.spec.vocab_size, plain_exec.spec)
    assert (plain.mtp_lm_head_bytes, plain.mtp_layer_bytes, plain.mtp_row_expert_bytes) == (0, 0, 0)


def test_mtp_on_a_model_without_an_mtp_layer_is_refused_naming_the_flag(tiny_models):
    for arch in ("qwen3_5_moe", "qwen3_moe"):
        with pytest.raises(ConfigError, match="--speculative-method mtp.*no multi-token-prediction layer"):
            boot(tiny_models[arch], "--speculative-method", "mtp")
    with pytest.raises(ConfigError, match="--speculative-method must be one of off, ngram, mtp"):
        boot(tiny_models["qwen3_moe"], "--speculative-method", "eagle")


def test_generate_refuses_speculation_naming_the_flag():
    """--speculative-method is a planner flag `ferry generate` shares with serve; its one-request loop never drafts."""
    from ferry.services import generate_command
    from tests.unit.test_cli_flags import parse

    with pytest.raises(ConfigError, match="--speculative-method mtp: ferry generate"):
        generate_command.run(parse("generate", "/models/none", "--prompt", "hi", "--speculative-method", "mtp"))


def test_the_profiled_step_runs_the_mtp_pass_on_temporary_pools(mtp_model, booted, monkeypatch):
    """The CUDA workspace profile runs the largest step with the MTP head's pass after it (its temporaries are the
    workspace's): on the temporary pools, whose KV holds the MTP layer, the head drafts one token a row."""
    from ferry.plan.planner import PlanRequest, resolve
    from ferry.services.worker import mtp_drafts
    from ferry.services.worker.late_bound_experts import LateBoundExperts
    from ferry.services.worker.models import build_model
    from ferry.services.worker.workspace_profile import run_largest_step

    executor, _ = booted
    spec = executor.spec
    r = resolve(spec, PlanRequest(max_running_requests=5, max_prefill_tokens=40))
    experts = LateBoundExperts(spec.num_experts)
    model = build_model(spec, torch.float32, "cpu", experts)
    drafted = []
    run = mtp_drafts.MtpDrafter.run
    monkeypatch.setattr(mtp_drafts.MtpDrafter, "run", lambda self, *a: drafted.append(run(self, *a)) or drafted[-1])
    tokens = run_largest_step(model, experts, spec, r, torch.device("cpu"), executor.mtp.head)
    assert tokens.shape == (5,)
    (drafts,) = drafted
    assert drafts.shape == (5, 1) and ((drafts >= 0) & (drafts < spec.vocab_size)).all()


@pytest.mark.parametrize(
    "fields, word",
    [
        (dict(mtp_drafts=[3], sample=False), "sampling rows only"),
        (dict(mtp_drafts=[17]), "sampling rows only"),  # past MAX_SPECULATIVE_TOKENS
        (dict(mtp_drafts=[15]), "runs past its pages"),  # 3 tokens + 14 chain slots > one page of 16
        (dict(next_tokens=[5]), "-1 for sampling rows"),
        (dict(next_tokens=[10_000], sample=False), "next_tokens must lie in"),
    ],
)
def test_contract_refuses_mtp_fields_a_row_cannot_take(booted, fields, word):
    """A step's MTP fields are checked before anything runs: a chain's K/V stay inside the row's pages."""
    executor, plan = booted
    assert plan.kv.page_size == 16
    new = (
        NewRequest(req_id=7, prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=SamplingParams(temperature=0)),
    )
    step = _step(1, [[1, 2, 3]], [0], [[1]], sample=fields.get("sample", True), rids=[7], new=new)
    arrays = {k: np.array(v, np.int32) for k, v in fields.items() if k != "sample"}
    step = msgspec.structs.replace(step, **arrays)
    with pytest.raises(StepBatchError, match=word):
        executor.execute(step)


def test_an_answer_with_malformed_mtp_drafts_is_unusable():
    from ferry.shared.contract import step_output_problem
    from ferry.shared.step import StepOutput

    def answer(drafts):
        return StepOutput(
            step_id=1,
            req_ids=np.array([1, 2], np.int64),
            token_ids=np.array([3, 4], np.int32),
            logprobs=np.zeros(2, np.float32),
            mtp_drafts=drafts,
        )

    assert step_output_problem(answer(np.array([[5, -1], [6, 7]], np.int32)), vocab_size=96) is None
    for bad in (np.array([5, 6], np.int32), np.array([[5, -1]], np.int32), np.array([[5, 96], [1, 2]], np.int32)):
        assert "mtp_drafts" in step_output_problem(answer(bad), vocab_size=96)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next", "glm4_moe"])
def test_a_gguf_holds_its_mtp_layer_as_llama_cpp_writes_it_and_drafts_with_it(tmp_path, arch):
    """llama.cpp's converter writes Qwen3.5's (and Qwen3-Next's, GLM-4.5's) MTP layer as block num_layers (fc, the
    pre-fc norms and the final norm under `nextn.`, Qwen's norms shifted by one; the layer's tensors as a decoder
    layer's):
    the GGUF reads back the checkpoint's MTP tensors as the file rounded them (F16 matrices, Q8_0 experts), so the
    swapped pre-fc norms of a planted misreading show; and greedy decoding of the GGUF with --speculative-method
    mtp drafts with them and gives the tokens of speculation off."""
    import gguf
    from safetensors.numpy import load_file

    from ferry.plan import gguf_checkpoint
    from ferry.services.gguf_writer import GGUF_SIZES, write_gguf
    from ferry.services.worker.gguf_tensors import mtp_gguf_tensors

    hf = make_tiny_model(tmp_path / "hf", arch, seed=0, mtp=True, **GGUF_SIZES)
    path = write_gguf(hf, tmp_path / "tiny-mtp-Q8_0.gguf", "Q8_0")
    spec = load_model_config(path)
    assert spec.mtp_draft_layers == 1 and load_model_config(hf).num_layers == spec.num_layers
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    n = spec.num_layers
    assert {f"blk.{n}.nextn.eh_proj.weight", f"blk.{n}.nextn.enorm.weight", f"blk.{n}.attn_q.weight"} <= names
    want = {mtp_name(spec, name): value for name, value in load_file(hf / "mtp.safetensors").items()}

    def stored(name: str, value: np.ndarray) -> np.ndarray:
        """`value` as the file holds it: experts in Q8_0, other matrices in F16 but the routers (float32, as
        llama.cpp keeps them), norms as float32."""
        if ".experts." in name:
            q8 = gguf.GGMLQuantizationType.Q8_0
            return gguf.quants.dequantize(gguf.quants.quantize(value.astype(np.float32), q8), q8)
        router = name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
        return value.astype(np.float16).astype(np.float32) if value.ndim == 2 and not router else value

    def read(source) -> dict[str, np.ndarray]:
        return {name: t.numpy() for name, t in mtp_gguf_tensors(source, spec)}

    got = read(path)
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], stored(name, value), atol=1e-6, err_msg=name)
    if arch != "glm4_moe":  # ffn_gate_up_exps (the gguf package's glm4moe table has no fused gate/up experts)
        fused = read(write_gguf(hf, tmp_path / "fused-Q8_0.gguf", "Q8_0", fused_gate_up=True))
        assert all(np.array_equal(fused[name], got[name]) for name in got)
    executor, plan = boot(path, "--speculative-method", "mtp")
    off, _ = generate(executor, plan, greedy_requests())
    on, sched = generate(executor, plan, greedy_requests(), "mtp", k=K)
    assert on == off and sched.drafted_tokens > 0
    swapped = dict(gguf_checkpoint.GGUF_MTP_NEXTN)
    swapped["mtp.pre_fc_norm_embedding.weight"], swapped["mtp.pre_fc_norm_hidden.weight"] = (
        swapped["mtp.pre_fc_norm_hidden.weight"],
        swapped["mtp.pre_fc_norm_embedding.weight"],
    )
    gguf_checkpoint.GGUF_MTP_NEXTN, kept = swapped, gguf_checkpoint.GGUF_MTP_NEXTN
    try:
        misread = read(path)
    finally:
        gguf_checkpoint.GGUF_MTP_NEXTN = kept
    assert not np.allclose(misread["mtp.pre_fc_norm_hidden.weight"], want["mtp.pre_fc_norm_hidden.weight"], atol=1e-3)
