"""Host banks: every routed expert's weights in (pinned) host memory, where cache misses are copied from.

One block per MoE layer and weight family: w13 [E, 2I, H] (gate rows then up rows, the slot
pool's layout) and w2 [E, H, I], so one expert is one contiguous copy per family into its slot.
A block per layer rather than one across layers keeps each page-locking call bounded and gives
the progress bar something to count: pinning tens of GB takes seconds to minutes.

Pinned memory is what lets host->device copies run asynchronously on a copy stream at full PCIe
speed; on a machine without CUDA the banks are ordinary memory. Blocks are allocated as ordinary
memory and page-locked in place with cudaHostRegister, because torch's pinned allocator rounds
every block up to a power of two (805 MB of a Qwen3-30B layer would take 1 GiB: +33% host RAM).

Banks are filled expert by expert through `load_expert` (the loader streams one checkpoint
tensor at a time, so RAM never holds a second full copy) or by `fill_dummy` for benchmarks.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from pathlib import Path

import torch
from tqdm import tqdm

from ferry.kernels.expert_copy import copy_experts_triton

# the reserve the banks leave to everything else, and MemAvailable: one owner, shared with the planner
from ferry.plan.host_memory import HOST_RESERVE_BYTES, MEMINFO, mem_available_bytes
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.expert_formats import expert_format_for
from ferry.services.worker.expert_formats.bf16 import Bf16Experts
from ferry.services.worker.offload.host_memory.huge_pages import HUGE_PAGE, advise_huge_pages, huge_pages_wanted
from ferry.services.worker.pools import TORCH_DTYPES
from ferry.shared.errors import FerryError
from ferry.shared.units import format_bytes

# Elements per copy of the dummy fill: large copies run at memcpy speed (see fill_dummy).
DUMMY_CHUNK = 1 << 25
# The dummy weights' scales: dummy_weights.py scales every output projection down the same way.
DUMMY_STD, DUMMY_DOWN_STD = 0.02, 0.002


class HostMemoryError(FerryError):
    """The host has too little RAM for the expert banks."""

    exit_status = 2


def check_host_memory(needed: int, what: str, meminfo: Path = MEMINFO, reserve: int = HOST_RESERVE_BYTES) -> None:
    """Refuse before allocating when `needed` bytes plus the reserve exceed MemAvailable."""
    available = mem_available_bytes(meminfo)
    if available is None or needed + reserve <= available:
        return
    raise HostMemoryError(
        f"{what} need {format_bytes(needed)} of host RAM but only {format_bytes(available)} is available "
        f"(MemAvailable in {meminfo}), and {format_bytes(reserve)} is kept for the rest of the process; "
        f"free host memory or use a machine with at least {format_bytes(needed + reserve - available)} more"
    )


def pinnable_host_block(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool, huge_pages: bool | None = None
) -> torch.Tensor:
    """An uninitialised host block, advised onto huge pages when it spans one (huge_pages.py; `huge_pages`
    None: as FERRY_HOST_HUGE_PAGES says); with `pin`, page-locked in place and mapped for the GPU (marked
    `_ferry_host_registered`: unregister_host_blocks unlocks it before it is freed)."""
    block = torch.empty(shape, dtype=dtype)
    advise = huge_pages_wanted() if huge_pages is None else huge_pages
    if advise and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # no THP here: the block stays on small pages, as it would be
            advise_huge_pages(block, smallest=HUGE_PAGE)
    if not pin:
        return block
    cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostRegister"):  # an old torch: its pinned allocator, rounding and all
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # 1 | 2: cudaHostRegisterPortable | cudaHostRegisterMapped: the GPU reads the banks itself (kernels/expert_copy.py)
    err = int(cudart.cudaHostRegister(block.data_ptr(), block.nbytes, 3))
    if err != 0:
        raise HostMemoryError(
            f"page-locking {format_bytes(block.nbytes)} of host memory for the expert banks "
            f"failed (cudaError {err}); check `ulimit -l` and the container's memlock limit"
        )
    block._ferry_host_registered = True
    return block


def unregister_host_blocks(blocks: list[torch.Tensor]) -> None:
    """Unlock blocks that pinnable_host_block page-locked."""
    if not blocks:
        return
    cudart = torch.cuda.cudart()
    for block in blocks:
        cudart.cudaHostUnregister(block.data_ptr())


class HostBanks:
    """Per MoE layer: w13[layer] [E, 2I, H] and w2[layer] [E, H, I], pinned when CUDA is present; for
    a quantized expert format (services/worker/expert_formats) one byte row per expert and family,
    [E, B13] and [E, B2], exactly as the slots hold them."""

    packed = False  # rows as the slots hold them (PackedHostBanks: 12 bits a value)

    @staticmethod
    def holds(fmt) -> bool:
        """Any expert format's rows, as its slots hold them."""
        return True

    def __init__(self, w13: list[torch.Tensor], w2: list[torch.Tensor], fmt=None):
        if not w13 or len(w13) != len(w2):
            raise ValueError(f"need one w13 and one w2 block per MoE layer, got {len(w13)} and {len(w2)}")
        if fmt is None:
            if w13[0].dim() != 3:
                raise ValueError("host banks of quantized expert rows need their expert format (fmt)")
            fmt = Bf16Experts(w13[0].shape[2], w2[0].shape[2], w13[0].dtype)
        self.format = fmt
        self.w13 = w13
        self.w2 = w2
        self.num_layers = len(w13)
        self.num_experts = w13[0].shape[0]
        self.hidden_size, self.intermediate_size = fmt.hidden, fmt.inter
        self.dtype = w13[0].dtype
        self.pinned = bool(w13[0].is_pinned())
        registered = [t for t in (*w13, *w2) if getattr(t, "_ferry_host_registered", False)]
        if registered:  # unlock the pages before the blocks are freed
            weakref.finalize(self, unregister_host_blocks, registered)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        pin: bool | None = None,
        progress: bool = True,
        meminfo: Path = MEMINFO,
        fmt=None,
        huge_pages: bool | None = None,
    ) -> "HostBanks":
        """Uninitialised banks of rows in `fmt` (default: `dtype`'s plain rows); `pin=None` pins
        exactly when CUDA is available; `huge_pages` advises the blocks onto huge pages or not (None: as
        FERRY_HOST_HUGE_PAGES says, huge_pages.py)."""
        pin = torch.cuda.is_available() if pin is None else pin
        fmt = fmt if fmt is not None else Bf16Experts(hidden_size, intermediate_size, dtype)
        (shape13, dtype13), (shape2, dtype2) = fmt.row_shapes()
        per_expert = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in fmt.row_shapes())
        check_host_memory(
            per_expert * num_experts * num_layers,
            f"host banks for {num_layers} MoE layers x {num_experts} experts "
            f"({format_bytes(per_expert)} each, {fmt.name})",
            meminfo,
        )
        w13, w2 = [], []
        for _ in tqdm(
            range(num_layers),
            desc="pinning expert banks" if pin else "allocating expert banks",
            unit="layer",
            disable=not progress,
        ):
            w13.append(pinnable_host_block((num_experts, *shape13), dtype13, pin, huge_pages))
            w2.append(pinnable_host_block((num_experts, *shape2), dtype2, pin, huge_pages))
        return cls(w13, w2, fmt)

    @classmethod
    def for_model(cls, spec: ModelSpec, dtype: str, **kwargs) -> "HostBanks":
        fmt = expert_format_for(spec, TORCH_DTYPES[dtype])
        return cls.allocate(
            len(spec.moe_layer_indices),
            spec.num_experts,
            spec.hidden_size,
            spec.moe_intermediate_size,
            TORCH_DTYPES[dtype],
            fmt=fmt,
            **kwargs,
        )

    @property
    def slot_rows(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one expert's w13 row as the slots receive it."""
        return tuple(self.w13[0].shape[1:]), self.dtype

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (both families): what one miss copies."""
        return self.w13[0][0].nbytes + self.w2[0][0].nbytes

    @property
    def nbytes(self) -> int:
        return self.expert_nbytes * self.num_experts * self.num_layers

    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        """Copy one expert in checkpoint layout (gate, up [I, H]; down [H, I]; QuantizedWeights for a
        quantized format) into its bank rows, in the banks' format."""
        self.format.write_expert(
            self.w13[moe_layer][expert],
            self.w2[moe_layer][expert],
            gate,
            up,
            down,
            f"MoE layer {moe_layer} expert {expert}",
            *(() if bias is None else (bias,)),  # a format without biases takes no such argument
        )

    def fill_dummy(
        self, seed: int = 0, std: float = DUMMY_STD, down_std: float = DUMMY_DOWN_STD, progress: bool = True
    ) -> None:
        """Deterministic random weights at memory-copy speed, for benchmarks of 30B shapes (DummyPattern;
        a quantized format fills its own rows)."""
        pattern = None if self.format.quantized else DummyPattern(self.dtype, seed, std, down_std)
        for layer in tqdm(
            range(self.num_layers), desc="filling dummy expert banks", unit="layer", disable=not progress
        ):
            if pattern is None:
                self.format.fill_dummy_layer(self.w13[layer], self.w2[layer], layer, seed)
            else:
                pattern.fill(self.w13[layer], self.w2[layer])

    # ---- copies into device slots ----------------------------------------------------------------
    def seal(self) -> None:
        """Nothing to finish: the rows are what the slots receive (see PackedHostBanks.seal)."""

    def expert(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13 [2I, H], w2 [H, I]) as the slots receive them."""
        return self.w13[moe_layer][expert], self.w2[moe_layer][expert]

    def copy_experts(
        self,
        moe_layer: int,
        pairs: list[tuple[int, int]],
        dst13: torch.Tensor,
        dst2: torch.Tensor,
        non_blocking: bool = False,
        **tuning,
    ) -> None:
        """dst13[s], dst2[s] = expert e's rows for each (e, s) listed on the host, with the copy
        engine on the current stream: one copy per weight family and run of consecutive experts
        going to consecutive slots (`tuning`, a kernel's grid for packed banks, does not apply)."""
        bank13, bank2 = self.w13[moe_layer], self.w2[moe_layer]
        for e, s, n in _runs(pairs):
            dst13[s : s + n].copy_(bank13[e : e + n], non_blocking=non_blocking)
            dst2[s : s + n].copy_(bank2[e : e + n], non_blocking=non_blocking)

    def copy_listed(
        self,
        moe_layer: int,
        dst13: torch.Tensor,
        dst2: torch.Tensor,
        misses: torch.Tensor,
        count: torch.Tensor,
        **tuning,
    ) -> None:
        """The first count[0] (expert, slot) rows of `misses`, both on the device, copied by the
        GPU itself (kernels/expert_copy.py): no host synchronisation, graph-capturable. Where the
        format's rows differ by layer, only the bytes this layer's experts fill cross."""
        used = self.format.layer_row_nbytes(moe_layer) if self.format.views_per_layer else None
        copy_experts_triton(
            self.w13[moe_layer], self.w2[moe_layer], dst13, dst2, misses, count, used_bytes=used, **tuning
        )


class DummyPattern:
    """Deterministic random expert weights at memory-copy speed, layer after layer.

    Drawing tens of GB of normal samples would take minutes, and tens of thousands of
    expert-sized copies run far below memcpy speed on a busy host; instead each family draws
    one seeded pattern of DUMMY_CHUNK elements and every layer block is filled with large
    copies of windows of it, each window at its own offset. Experts differ from each other
    (other windows), a run repeats exactly, and the extra memory is one pattern. The down
    projections get `down_std`: the residual stream stays dominated by the token, so routing
    changes with every token. Both bank formats fill through this, so they hold the same bits."""

    def __init__(self, dtype: torch.dtype, seed: int, std: float, down_std: float):
        gen = torch.Generator().manual_seed(seed)
        self.stride, self.offsets = 97, 4099  # window offsets: stride * (a number below `offsets`, prime)
        pattern = torch.randn(DUMMY_CHUNK + self.stride * self.offsets, generator=gen, dtype=dtype).mul_(std)
        self.patterns = (pattern, pattern * (down_std / std))
        self.chunk_index = 0

    def fill(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """The next layer's w13 [E, 2I, H] and w2 [E, H, I] blocks."""
        layer = self.next_layer(w13.numel(), w2.numel())
        layer.fill(w13, w2, 0, 0)

    def next_layer(self, numel13: int, numel2: int) -> "DummyLayer":
        """The next layer (of blocks of these sizes), to fill part by part: the same bits as `fill`."""
        chunks13 = -(-numel13 // DUMMY_CHUNK)
        layer = DummyLayer(self, self.chunk_index, self.chunk_index + chunks13)
        self.chunk_index += chunks13 + -(-numel2 // DUMMY_CHUNK)
        return layer

    def copy_range(self, out: torch.Tensor, family: int, first_chunk: int, start: int) -> None:
        """out (flat) = the values at positions start.. of a block of `family` (0: w13, 1: w2) whose
        first chunk is numbered `first_chunk`: each chunk of DUMMY_CHUNK values is a window of the
        family's pattern at the chunk's own offset."""
        pattern, flat, done = self.patterns[family], out.view(-1), 0
        while done < flat.numel():
            chunk, within = divmod(start + done, DUMMY_CHUNK)
            n = min(DUMMY_CHUNK - within, flat.numel() - done)
            offset = self.stride * (((first_chunk + chunk) * 1031) % self.offsets) + within
            flat[done : done + n].copy_(pattern[offset : offset + n])
            done += n


class DummyLayer:
    """One layer of a DummyPattern, filled in parts (PackedHostBanks packs a few experts at a time
    through a small buffer instead of a whole plain layer)."""

    def __init__(self, pattern: DummyPattern, chunk13: int, chunk2: int):
        self.pattern, self.chunk13, self.chunk2 = pattern, chunk13, chunk2

    def fill(self, w13: torch.Tensor, w2: torch.Tensor, start13: int, start2: int) -> None:
        """w13 and w2 = the layer's values from flat positions start13 and start2 of its blocks."""
        self.pattern.copy_range(w13, 0, self.chunk13, start13)
        self.pattern.copy_range(w2, 1, self.chunk2, start2)


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(expert, slot) pairs as (first expert, first slot, count) runs of consecutive experts into
    consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for e, s in pairs:
        if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((e, s, 1))
    return runs
