"""A graph decode step's inputs and results through pinned rings (services/worker/decode_io.py), and the
graph's own feed and sampling (decode_graphs.py), checked on the CPU: the ring writes exactly the bytes
ForwardBatch.from_step packs for the same padded step, the graph's feed puts the previous step's samples
where the contract says, and the graph's sampling draws what the sampler's `choose` draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferry.services.worker.decode_graphs import DecodeGraphs
from ferry.services.worker.decode_io import FORWARD_FIELDS, DecodeInputs, DecodeResults, decode_layout, forward_bytes
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.sampler import Sampler
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest, StepBatch

PAGE, MAX_PAGES, V = 4, 6, 40
FORWARD_NAMES = [name for name, _, _ in FORWARD_FIELDS]


def decode_step(rng, rows: int, width: int) -> StepBatch:
    context = rng.integers(0, width * PAGE, rows).astype(np.int32)
    table = np.zeros((rows, width), np.int32)
    for i, c in enumerate(context):
        used = c // PAGE + 1
        table[i, :used] = rng.integers(1, 50, used)
    return StepBatch(
        step_id=1,
        req_ids=np.arange(rows, dtype=np.int64) + 10,
        tokens=rng.integers(0, V, rows).astype(np.int32),
        query_lens=np.ones(rows, np.int32),
        context_lens=context,
        page_table=table,
        linear_state_slots=rng.integers(1, 9, rows).astype(np.int32),
        reset_linear_state=np.zeros(rows, bool),
        sample=np.ones(rows, bool),
    )


def packed_by_from_step(step: StepBatch, rows: int) -> np.ndarray:
    into = torch.zeros(forward_bytes(rows, MAX_PAGES), dtype=torch.uint8)
    ForwardBatch.from_step(step, PAGE, "cpu", pad_to=rows, max_pages=MAX_PAGES, into=into)
    return into.numpy().copy()


def test_the_ring_writes_the_bytes_from_step_packs_step_after_step():
    """Steps of shrinking and growing batches and page tables through the same ring slots: what an earlier
    step left in a slot (wider page tables, more rows) never shows in a later step's bytes."""
    rng = np.random.default_rng(0)
    rows = 4
    inputs = DecodeInputs(rows, MAX_PAGES, PAGE, torch.device("cpu"), depth=2)
    device = torch.zeros(inputs.nbytes, dtype=torch.uint8)
    layout, _ = decode_layout(rows, MAX_PAGES)
    for r, width in [(4, 6), (1, 2), (3, 5), (2, 1), (4, 3), (0, 1)]:
        step = decode_step(rng, r, width) if r else StepBatch.empty(step_id=2)
        inputs.upload(step, device)
        want = packed_by_from_step(step, rows)
        for name in FORWARD_NAMES:  # the arrays' bytes (from_step leaves the alignment gaps unwritten)
            offset, dtype, shape = layout[name]
            end = offset + int(np.prod(shape)) * dtype.itemsize
            assert np.array_equal(device.numpy()[offset:end], want[offset:end]), (r, width, name)


def test_the_tail_carries_feed_sources_and_sampling_parameters_with_padding_rows_greedy_and_unfed():
    layout, total = decode_layout(4, MAX_PAGES)
    inputs = DecodeInputs(4, MAX_PAGES, PAGE, torch.device("cpu"))
    device = torch.zeros(total, dtype=torch.uint8)
    inputs.upload(
        decode_step(np.random.default_rng(1), 2, 2),
        device,
        feed_src=np.array([1, -1]),
        inv_temperature=[0.5, 1.0],
        noise_rows=[0, -1],
    )

    def field(name):
        offset, dtype, shape = layout[name]
        return device.numpy()[offset : offset + int(np.prod(shape)) * dtype.itemsize].view(dtype)

    assert field("feed_src").tolist() == [1, -1, -1, -1]
    assert field("inv_temperature").tolist() == [0.5, 1.0, 1.0, 1.0]
    assert field("noise_rows").tolist() == [0, -1, -1, -1]
    inputs.upload(decode_step(np.random.default_rng(2), 3, 2), device)  # no feed, every row greedy
    assert field("feed_src").tolist() == [-1] * 4 and field("noise_rows").tolist() == [-1] * 4


def test_a_step_larger_than_its_bucket_is_refused():
    inputs = DecodeInputs(2, MAX_PAGES, PAGE, torch.device("cpu"))
    device = torch.zeros(inputs.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        inputs.upload(decode_step(np.random.default_rng(3), 3, 2), device)
    with pytest.raises(ValueError, match="static input buffer"):
        inputs.upload(decode_step(np.random.default_rng(3), 1, 2), device[:-16])


def test_results_come_back_as_tokens_and_logprobs():
    results = DecodeResults(3, torch.device("cpu"))
    packed = torch.cat(
        [
            torch.tensor([7, 1, 9], dtype=torch.int32).view(torch.uint8),
            torch.tensor([-0.5, -1.0, -2.0]).view(torch.uint8),
        ]
    )
    (tokens, logprobs), event = results.fetch(packed, 2)
    assert tokens.tolist() == [7, 1] and logprobs.tolist() == [-0.5, -1.0] and event is None


def cpu_graphs(rows: int) -> tuple[DecodeGraphs, object]:
    graphs = DecodeGraphs(
        model=None,
        pools=None,
        page_size=PAGE,
        max_model_len=PAGE * MAX_PAGES,
        buckets=[rows],
        device="cpu",
        vocab_size=V,
        max_sampled_rows=8,
    )
    return graphs, graphs._bucket(rows)


def test_the_graph_feeds_rows_from_the_previous_steps_samples():
    graphs, g = cpu_graphs(4)
    graphs.keep_samples(torch.tensor([31, 32, 33]))  # the step before sampled three rows
    step = decode_step(np.random.default_rng(4), 3, 2)
    g.staging.upload(step, g.inputs, feed_src=np.array([2, -1, 0]))
    graphs._feed(g)
    assert g.batch.tokens.tolist() == [33, int(step.tokens[1]), 31, 0]


@pytest.mark.parametrize("temperatures", [[0.0, 0.0, 0.0], [0.7, 0.0, 1.3], [1.0, 1.0, 1.0]])
def test_the_graphs_sampling_draws_what_choose_draws(temperatures):
    """The same seeded requests sampled twice, once by `choose` and once by the graph's tail from what
    `graph_sampling` drew and wrote: the same tokens and log-probabilities, step after step."""
    rows, ids = 4, [10, 11, 12]

    def sampler() -> Sampler:
        s = Sampler(V, "cpu", seed=5)
        for rid, t in zip(ids, temperatures):
            s.add_request(
                NewRequest(
                    req_id=rid,
                    prompt_token_ids=np.array([1], np.int32),
                    sampling=SamplingParams(temperature=t, seed=rid),
                )
            )
        return s

    eager, in_graph = sampler(), sampler()
    graphs, g = cpu_graphs(rows)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(rows, V, generator=gen) * 3
        want_tokens, want_logprobs = eager.choose(ids, logits[:3])
        inv_t, noise_rows = in_graph.graph_sampling(ids, graphs.noise)
        g.staging.upload(decode_step(np.random.default_rng(5), 3, 2), g.inputs, None, inv_t, noise_rows)
        packed = graphs._sample(g, logits)
        (tokens, logprobs), _ = g.results.fetch(packed, 3)
        assert tokens.tolist() == want_tokens.tolist()
        assert torch.allclose(logprobs, want_logprobs)
        assert graphs.last_tokens[:3].tolist() == want_tokens.tolist()


def test_only_plain_sampling_runs_in_the_graph():
    s = Sampler(V, "cpu", seed=0)
    cases = {
        1: SamplingParams(),
        2: SamplingParams(temperature=0.0, top_p=0.5),  # greedy: filters unused
        3: SamplingParams(top_p=0.9),
        4: SamplingParams(logprobs=2),
        5: SamplingParams(presence_penalty=0.5),
        6: SamplingParams(logit_bias=((3, 1.0),)),
        7: SamplingParams(top_k=V),
    }  # top_k of the whole vocabulary: no filter
    for rid, p in cases.items():
        s.add_request(NewRequest(req_id=rid, prompt_token_ids=np.array([1], np.int32), sampling=p))
    noise = torch.ones(2, V)
    assert s.graph_sampling([1, 2], noise) == ([1.0, 1.0], [0, -1])
    assert s.graph_sampling([7], noise) is not None
    for rid in (3, 4, 5, 6):
        assert s.graph_sampling([1, rid], noise) is None, rid
