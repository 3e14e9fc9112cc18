"""A StepBatch turned into the device tensors the model's forward reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferry.shared.step import StepBatch


@dataclass
class ForwardBatch:
    """Tensors for one forward over R requests and T new tokens (see shared/step.py for meanings).

    `slot_mapping[t]` is the flat KV row (page * page_size + offset) that token t writes;
    `logits_rows` are the token rows whose logits are needed (the last new token of every
    request that samples). Host copies of the small per-request arrays are kept too, because
    CPU reference paths loop over requests.

    All device arrays are views of one buffer that crosses to the device in a single copy (from
    pinned memory on CUDA): ten small copies were ten launches and ten driver calls per step."""

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
    token_request: torch.Tensor  # int32 [T]: the request of every new token (attention kernels)
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
        arrays = dict(
            tokens=(step.tokens, np.int64), positions=(positions, np.int64), slot_mapping=(slot_mapping, np.int64),
            state_slots=(step.state_slots, np.int64), logits_rows=(logits_rows, np.int64),
            query_start=(qstart, np.int32), query_lens=(qlens, np.int32), context_lens=(clens, np.int32),
            page_table=(step.page_table, np.int32), token_request=(req_of_token, np.int32),
            reset_state=(step.reset_state, np.bool_),
        )  # fmt: skip
        return cls(
            **_to_device_in_one_copy(arrays, torch.device(device)),
            sample_mask=step.sample.astype(bool),
            query_lens_host=qlens.tolist(),
            context_lens_host=clens.tolist(),
            page_size=page_size,
        )


def _to_device_in_one_copy(arrays: dict[str, tuple[np.ndarray, type]], device: torch.device) -> dict[str, torch.Tensor]:
    """{name: device tensor} for {name: (array, numpy dtype)}: packed into one byte buffer (each
    array at an offset aligned to 8 bytes, so every view is aligned for its dtype), copied once."""
    layout, offset = {}, 0
    for name, (a, dtype) in arrays.items():
        a = np.ascontiguousarray(a, dtype=dtype)
        layout[name] = (a, offset)
        offset += -(-a.nbytes // 8) * 8
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = host.numpy()
    for a, start in layout.values():
        staging[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    packed = host.to(device, non_blocking=True)
    out = {}
    for name, (a, start) in layout.items():
        dtype = torch.from_numpy(a[:0]).dtype
        out[name] = packed[start : start + a.nbytes].view(dtype).view(a.shape)
    return out
