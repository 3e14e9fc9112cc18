"""Hypothesis against every decoder and every handler at a trust boundary (docs/ARCHITECTURE.md §1,
"Trust"): whatever arrives, the receiver answers with a typed error (WireError, InvalidRequest, a
StepBatchError, a failed step) and never crashes. Bounded for CI: a few hundred examples each."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.shared.contract import StepLimits, step_problems
from ferry.shared.errors import FerryError, InvalidRequest
from ferry.shared.messages import (
    ApiToScheduler, PoolReport, SchedulerToApi, SchedulerToWorker, Submit, WorkerAlive, WorkerToScheduler,
)  # fmt: skip
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch, StepOutput
from ferry.shared.wire import Codec, WireError
from ferry.services.api.json_limits import MAX_JSON_DEPTH, json_depth
from ferry.services.api import schema
from ferry.services.scheduler.batcher import BatchScheduler

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
UNIONS = [ApiToScheduler, SchedulerToApi, SchedulerToWorker, WorkerToScheduler]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip
TAGS = ["Submit", "Abort", "ApiHeartbeat", "Tokens", "Finished", "Failed", "SchedulerStatus", "RunStep",
        "SchedulerBeat", "WorkerAlive", "StepDone", "StepFailed"]  # fmt: skip
array_refs = st.lists(st.one_of(st.integers(-3, 5), st.text(max_size=4), st.sampled_from(["<i4", "|O", "<U3", "<f8", "|V0", "|b1"]),
                                st.lists(st.integers(-2, 2**40), max_size=3)), max_size=4)  # fmt: skip


def _head(tag: str, fields: dict) -> bytes:
    return msgspec.msgpack.encode({"type": tag, **fields})


@pytest.mark.parametrize("union", UNIONS, ids=lambda u: str(u).split("[")[-1][:40])
@FUZZ
@given(tag=st.sampled_from(TAGS), fields=st.dictionaries(st.sampled_from(
    ["req_id", "prompt_token_ids", "sampling", "max_tokens", "boot_id", "pool", "batch", "output", "req_ids",
     "token_ids", "step_id", "message", "reason", "last_step"]), msgpack_values | array_refs, max_size=5),
    extra=st.lists(st.binary(max_size=16), max_size=3))  # fmt: skip
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


sampling = st.builds(SamplingParams, temperature=st.floats(), top_p=st.floats(), top_k=st.integers(-(2**63), 2**63 - 1),
                     min_p=st.floats(), seed=st.none() | st.integers(-(2**63), 2**63 - 1),
                     repetition_penalty=st.floats(), presence_penalty=st.floats(), frequency_penalty=st.floats(),
                     stop_token_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3).map(tuple))  # fmt: skip
POOL = PoolReport(kv_pages=16, page_size=4, linear_state_slots=0, max_running_requests=4, max_prefill_tokens=32,
                  max_model_len=64, vocab_size=100)  # fmt: skip


@FUZZ
@given(prompt=arrays(), params=sampling, max_tokens=st.none() | st.integers(-(2**63), 2**63 - 1))
def test_the_scheduler_admits_or_refuses_any_submit_it_can_decode(prompt, params, max_tokens):
    """Through the wire and into the scheduler's admission: a typed refusal for that request, or a
    request whose every token and sampling value a step can carry."""
    codec = Codec(ApiToScheduler)
    msg = codec.decode([bytes(f) for f in codec.encode(Submit(req_id=1, prompt_token_ids=prompt, sampling=params,
                                                                max_tokens=max_tokens))])  # fmt: skip
    sched = BatchScheduler(POOL)
    try:
        req = sched.add(1, b"c", msg.req_id, msg.prompt_token_ids, msg.sampling, msg.max_tokens)
    except InvalidRequest:
        return
    assert all(0 <= t < 100 for t in req.tokens) and math.isfinite(req.sampling.temperature)
    batch = sched.schedule()
    assert batch is not None and not step_problems(batch, LIMITS, set())


@FUZZ
@given(kv=st.integers(-(2**63), 2**64 - 1), mrr=st.integers(-(2**63), 2**64 - 1), length=st.integers(-(2**63), 2**64 - 1))
def test_a_worker_heartbeat_claims_only_pools_that_can_exist(kv, mrr, length):
    codec = Codec(WorkerToScheduler)
    head = _head("WorkerAlive", {"boot_id": "b", "pool": {"kv_pages": kv, "page_size": 16, "linear_state_slots": 0,
                                                          "max_running_requests": mrr, "max_prefill_tokens": 64,
                                                          "max_model_len": length}})  # fmt: skip
    try:
        msg = codec.decode([head])
    except WireError:
        return
    BatchScheduler(msg.pool)  # built at once, whatever the sizes: the allocators grow with use


LIMITS = StepLimits(kv_pages=16, page_size=4, linear_state_slots=0, max_running_requests=4, max_prefill_tokens=32,
                    max_model_len=64, vocab_size=100)  # fmt: skip


@FUZZ
@given(req_ids=arrays(1), tokens=arrays(1), query_lens=arrays(1), context_lens=arrays(1), page_table=arrays(),
       slots=arrays(1), reset=arrays(1), sample=arrays(1), prompt=arrays(), params=sampling)
def test_the_worker_refuses_any_step_that_breaks_its_plan(req_ids, tokens, query_lens, context_lens, page_table, slots,
                                                          reset, sample, prompt, params):  # fmt: skip
    batch = StepBatch(step_id=1, req_ids=req_ids, tokens=tokens, query_lens=query_lens, context_lens=context_lens,
                      page_table=page_table, linear_state_slots=slots, reset_linear_state=reset, sample=sample,
                      new_requests=(NewRequest(req_id=5, prompt_token_ids=prompt, sampling=params),))  # fmt: skip
    problems = step_problems(batch, LIMITS, {5})
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)


@FUZZ
@given(req_ids=arrays(), token_ids=arrays())
def test_the_scheduler_fails_a_step_whose_answer_is_unusable_and_goes_on(req_ids, token_ids):
    sched = BatchScheduler(POOL)
    sched.add(1, b"c", 1, np.array([1, 2, 3], np.int32), SamplingParams(), 4)
    batch = sched.schedule()
    out = sched.complete(StepOutput(step_id=batch.step_id, req_ids=req_ids, token_ids=token_ids,
                                    logprobs=np.zeros(0, np.float32)))  # fmt: skip
    for req, token in out.tokens:
        assert 0 <= token < 100
    for _, err in out.failed:
        assert isinstance(err, FerryError)
    assert not sched.step_in_flight


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=30)  # fmt: skip


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
    assert got == expected or (expected <= MAX_JSON_DEPTH and got >= expected and got <= MAX_JSON_DEPTH), (got, expected)


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
@given(prompt=arrays(), params=sampling, max_tokens=st.none() | st.integers(-(2**63), 2**63 - 1),
       beat=st.builds(WorkerAlive, boot_id=st.sampled_from(["real", "forged"]), step_running_s=st.floats(),
                      expert_hits=st.integers(0, 2**63 - 1), last_step=st.integers(0, 2**63 - 1)))  # fmt: skip
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
@given(head=st.binary(max_size=64) | msgpack_values.map(lambda v: msgspec.msgpack.encode({"type": "Submit", "req_id": v})))
def test_the_scheduler_refuses_an_undecodable_submit_without_crashing(scheduler_service, head):
    from ferry.shared.wire import PeerWireError

    scheduler_service._refuse_undecodable(PeerWireError("undecodable", b"fuzz", head))
