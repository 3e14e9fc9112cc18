"""A StepBatch turned into the device tensors the model's forward reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.step import StepBatch


@dataclass
class ForwardBatch:
    """Tensors for one forward over R requests and T new tokens (see shared/step.py for meanings).

    `slot_mapping[t]` is the flat KV row (page * page_size + offset) that token t writes;
    `logits_rows` are the token rows whose logits are needed (the last new token of every
    request that samples). Host copies of the small per-request arrays are kept too, because
    CPU reference paths loop over requests."""

    tokens: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    query_start: torch.Tensor  # int32 [R + 1]
    query_lens: torch.Tensor  # int32 [R]
    context_lens: torch.Tensor  # int32 [R]
    page_table: torch.Tensor  # int32 [R, max_pages]
    slot_mapping: torch.Tensor  # int64 [T]
    state_slots: torch.Tensor  # int64 [R]
    reset_state: torch.Tensor  # bool [R]
    logits_rows: torch.Tensor  # int64 [S]
    sample_mask: np.ndarray  # bool [R] (host)
    query_lens_host: list[int]
    context_lens_host: list[int]
    page_size: int

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def from_step(cls, step: StepBatch, page_size: int, device: torch.device | str) -> "ForwardBatch":
        qlens = step.query_lens.astype(np.int64)
        clens = step.context_lens.astype(np.int64)
        qstart = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qstart[1:])
        # positions of every new token, and the KV row each writes
        req_of_token = np.repeat(np.arange(len(qlens)), qlens)
        positions = clens[req_of_token] + (np.arange(qstart[-1]) - qstart[req_of_token])
        pages = step.page_table[req_of_token, positions // page_size].astype(np.int64)
        slot_mapping = pages * page_size + positions % page_size
        logits_rows = (qstart[1:] - 1)[step.sample.astype(bool)]

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype, non_blocking=True)

        return cls(
            tokens=dev(step.tokens, torch.int64),
            positions=dev(positions, torch.int64),
            query_start=dev(qstart, torch.int32),
            query_lens=dev(qlens, torch.int32),
            context_lens=dev(clens, torch.int32),
            page_table=dev(step.page_table, torch.int32),
            slot_mapping=dev(slot_mapping, torch.int64),
            state_slots=dev(step.state_slots, torch.int64),
            reset_state=dev(step.reset_state.astype(bool), torch.bool),
            logits_rows=dev(logits_rows, torch.int64),
            sample_mask=step.sample.astype(bool),
            query_lens_host=qlens.tolist(),
            context_lens_host=clens.tolist(),
            page_size=page_size,
        )
