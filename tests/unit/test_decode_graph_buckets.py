"""Which steps replay as CUDA graphs (DecodeGraphs.bucket_for, decided on the host): a decode step does,
unless a row asks for prompt logprobs, which need the logits of rows a graph does not keep."""

from __future__ import annotations

import numpy as np

from ferry.services.worker.decode_graphs import DecodeGraphs
from ferry.shared.step import StepBatch


def decode_step(rows: int, prompt_logprobs=None) -> StepBatch:
    return StepBatch(
        step_id=1,
        req_ids=np.arange(rows, dtype=np.int64),
        tokens=np.ones(rows, np.int32),
        query_lens=np.ones(rows, np.int32),
        context_lens=np.full(rows, 5, np.int32),
        page_table=np.ones((rows, 1), np.int32),
        linear_state_slots=np.zeros(rows, np.int32),
        reset_linear_state=np.zeros(rows, bool),
        sample=np.ones(rows, bool),
        prompt_logprobs=prompt_logprobs,
    )


def graphs() -> DecodeGraphs:
    g = DecodeGraphs(
        model=None,
        pools=None,
        page_size=16,
        max_model_len=64,
        buckets=[1, 2, 4],
        device="cpu",
        vocab_size=32,
        max_sampled_rows=4,
    )
    g.graphs = {1: object(), 2: object(), 4: object()}  # as if captured
    return g


def test_a_decode_step_takes_its_bucket_unless_a_row_asks_for_prompt_logprobs():
    g = graphs()
    assert g.bucket_for(decode_step(3)) == 4
    assert g.bucket_for(decode_step(3, prompt_logprobs=np.zeros(3, bool))) == 4
    assert g.bucket_for(decode_step(3, prompt_logprobs=np.array([False, True, False]))) is None
