"""Drives a Ferry CausalLM the way the scheduler and executor will: requests get pages (in a
shuffled order, so page tables are not contiguous) and a linear-state slot, and every step is a
StepBatch turned into a ForwardBatch. Test-only: the real allocators live in the scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from ferry.plan import pool_layout as L
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.expert_formats import expert_format_for
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.models import CausalLM, build_model
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import ExpertSlotPool, KvTensorPool, LinearStatePool, Pools, allocate_pool
from ferry.shared.step import StepBatch

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP's spin
# waits made single steps take 100x longer; one thread keeps these tests fast and steady.
torch.set_num_threads(1)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def make_pools(
    spec: ModelSpec,
    dtype: torch.dtype,
    num_pages: int,
    page_size: int,
    num_slots: int,
    device="cpu",
    kv_cache_dtype: str = "auto",
    ring_slice_tokens: int = 0,
) -> Pools:
    """Pools laid out exactly as the planner prices them, every expert resident. `ring_slice_tokens` > 0: the
    sliding groups keep a ring for each of the `num_slots` slots where that is smaller (plan/kv_groups.py), room
    for a sliding slice of that many new tokens."""
    name = DTYPE_NAMES[dtype]
    rings = (num_slots, ring_slice_tokens) if ring_slice_tokens else (0, 0)
    kv_pool = allocate_pool(L.kv_pool_layout(spec, name, num_pages, page_size, kv_cache_dtype, *rings), device)
    kv = KvTensorPool(kv_pool, L.kv_group_layouts(spec, num_pages, page_size, *rings), page_size, dtype=dtype)
    linear_layout = L.linear_state_layout(spec, name, num_slots)
    linear = None
    if linear_layout.tensors:
        linear = LinearStatePool(allocate_pool(linear_layout, device), spec.linear_attention_layers)
    slots = allocate_pool(L.expert_slot_layout(spec, name, spec.total_experts), device)
    experts = ExpertSlotPool(slots, expert_format_for(spec, dtype))
    return Pools(kv, linear, experts)


@dataclass
class _Request:
    slot: int
    pages: list[int] = field(default_factory=list)
    context_len: int = 0


class PagedRunner:
    def __init__(
        self,
        spec: ModelSpec,
        hf_model: torch.nn.Module,
        page_size: int,
        dtype=torch.float32,
        device="cpu",
        num_pages: int | None = None,
        num_slots: int = 8,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        ring_slice_tokens: int = 0,
    ):
        """`ring_slice_tokens` > 0: sliding groups keep rings where smaller (make_pools), their layers running
        over longer steps in slices of that many tokens."""
        self.spec, self.page_size, self.device = spec, page_size, device
        num_pages = num_pages or 16 + 512 // page_size  # room for a few hundred tokens
        self.pools = make_pools(spec, dtype, num_pages, page_size, num_slots, device, kv_cache_dtype, ring_slice_tokens)
        experts = ResidentExperts(self.pools.experts, len(spec.moe_layer_indices), spec.num_experts)
        self.model: CausalLM = build_model(spec, dtype, device, experts)
        self.model.load_weights(hf_model.state_dict().items())
        rng = random.Random(seed)
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is the sentinel
        rng.shuffle(self.free_pages)
        self.free_slots = list(range(1, num_slots + 1))  # slot 0 is the padding slot
        rng.shuffle(self.free_slots)
        self.requests: dict[int, _Request] = {}
        self.step_id = 0

    def release(self, req_id: int) -> None:
        """The request finished: its pages and slot go back, to be handed out next (stale contents and all)."""
        req = self.requests.pop(req_id)
        self.free_pages.extend(reversed(req.pages))
        self.free_slots.append(req.slot)

    def poison(self) -> None:
        """Fill every KV row and linear-state slot with NaN, as if left over from other requests."""
        for name in {t.name for t in self.pools.kv.pool.layout.tensors}:
            self.pools.kv.pool.views[name].fill_(float("nan"))
        if self.pools.linear_state is not None:
            self.pools.linear_state.conv.fill_(float("nan"))
            self.pools.linear_state.recurrent.fill_(float("nan"))

    def owned(self) -> tuple[set[int], set[int]]:
        pages = {p for r in self.requests.values() for p in r.pages}
        return pages, {r.slot for r in self.requests.values()}

    def assert_poisoned_past_padding(self) -> None:
        """After `poison`: every page but the sentinel and the requests' own, every linear-state slot but the
        padding slot and the requests' own, still NaN (padding rows may write the sentinel page and padding slot)."""
        pages, slots = self.owned()
        k_and_v = self.pools.kv.kv
        for page in range(1, k_and_v.shape[2]):
            if page not in pages:
                assert torch.isnan(k_and_v[:, :, page]).all(), f"page {page}"
        if self.pools.linear_state is not None:
            recurrent = self.pools.linear_state.recurrent
            for slot in range(1, recurrent.shape[1]):
                if slot not in slots:
                    assert torch.isnan(recurrent[:, slot]).all(), f"slot {slot}"

    def step(self, items: list[tuple[int, list[int]]], all_rows: bool = True, padding: int = 0) -> list[torch.Tensor]:
        """One forward over (req_id, new tokens) items. float32 logits per item: of every new token
        ([len(tokens), vocab], `forward_all_logits`) or, with all_rows=False, of the last one only
        ([1, vocab], `forward`: the serving path). `padding` appends that many padded rows (one
        token, sentinel page table, padding slot, no sampling), as a fixed-shape executor would."""
        step = self.step_batch(items, padding)
        batch = ForwardBatch.from_step(step, self.page_size, self.device)
        if all_rows:
            logits = self.model.forward_all_logits(batch, self.pools)
            ends = np.cumsum([len(ts) for _, ts in items]).tolist()
            out = [logits[end - len(ts) : end] for (_, ts), end in zip(items, ends)]
        else:
            out = list(self.model.forward(batch, self.pools)[:, None, :])  # padded rows do not sample
        self.advance(items)
        return out

    def step_batch(self, items: list[tuple[int, list[int]]], padding: int = 0) -> StepBatch:
        """The StepBatch of one step over (req_id, new tokens) items, the requests' pages grown for them (`step`'s;
        `advance` moves their contexts past the tokens once the step ran)."""
        reset = []
        for req_id, tokens in items:
            if req_id not in self.requests:
                self.requests[req_id] = _Request(slot=self.free_slots.pop())
                reset.append(True)
            else:
                reset.append(False)
            req = self.requests[req_id]
            while len(req.pages) * self.page_size < req.context_len + len(tokens):
                req.pages.append(self.free_pages.pop())
        reqs = [self.requests[r] for r, _ in items]
        max_pages = max(len(r.pages) for r in reqs) + 1  # one spare column of sentinel entries
        page_table = np.zeros((len(items), max_pages), dtype=np.int32)
        for i, r in enumerate(reqs):
            page_table[i, : len(r.pages)] = r.pages
        page_table = np.concatenate([page_table, np.zeros((padding, max_pages), dtype=np.int32)])
        step = StepBatch(
            step_id=self.step_id,
            req_ids=np.array([r for r, _ in items] + [-1] * padding, dtype=np.int64),
            tokens=np.array([t for _, ts in items for t in ts] + [0] * padding, dtype=np.int32),
            query_lens=np.array([len(ts) for _, ts in items] + [1] * padding, dtype=np.int32),
            context_lens=np.array([r.context_len for r in reqs] + [0] * padding, dtype=np.int32),
            page_table=page_table,
            linear_state_slots=np.array([r.slot for r in reqs] + [0] * padding, dtype=np.int32),
            reset_linear_state=np.array(reset + [False] * padding, dtype=bool),
            sample=np.array([True] * len(items) + [False] * padding, dtype=bool),
        )
        self.step_id += 1
        return step

    def advance(self, items: list[tuple[int, list[int]]]) -> None:
        for req_id, tokens in items:
            self.requests[req_id].context_len += len(tokens)

    def generate(self, req_id: int, prompt: list[int], steps: int, chunks: list[int] | None = None):
        """Prefill (in chunks of the given sizes, the rest in one) then `steps` greedy tokens.
        Returns (prompt logits [P, V], generated tokens, logits of each generated token's step)."""
        chunks = list(chunks or [])
        pieces, pos = [], 0
        for size in chunks:
            pieces.append(prompt[pos : pos + size])
            pos += size
        if pos < len(prompt):
            pieces.append(prompt[pos:])
        prompt_logits = torch.cat([self.step([(req_id, piece)])[0] for piece in pieces])
        tokens, step_logits = [], [prompt_logits[-1]]
        for _ in range(steps):
            tokens.append(int(step_logits[-1].argmax()))
            if len(tokens) < steps:
                step_logits.append(self.step([(req_id, [tokens[-1]])], all_rows=False)[0][-1])
        return prompt_logits, tokens, torch.stack(step_logits)


def hf_greedy(hf_model, prompt: list[int], steps: int):
    """transformers' greedy generate: (tokens, logits of each step [steps, vocab], prompt logits [P, vocab]).
    The explicit attention mask matters: without one, generate masks prompt tokens equal to pad_token_id."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = hf_model(ids).logits[0].float()
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            num_beams=1,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat([l.float() for l in out.logits]), full


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Agreement relative to the logits' scale: |ours - ref| <= rel * max|ref| everywhere."""
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"logits differ by {err:.3e}, more than {rel} x {scale:.3f}"
