"""Hypothesis against every decoder and every handler at a trust boundary (docs/ARCHITECTURE.md §1,
"Trust"): whatever arrives, the receiver answers with a typed error (WireError, InvalidRequest, a
StepBatchError, a failed step) and never crashes. Bounded for CI: a few hundred examples each."""

from __future__ import annotations

import asyncio
import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.services.api import schema
from ferry.services.api.json_limits import MAX_JSON_DEPTH, json_depth
from ferry.services.scheduler.batcher import BatchScheduler
from ferry.shared.contract import StepLimits, logprobs_problem, step_output_problem, step_problems
from ferry.shared.errors import EngineError, FerryError, InvalidRequest
from ferry.shared.messages import (
    ApiToScheduler,
    PoolReport,
    SchedulerToApi,
    SchedulerToWorker,
    Submit,
    Tokens,
    WorkerAlive,
    WorkerToScheduler,
)
from ferry.shared.sampling import MAX_GRAMMAR_CHARS, MAX_LOGPROBS, SamplingParams
from ferry.shared.step import Logprobs, NewRequest, StepBatch, StepOutput
from ferry.shared.wire import Codec, WireError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
UNIONS = [ApiToScheduler, SchedulerToApi, SchedulerToWorker, WorkerToScheduler]

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
TAGS = [
    "Submit",
    "Abort",
    "ApiHeartbeat",
    "Tokens",
    "Finished",
    "Failed",
    "SchedulerStatus",
    "RunStep",
    "SchedulerBeat",
    "WorkerAlive",
    "StepDone",
    "StepFailed",
]
array_refs = st.lists(
    st.one_of(
        st.integers(-3, 5),
        st.text(max_size=4),
        st.sampled_from(["<i4", "|O", "<U3", "<f8", "|V0", "|b1"]),
        st.lists(st.integers(-2, 2**40), max_size=3),
    ),
    max_size=4,
)


def _head(tag: str, fields: dict) -> bytes:
    return msgspec.msgpack.encode({"type": tag, **fields})


@pytest.mark.parametrize("union", UNIONS, ids=lambda u: str(u).split("[")[-1][:40])
@FUZZ
@given(
    tag=st.sampled_from(TAGS),
    fields=st.dictionaries(
        st.sampled_from(
            [
                "req_id",
                "prompt_token_ids",
                "sampling",
                "max_tokens",
                "boot_id",
                "pool",
                "batch",
                "output",
                "req_ids",
                "token_ids",
                "step_id",
                "message",
                "reason",
                "last_step",
                "logprobs",
                "prompt_logprobs",
                "sampled_logprobs",
                "logit_bias",
                "grammar",
                "start",
                "token_logprobs",
                "top_ids",
                "top_logprobs",
            ]
        ),
        msgpack_values | array_refs,
        max_size=5,
    ),
    extra=st.lists(st.binary(max_size=16), max_size=3),
)
def test_every_decoder_answers_garbage_with_a_wire_error(union, tag, fields, extra):
    codec = Codec(union)
    try:
        codec.decode([_head(tag, fields), *extra])
    except WireError:
        pass


@pytest.mark.parametrize("union", UNIONS, ids=lambda u: str(u).split("[")[-1][:40])
@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_every_decoder_answers_random_bytes_with_a_wire_error(union, frames):
    try:
        Codec(union).decode(frames)
    except WireError:
        pass


dtypes = st.sampled_from([np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_, np.int8])


@st.composite
def arrays(draw, ndim=None):
    kind = draw(dtypes)
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim or 0, max_size=ndim or 2))
    n = int(np.prod(shape)) if shape else 1
    if kind == np.bool_:
        vals = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif np.issubdtype(kind, np.floating):
        vals = draw(st.lists(st.floats(width=32), min_size=n, max_size=n))
    else:
        info = np.iinfo(kind)
        vals = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n))
    return np.array(vals, dtype=kind).reshape(shape)


int64s = st.integers(-(2**63), 2**63 - 1)
counts = st.none() | st.integers(-3, MAX_LOGPROBS + 3) | int64s  # logprobs / prompt_logprobs: 0..20 are valid
sampling = st.builds(
    SamplingParams,
    temperature=st.floats(),
    top_p=st.floats(),
    top_k=int64s,
    min_p=st.floats(),
    seed=st.none() | int64s,
    repetition_penalty=st.floats(),
    presence_penalty=st.floats(),
    frequency_penalty=st.floats(),
    stop_token_ids=st.lists(int64s, max_size=3).map(tuple),
    # issue 11's fields: token ids in and out of the vocabulary (100), biases in and out of range
    logit_bias=st.lists(st.tuples(st.integers(-2, 120) | int64s, st.floats()), max_size=3).map(tuple),
    logprobs=counts,
    prompt_logprobs=counts,
    grammar=st.none() | st.text(max_size=16),
)
POOL = PoolReport(
    kv_pages=16,
    page_size=4,
    linear_state_slots=0,
    max_running_requests=4,
    max_prefill_tokens=32,
    max_model_len=64,
    vocab_size=100,
)


@FUZZ
@given(prompt=arrays(), params=sampling, max_tokens=st.none() | st.integers(-(2**63), 2**63 - 1))
def test_the_scheduler_admits_or_refuses_any_submit_it_can_decode(prompt, params, max_tokens):
    """Through the wire and into the scheduler's admission: a typed refusal for that request, or a
    request whose every token and sampling value a step can carry."""
    codec = Codec(ApiToScheduler)
    msg = codec.decode(
        [
            bytes(f)
            for f in codec.encode(Submit(req_id=1, prompt_token_ids=prompt, sampling=params, max_tokens=max_tokens))
        ]
    )
    sched = BatchScheduler(POOL)
    try:
        req = sched.add(1, b"c", msg.req_id, msg.prompt_token_ids, msg.sampling, msg.max_tokens)
    except InvalidRequest:
        return
    assert all(0 <= t < 100 for t in req.tokens) and math.isfinite(req.sampling.temperature)
    batch = sched.schedule()
    assert batch is not None and not step_problems(batch, LIMITS, set())


@FUZZ
@given(
    kv=st.integers(-(2**63), 2**64 - 1), mrr=st.integers(-(2**63), 2**64 - 1), length=st.integers(-(2**63), 2**64 - 1)
)
def test_a_worker_heartbeat_claims_only_pools_that_can_exist(kv, mrr, length):
    codec = Codec(WorkerToScheduler)
    head = _head(
        "WorkerAlive",
        {
            "boot_id": "b",
            "pool": {
                "kv_pages": kv,
                "page_size": 16,
                "linear_state_slots": 0,
                "max_running_requests": mrr,
                "max_prefill_tokens": 64,
                "max_model_len": length,
            },
        },
    )
    try:
        msg = codec.decode([head])
    except WireError:
        return
    BatchScheduler(msg.pool)  # built at once, whatever the sizes: the allocators grow with use


LIMITS = StepLimits(
    kv_pages=16,
    page_size=4,
    linear_state_slots=0,
    max_running_requests=4,
    max_prefill_tokens=32,
    max_model_len=64,
    vocab_size=100,
)


@FUZZ
@given(
    req_ids=arrays(1),
    tokens=arrays(1),
    query_lens=arrays(1),
    context_lens=arrays(1),
    page_table=arrays(),
    slots=arrays(1),
    reset=arrays(1),
    sample=arrays(1),
    prompt=arrays(),
    params=sampling,
    prompt_lps=st.none() | arrays(),
)
def test_the_worker_refuses_any_step_that_breaks_its_plan(
    req_ids, tokens, query_lens, context_lens, page_table, slots, reset, sample, prompt, params, prompt_lps
):
    batch = StepBatch(
        step_id=1,
        req_ids=req_ids,
        tokens=tokens,
        query_lens=query_lens,
        context_lens=context_lens,
        page_table=page_table,
        linear_state_slots=slots,
        reset_linear_state=reset,
        sample=sample,
        new_requests=(NewRequest(req_id=5, prompt_token_ids=prompt, sampling=params),),
        prompt_logprobs=prompt_lps,
    )
    problems = step_problems(batch, LIMITS, {5})
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
    if prompt_lps is not None and not problems:  # what the executor then indexes with it
        assert prompt_lps.dtype == bool and prompt_lps.shape == (len(batch.req_ids),)


def _step(**fields) -> StepBatch:
    """A well-formed one-request prefill step (request 5, tokens 1 2 3, one page), with `fields` replaced."""
    base = dict(
        step_id=1,
        req_ids=np.array([5], np.int64),
        tokens=np.array([1, 2, 3], np.int32),
        query_lens=np.array([3], np.int32),
        context_lens=np.array([0], np.int32),
        page_table=np.array([[1]], np.int32),
        linear_state_slots=np.array([0], np.int32),
        reset_linear_state=np.array([True]),
        sample=np.array([True]),
        new_requests=(NewRequest(req_id=5, prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=SamplingParams()),),
    )
    return StepBatch(**{**base, **fields})


def test_the_step_contract_holds_issue_11s_fields():
    assert step_problems(_step(prompt_logprobs=np.array([True])), LIMITS, set()) == []
    assert "prompt_logprobs" in step_problems(_step(prompt_logprobs=np.array([1], np.int32)), LIMITS, set())[0]
    assert "prompt_logprobs" in step_problems(_step(prompt_logprobs=np.array([True, False])), LIMITS, set())[0]
    assert "prompt_logprobs" in step_problems(_step(prompt_logprobs=np.array([[True]])), LIMITS, set())[0]
    # feed_sampled (a step scheduled ahead) is held to the same shape and length
    assert step_problems(_step(feed_sampled=np.array([False])), LIMITS, set()) == []
    assert (
        "feed_sampled must be a 1-D bool"
        in step_problems(_step(feed_sampled=np.array([1], np.int32)), LIMITS, set())[0]
    )
    assert "feed_sampled has 2 entries" in step_problems(_step(feed_sampled=np.array([True, False])), LIMITS, set())[0]
    # a row that wants prompt logprobs but does not sample still needs a request the worker knows
    unknown = _step(sample=np.array([False]), prompt_logprobs=np.array([True]), new_requests=())
    assert "never announced" in " ".join(step_problems(unknown, LIMITS, set()))
    assert step_problems(unknown, LIMITS, {5}) == []
    for bad, word in [
        (SamplingParams(logit_bias=((100, 1.0),)), "vocabulary"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((3, float("nan")),)), "logit_bias"),
        (SamplingParams(logprobs=21), "top_logprobs"),
        (SamplingParams(prompt_logprobs=-1), "logprobs"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "300"),
        (SamplingParams(grammar="x" * (MAX_GRAMMAR_CHARS + 1)), "grammar"),
    ]:
        new = (NewRequest(req_id=5, prompt_token_ids=np.array([1, 2, 3], np.int32), sampling=bad),)
        problems = " ".join(step_problems(_step(new_requests=new), LIMITS, set()))
        assert word in problems, (bad, problems)
        with pytest.raises(InvalidRequest, match=word):
            BatchScheduler(POOL).add(1, b"c", 1, np.array([1, 2, 3], np.int32), bad, 4)


HYBRID_LIMITS = StepLimits(
    kv_pages=16,
    page_size=4,
    linear_state_slots=4,
    max_running_requests=4,
    max_prefill_tokens=32,
    max_model_len=64,
    vocab_size=100,
    linear_state_snapshots=3,
)


def _hybrid_step(**fields) -> StepBatch:
    """Request 5 resumes from a cached prefix: 3 tokens at positions 4..6, in slot 2."""
    base = dict(
        context_lens=np.array([4], np.int32),
        page_table=np.array([[1, 2]], np.int32),
        linear_state_slots=np.array([2], np.int32),
        reset_linear_state=np.array([False]),
    )
    return _step(**{**base, **fields})


def test_the_step_contract_holds_the_linear_state_copies():
    ok = _hybrid_step(restore_state=np.array([2], np.int32), save_state=np.array([0], np.int32))
    assert step_problems(ok, HYBRID_LIMITS, set()) == []
    inside = _hybrid_step(save_state=np.array([0], np.int32), save_offset=np.array([1], np.int32))
    assert step_problems(inside, HYBRID_LIMITS, set()) == []
    assert step_problems(_hybrid_step(restore_state=np.array([-1], np.int32)), HYBRID_LIMITS, set()) == []
    for fields, word in [
        (dict(restore_state=np.array([3], np.int32)), "snapshot ids must be -1 or in 0..2"),
        (dict(save_state=np.array([-2], np.int32)), "snapshot ids"),
        (dict(save_state=np.array([0, 1], np.int32)), "save_state has 2 entries"),
        (dict(restore_state=np.array([True])), "restore_state must be a 1-D integer array"),
        (dict(save_state=np.array([[0]], np.int32)), "save_state must be a 1-D integer array"),
        (dict(restore_state=np.array([0], np.int32), linear_state_slots=np.array([0], np.int32)), "linear-state slot"),
        (dict(restore_state=np.array([0], np.int32), reset_linear_state=np.array([True])), "cached prefix"),
        (
            dict(
                restore_state=np.array([0], np.int32),
                context_lens=np.array([0], np.int32),
                reset_linear_state=np.array([True]),
            ),
            "cached prefix",
        ),
        (dict(save_state=np.array([0], np.int32), save_offset=np.array([0], np.int32)), "save_offset"),
        (dict(save_state=np.array([0], np.int32), save_offset=np.array([4], np.int32)), "save_offset"),
        (dict(save_state=np.array([0], np.int32), save_offset=np.array([1, 1], np.int32)), "save_offset has 2 entries"),
        (dict(save_state=np.array([0], np.int32), save_offset=np.array([0.5])), "save_offset must be a 1-D integer"),
    ]:
        problems = " ".join(step_problems(_hybrid_step(**fields), HYBRID_LIMITS, set()))
        assert word in problems, (fields, problems)
    # two rows saving into one snapshot; a model without linear state (or without snapshots) takes no copy
    two = _hybrid_step(
        req_ids=np.array([5, 6], np.int64),
        tokens=np.array([1, 2], np.int32),
        query_lens=np.array([1, 1], np.int32),
        context_lens=np.array([4, 4], np.int32),
        page_table=np.array([[1, 2], [3, 4]], np.int32),
        linear_state_slots=np.array([1, 2], np.int32),
        reset_linear_state=np.array([False, False]),
        sample=np.array([False, False]),
        save_state=np.array([1, 1], np.int32),
    )
    assert "two rows save into one snapshot" in " ".join(step_problems(two, HYBRID_LIMITS, set()))
    assert (
        "keeps no linear-state snapshots" in step_problems(_step(save_state=np.array([0], np.int32)), LIMITS, set())[0]
    )


@FUZZ
@given(restore=st.none() | arrays(1), save=st.none() | arrays(1), slots=arrays(1), context=arrays(1), reset=arrays(1))
def test_the_worker_refuses_any_state_copy_outside_its_pools(restore, save, slots, context, reset):
    batch = _hybrid_step(
        restore_state=restore, save_state=save, linear_state_slots=slots, context_lens=context, reset_linear_state=reset
    )
    problems = step_problems(batch, HYBRID_LIMITS, {5})
    if not problems:  # what the executor then indexes the pools with: -1 (none) or an id within the pool
        for a, bound in ((restore, 3), (save, 3), (slots, 5)):
            if a is not None:
                assert a.dtype.kind in "iu" and a.shape == (1,)
                assert int(a[0]) == -1 and a is not slots or 0 <= int(a[0]) < bound


def test_a_forged_grammar_or_bias_crosses_the_wire_only_within_its_bounds():
    codec = Codec(ApiToScheduler)
    head = _head(
        "Submit",
        {
            "req_id": 1,
            "prompt_token_ids": [1, "<i4", [0]],
            "max_tokens": 1,
            "sampling": {"logit_bias": [[2**64 - 1, 1.0]], "logprobs": 2**63},
        },
    )
    with pytest.raises(WireError):
        codec.decode([head, b""])
    head = _head("Submit", {"req_id": 1, "prompt_token_ids": [1, "<i4", [0]], "sampling": {"grammar": 5}})
    with pytest.raises(WireError):
        codec.decode([head, b""])


logprobs_structs = st.builds(
    Logprobs,
    req_id=st.integers(0, 6),
    start=st.integers(0, 70),
    token_logprobs=arrays(),
    top_ids=arrays(),
    top_logprobs=arrays(),
)


@FUZZ
@given(lp=logprobs_structs)
def test_a_logprobs_struct_is_well_formed_or_named(lp):
    problem = logprobs_problem(lp, 100)
    if problem is None:  # what the scheduler slices and the api indexes
        n, k = lp.top_ids.shape
        assert lp.token_logprobs.shape == (n,) and n >= 1 and k <= MAX_LOGPROBS and lp.top_logprobs.shape == (n, k)
        assert lp.top_ids.size == 0 or 0 <= lp.top_ids.min() <= lp.top_ids.max() < 100


@FUZZ
@given(
    req_ids=arrays(),
    token_ids=arrays(),
    sampled_lps=st.lists(logprobs_structs, max_size=2),
    prompt_lps=st.lists(logprobs_structs, max_size=2),
)
def test_the_scheduler_fails_a_step_whose_answer_is_unusable_and_goes_on(req_ids, token_ids, sampled_lps, prompt_lps):
    sched = BatchScheduler(POOL)
    sched.add(1, b"c", 1, np.array([1, 2, 3], np.int32), SamplingParams(logprobs=2, prompt_logprobs=2), 4)
    batch = sched.schedule()
    output = StepOutput(
        step_id=batch.step_id,
        req_ids=req_ids,
        token_ids=token_ids,
        logprobs=np.zeros(0, np.float32),
        sampled_logprobs=tuple(sampled_lps),
        prompt_logprobs=tuple(prompt_lps),
    )
    out = sched.complete(output)
    for req, token in out.tokens:
        assert 0 <= token < 100
    for _, lp in (*out.logprobs, *out.prompt_logprobs):  # what reaches the api is well-formed
        assert logprobs_problem(lp, 100) is None
    for _, err in out.failed:
        assert isinstance(err, FerryError)
    if step_output_problem(output, 100) is not None:
        assert not out.tokens and not out.logprobs and not out.prompt_logprobs
    assert not sched.step_in_flight


@pytest.fixture(scope="module")
def api_client(tmp_path_factory):
    from ferry.services.api.scheduler_client import SchedulerClient

    client = SchedulerClient(f"ipc://{tmp_path_factory.mktemp('api')}/s", "fuzz")
    yield client
    # the client's own close: it has a heartbeat socket too, whose context left to the garbage collector
    # blocked a later test in its term()
    asyncio.run(client.close())


@FUZZ
@given(
    req_ids=arrays(),
    token_ids=arrays(),
    lps=st.lists(logprobs_structs, max_size=2),
    prompt_lps=st.lists(logprobs_structs, max_size=2),
)
def test_the_api_takes_any_tokens_message_or_fails_the_requests_it_names(
    api_client, req_ids, token_ids, lps, prompt_lps
):
    """A Tokens from the scheduler (with issue 11's logprobs) reaches a stream only whole and well-formed;
    otherwise the requests it names fail with an EngineError and the replica goes on."""
    from ferry.services.api.scheduler_client import PromptLogprobs, RequestStream, Token

    api_client.streams = {rid: RequestStream(rid) for rid in range(7)}
    streams = dict(api_client.streams)
    api_client._on_tokens(Tokens(req_ids, token_ids, logprobs=tuple(lps), prompt_logprobs=tuple(prompt_lps)), 0.0)
    for stream in streams.values():
        while not stream.queue.empty():
            ev = stream.queue.get_nowait()
            assert isinstance(ev, (Token, PromptLogprobs, EngineError)), ev
            if isinstance(ev, Token):
                assert isinstance(ev.token_id, int) and ev.token_id >= 0
                assert ev.logprobs is None or logprobs_problem(ev.logprobs, 0) is None
            if isinstance(ev, PromptLogprobs):
                assert logprobs_problem(ev.logprobs, 0) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=30,
)


@FUZZ
@given(body=json_values, route=st.sampled_from([schema.ChatCompletionRequest, schema.CompletionRequest]))
def test_the_api_schema_answers_any_json_with_a_request_or_a_400(body, route):
    try:
        req = schema.decode_body(msgspec.json.encode(body), route)
    except InvalidRequest:
        return
    msgspec.msgpack.encode(req)  # whatever decoded, encodes: no integer past int64 reaches the scheduler


@FUZZ
@given(value=json_values, depth=st.integers(0, 200), text=st.text(alphabet='[]{}"\\ab', max_size=30))
def test_json_depth_counts_nesting_outside_strings(value, depth, text):
    body = b"[" * depth + msgspec.json.encode([value, text]) + b"]" * depth
    expected = depth + 1 + _depth(value)
    got = json_depth(body)
    assert got == expected or (expected <= MAX_JSON_DEPTH and got >= expected and got <= MAX_JSON_DEPTH), (
        got,
        expected,
    )


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


@pytest.fixture(scope="module")
def scheduler_service(tmp_path_factory):
    import zmq

    from ferry.services.scheduler.config import SchedulerConfig
    from ferry.services.scheduler.service import SchedulerService

    d = tmp_path_factory.mktemp("svc")
    ctx = zmq.Context()
    svc = SchedulerService(SchedulerConfig(f"ipc://{d}/a", f"ipc://{d}/s", f"ipc://{d}/r", "127.0.0.1", None, 5.0), ctx)
    svc._worker_alive(WorkerAlive(boot_id="real", pool=POOL))
    yield svc
    svc.close()
    ctx.term()


@FUZZ
@given(
    prompt=arrays(),
    params=sampling,
    max_tokens=st.none() | st.integers(-(2**63), 2**63 - 1),
    beat=st.builds(
        WorkerAlive,
        boot_id=st.sampled_from(["real", "forged"]),
        step_running_s=st.floats(),
        expert_hits=st.integers(0, 2**63 - 1),
        last_step=st.integers(0, 2**63 - 1),
    ),
)
def test_the_scheduler_service_handles_any_decodable_message(scheduler_service, prompt, params, max_tokens, beat):
    svc = scheduler_service
    svc._submit(b"fuzz", Submit(req_id=1, prompt_token_ids=prompt, sampling=params, max_tokens=max_tokens))
    svc._worker_alive(beat)
    svc._maybe_step()
    svc._heartbeat()
    if svc.core is None:  # a "hung" beat dropped the worker: the next real one brings it back
        svc._worker_alive(WorkerAlive(boot_id="real2", pool=POOL))
    assert svc.core is not None and svc.core.pool.kv_pages == POOL.kv_pages
    svc.rids.clear()


@FUZZ
@given(
    head=st.binary(max_size=64) | msgpack_values.map(lambda v: msgspec.msgpack.encode({"type": "Submit", "req_id": v}))
)
def test_the_scheduler_refuses_an_undecodable_submit_without_crashing(scheduler_service, head):
    from ferry.shared.wire import PeerWireError

    scheduler_service._refuse_undecodable(PeerWireError("undecodable", b"fuzz", head))
