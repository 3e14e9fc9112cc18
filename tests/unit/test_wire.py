"""The wire: every message round-trips through the codec, small arrays ride in the header and large ones
in extra frames, and a message of the wrong union (or a malformed array) is refused."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from ferry.shared.messages import (
    Abort,
    ApiHeartbeat,
    ApiToScheduler,
    Failed,
    Finished,
    PoolReport,
    RunStep,
    SchedulerStatus,
    SchedulerToApi,
    SchedulerToWorker,
    StepDone,
    StepFailed,
    Submit,
    Tokens,
    WorkerAlive,
    WorkerToScheduler,
)
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch, StepOutput
from ferry.shared.wire import INLINE_ARRAY_BYTES, Codec, PeerSocket, RouterSocket, WireError


def batch() -> StepBatch:
    return StepBatch(
        step_id=7,
        req_ids=np.array([3, 4], np.int64),
        tokens=np.arange(5, dtype=np.int32),
        query_lens=np.array([4, 1], np.int32),
        context_lens=np.array([0, 9], np.int32),
        page_table=np.array([[1, 2, 0], [5, 6, 7]], np.int32),
        linear_state_slots=np.array([1, 2], np.int32),
        reset_linear_state=np.array([True, False]),
        sample=np.array([True, True]),
        new_requests=(
            NewRequest(
                req_id=3,
                prompt_token_ids=np.arange(4, dtype=np.int32),
                sampling=SamplingParams(temperature=0.5, seed=1, stop_token_ids=(2,)),
            ),
        ),
        finished_req_ids=(1, 2),
    )


def assert_same(a, b):
    assert type(a) is type(b)
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), name
        elif hasattr(x, "__struct_fields__") and not isinstance(x, SamplingParams):
            assert_same(x, y)
        elif isinstance(x, tuple) and x and hasattr(x[0], "__struct_fields__"):
            assert len(x) == len(y), name
            for u, v in zip(x, y):
                assert_same(u, v)
        else:
            assert x == y, name


POOL = PoolReport(
    kv_pages=10, page_size=16, linear_state_slots=2, max_running_requests=4, max_prefill_tokens=64, max_model_len=128
)
MESSAGES = [
    (
        ApiToScheduler,
        Submit(req_id=1, prompt_token_ids=np.array([5, 6, 7], np.int32), sampling=SamplingParams(), max_tokens=None),
    ),
    (ApiToScheduler, Abort(3)),
    (ApiToScheduler, ApiHeartbeat()),
    (SchedulerToApi, Tokens(np.array([1, 2], np.int64), np.array([9, 8], np.int32))),
    (SchedulerToApi, Finished(req_id=1, reason="stop", prompt_tokens=3, completion_tokens=2, cached_tokens=0)),
    (SchedulerToApi, Failed(req_id=1, error_type="InvalidRequest", message="no")),
    (SchedulerToApi, Failed(req_id=1, error_type="InvalidRequest", message="too long", param="max_tokens")),
    (SchedulerToApi, SchedulerStatus(boot_id="s", ready=True, reason="", running=2)),
    (SchedulerToWorker, RunStep(batch())),
    (WorkerToScheduler, WorkerAlive(boot_id="b", pool=POOL, expert_hits=3)),
    (
        WorkerToScheduler,
        StepDone(
            StepOutput(
                step_id=7,
                req_ids=np.array([3], np.int64),
                token_ids=np.array([42], np.int32),
                logprobs=np.zeros(1, np.float32),
            )
        ),
    ),
    (
        WorkerToScheduler,
        StepDone(
            StepOutput(
                step_id=7,
                req_ids=np.array([3], np.int64),
                token_ids=np.array([2], np.int32),
                logprobs=np.zeros(1, np.float32),
                grammar_failures=((3, "dead"),),
            )
        ),
    ),
    (WorkerToScheduler, StepFailed(step_id=7, message="oom")),
    # speculative decoding: a drafting row (its last two tokens drafts, its state held in snapshot 5) and its answer
    (
        SchedulerToWorker,
        RunStep(
            msgspec.structs.replace(
                batch(), draft_lens=np.array([0, 0], np.int32), hold_state=np.array([-1, 5], np.int32)
            )
        ),
    ),
    (
        WorkerToScheduler,
        StepDone(
            StepOutput(
                step_id=7,
                req_ids=np.array([3], np.int64),
                token_ids=np.array([2], np.int32),
                logprobs=np.zeros(1, np.float32),
                accepted_drafts=np.array([1], np.int32),
            )
        ),
    ),
]


@pytest.mark.parametrize("union,msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(union, msg):
    codec = Codec(union)
    frames = codec.encode(msg)
    assert_same(codec.decode([bytes(f) for f in frames]), msg)


def test_small_arrays_ride_in_the_header_and_large_ones_in_frames_of_their_own():
    frames = Codec(SchedulerToWorker).encode(RunStep(batch()))
    assert len(frames) == 1  # every array of a small step inside frame 0: one frame, one hop's latency
    wide = np.arange(2 * INLINE_ARRAY_BYTES // 4, dtype=np.int32).reshape(2, -1)  # a long context's page table
    step = msgspec.structs.replace(batch(), page_table=wide)
    codec = Codec(SchedulerToWorker)
    frames = codec.encode(RunStep(step))
    assert len(frames) == 2 and bytes(frames[1]) == wide.tobytes()  # zero-copy: the array's own buffer
    got = codec.decode([bytes(f) for f in frames]).batch
    assert np.array_equal(got.page_table, wide) and got.tokens.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "array",
    [
        ["<i4", [2], b"\x00" * 7],  # the bytes do not hold the shape
        ["<i4", [2], "not bytes"],
        ["|O", [1], b"\x00" * 8],  # an object dtype
        ["<i4", [-1], b""],
        [1, "<i4"],
        "x",
    ],
)
def test_a_malformed_inline_array_is_a_wire_error(array):
    head = msgspec.msgpack.encode({"type": "Abort", "req_id": 3})
    raw = msgspec.msgpack.decode(
        Codec(SchedulerToApi).encode(Tokens(np.array([1], np.int64), np.array([2], np.int32)))[0]
    )
    raw["req_ids"] = array
    with pytest.raises(WireError):
        Codec(SchedulerToApi).decode([msgspec.msgpack.encode(raw)])
    assert Codec(ApiToScheduler).decode([head]) == Abort(3)


def test_the_step_contract_is_frozen_and_built_by_keyword():
    step = batch()
    with pytest.raises(AttributeError):
        step.step_id = 8
    with pytest.raises(TypeError):
        StepOutput(7, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32))


def test_decoded_arrays_hold_what_was_sent_not_the_senders_buffers():
    codec = Codec(SchedulerToWorker)
    step = batch()
    frames = codec.encode(RunStep(step))
    step.tokens[:] = 99  # the sender reuses its arrays once the message is encoded
    got = codec.decode([bytes(f) for f in frames]).batch
    assert got.tokens.tolist() == [0, 1, 2, 3, 4] and got.new_requests[0].prompt_token_ids.tolist() == [0, 1, 2, 3]
    assert got.tokens.flags.writeable  # as an array mapped onto a received ZeroMQ frame is


def test_a_message_of_another_union_is_refused():
    frames = Codec(SchedulerToApi).encode(Abort(3))
    with pytest.raises(WireError):
        Codec(SchedulerToApi).decode(frames)


def test_sockets_carry_messages_between_router_dealer_and_push_pull(tmp_path):
    ctx = zmq.Context()
    try:
        router = RouterSocket(ctx, f"ipc://{tmp_path}/r", ApiToScheduler)
        dealer = PeerSocket(ctx, zmq.DEALER, f"ipc://{tmp_path}/r", SchedulerToApi, bind=False, identity=b"api-1")
        pull = PeerSocket(ctx, zmq.PULL, f"ipc://{tmp_path}/p", WorkerToScheduler, bind=True)
        push = PeerSocket(ctx, zmq.PUSH, f"ipc://{tmp_path}/p", None, bind=False)
        dealer.send(Abort(5))
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            got = router.recv()
        assert got == (b"api-1", Abort(5))
        assert router.send(b"api-1", Failed(req_id=5, error_type="x", message="y"))
        assert dealer.recv() == Failed(req_id=5, error_type="x", message="y")
        assert not router.send(b"nobody", ApiHeartbeat())  # a gone peer is reported, not silently dropped
        push.send(StepFailed(step_id=1, message="m"))
        assert pull.recv() == StepFailed(step_id=1, message="m")
        for s in (router, dealer, pull, push):
            s.close()
    finally:
        ctx.term()
