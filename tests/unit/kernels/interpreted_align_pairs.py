"""Cases for the alignment's Triton kernels (kernels/align_pairs.py) under TRITON_INTERPRET=1, run in a
child process by test_align_pairs.py (Triton decides at import whether its functions are interpreted).
Each case compares the four kernels' layout with the torch twin's, bit for bit; prints {case: "ok" or
the failure} as JSON."""

from __future__ import annotations

import json
import os
import traceback

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

from tests.triton_interpreter_patch import install as install_interpreter_patch  # noqa: E402

install_interpreter_patch()

from ferry.kernels.align_pairs import CHUNK, MAX_TILES, align_pairs_by_slot, align_pairs_by_slot_triton  # noqa: E402
from ferry.kernels.align_pairs_reference import align_pairs_by_slot_reference, max_aligned_blocks  # noqa: E402

G = torch.Generator().manual_seed(11)


def _same(topk: torch.Tensor, num_slots: int, block_m: int, distinct: int | None = None) -> None:
    got = align_pairs_by_slot_triton(
        topk, num_slots, block_m, max_aligned_blocks(topk.numel(), num_slots, block_m, distinct)
    )
    want = align_pairs_by_slot_reference(topk, num_slots, block_m, distinct, block_starts=True)
    for name, a, b in zip(("sorted_pairs", "block_slot", "block_start"), got, want):
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        if not torch.equal(a, b):
            at = (a != b).nonzero().flatten()[:4].tolist()
            raise AssertionError(f"{name} differs at {at}: {a[at].tolist()} against {b[at].tolist()}")


def _routing(
    tokens: int, top_k: int, num_slots: int, skipped: float = 0.2, skewed: bool = False, dtype=torch.int64
) -> torch.Tensor:
    topk = torch.randint(0, num_slots, (tokens, top_k), generator=G)
    if skewed:  # most pairs on three slots: long runs, many blocks of one slot
        topk = torch.where(torch.rand(tokens, top_k, generator=G) < 0.7, topk % 3, topk)
    topk[torch.rand(tokens, top_k, generator=G) < skipped] = -1
    return topk.to(dtype)


def case_random_shapes_both_dtypes_every_block_size():
    for trial in range(12):  # 12: every (dtype, skewed or not, block size) of trial % 2, % 3 and % 4 once
        tokens, top_k = int(torch.randint(1, 400, (1,), generator=G)), int(torch.randint(1, 9, (1,), generator=G))
        slots = int(torch.randint(1, 700, (1,), generator=G))
        _same(
            _routing(tokens, top_k, slots, skewed=trial % 3 == 0, dtype=(torch.int32, torch.int64)[trial % 2]),
            slots,
            (1, 2, 16, 64)[trial % 4],
        )


def case_several_tiles_rank_across_tiles():
    """More pairs than a tile: each tile's pairs land after the same slot's in the tiles before."""
    for block_m, skewed in ((16, False), (64, True)):
        _same(_routing(700, 8, 37, skewed=skewed), 37, block_m)


def case_tiles_grow_past_the_chunk():
    """Past MAX_TILES x CHUNK pairs a tile takes several chunks (the count's loop, the scatter's ranks)."""
    tokens = MAX_TILES * CHUNK // 8 + 300
    _same(_routing(tokens, 8, 300, skipped=0.05, dtype=torch.int32), 300, 64)


def case_tight_bound_and_one_slot():
    topk = _routing(90, 4, 12, skipped=0.3)
    _same(topk, 12, 16, distinct=int(torch.unique(topk[topk >= 0]).numel()))
    _same(torch.zeros(5, 2, dtype=torch.int64), 1, 16)  # every pair on the one slot


def case_a_slot_past_the_slots_is_left_out():
    """A slot id >= num_slots is left out like -1 (the twin refuses it): the layout of the rest, nothing
    written past the buffers."""
    topk = _routing(60, 4, 10, skipped=0.1)
    wild = topk.clone()
    wild[::7, 1] = 10 + torch.arange(wild[::7].shape[0])  # past the 10 slots
    left_out = torch.where(wild >= 10, -1, wild)
    got = align_pairs_by_slot_triton(wild, 10, 16, max_aligned_blocks(wild.numel(), 10, 16))
    want = align_pairs_by_slot_reference(left_out, 10, 16, None, block_starts=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def case_every_pair_left_out():
    _same(torch.full((33, 4), -1, dtype=torch.int32), 9, 16)


def case_the_dispatch_takes_the_kernels_for_triton_tensors():
    """`align_pairs_by_slot` (FERRY_TRITON_ON_CPU sends CPU tensors down the Triton path here) returns the
    kernels' layout, with and without the block starts."""
    topk = _routing(50, 4, 20)
    a = align_pairs_by_slot(topk, 20, 16, None, block_starts=True)
    b = align_pairs_by_slot_reference(topk, 20, 16, None, block_starts=True)
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(align_pairs_by_slot(topk, 20, 16)) == 2


def main() -> None:
    results = {}
    for name, fn in sorted(globals().items()):
        if name.startswith("case_"):
            try:
                fn()
                results[name[5:]] = "ok"
            except Exception:  # noqa: BLE001 - reported per case
                results[name[5:]] = traceback.format_exc()[-1500:]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
