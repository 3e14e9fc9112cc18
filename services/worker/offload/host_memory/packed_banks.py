"""Host banks of packed experts: every routed expert in 12 bits a value, losslessly (kernels/expert_pack.py).

The same role as host_banks.py's plain banks (misses are copied from here into device slots, which
hold plain bf16), with a quarter fewer bytes in host RAM and on PCIe: the decode's copies are
paced by PCIe, so a quarter fewer bytes is up to a third more speed.

Per MoE layer: `lo` [E, V] uint8 and `hi` [E, V // 2] uint8 (V = 3 I H values, w13 then w2),
`base` [E, 2] int32, and the escapes (values outside an expert's exponent window, kept whole).
Every block is page-locked and mapped (cudaHostRegisterMapped), so the GPU unpacks straight from
here: `copy_listed` for a list held on the device (graph-safe), `copy_experts` for one the host
holds (the list goes up in one small copy, then the same kernel). Without CUDA (tests) the same
bits come from the reference unpacker, or through the Triton interpreter.

Experts are packed on the GPU as they load (`load_expert`, `fill_dummy`): a few launches per
expert, in groups whose temporaries stay under PACK_TEMP_BYTES (freed device memory the plan's
workspace covers: nothing else runs on the device while experts load; an expert too large for
that is packed on the CPU). The escapes are gathered on the host while loading and laid out
once, by `seal` (the store's `preload` calls it). The layout is final from the first copy on:
copies, and CUDA graphs captured around them, hold its addresses, so a later load is refused.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import structlog
import torch
from tqdm import tqdm

from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_epilogue import SILU_AND_MUL, ExpertActivation
from ferry.kernels.expert_pack import pack_experts, unpack_expert_reference, unpack_experts_triton
from ferry.plan.expert_formats import bf16_packed as P
from ferry.plan.host_memory import MEMINFO
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.expert_formats import expert_epilogue
from ferry.services.worker.expert_formats.bf16_packed import Bf16PackedExperts
from ferry.services.worker.expert_formats.expert_shapes import check_expert_shapes
from ferry.services.worker.offload.host_memory.host_banks import (
    DUMMY_DOWN_STD,
    DUMMY_STD,
    DummyPattern,
    check_host_memory,
    pinnable_host_block,
    unregister_host_blocks,
)
from ferry.shared.units import format_bytes

log = structlog.get_logger("worker.offload")

PACK_TEMP_BYTES = 256 << 20  # the packer's device temporaries at most (freed memory the workspace covers)
PACK_BYTES_PER_VALUE = 24  # pack_experts' peak temporaries a value: the input, its int32 bits and a few int32 steps


class PackedHostBanks:
    """Per MoE layer: lo[layer], hi[layer], base[layer] and the escapes; see the module docstring. They hold
    the bf16-packed expert format (`format`)."""

    packed = True

    @staticmethod
    def holds(fmt) -> bool:
        """Whether these banks keep experts of worker expert format `fmt`."""
        return isinstance(fmt, Bf16PackedExperts)

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        pin: bool,
        progress: bool = True,
        meminfo: Path = MEMINFO,
        huge_pages: bool | None = None,
        activation: ExpertActivation = SILU_AND_MUL,
    ):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.dtype = torch.bfloat16
        # the experts' activation rides on the format: the host's kernel and reader compute it from these banks
        self.format = Bf16PackedExperts(hidden_size, intermediate_size, activation=activation)
        self.pinned, self.meminfo = pin, meminfo
        self.v13, self.v2 = 2 * intermediate_size * hidden_size, hidden_size * intermediate_size
        v = self.v13 + self.v2
        self.lo, self.hi, self.base = [], [], []
        for _ in tqdm(
            range(num_layers),
            desc="pinning packed expert banks" if pin else "allocating packed expert banks",
            unit="layer",
            disable=not progress,
        ):
            self.lo.append(pinnable_host_block((num_experts, v), torch.uint8, pin, huge_pages))
            self.hi.append(pinnable_host_block((num_experts, v // 2), torch.uint8, pin, huge_pages))
            self.base.append(pinnable_host_block((num_experts, 2), torch.int32, pin, huge_pages))
        # escapes: per layer and expert (positions int32, bits int16) while loading; laid out by seal()
        empty = (torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int16))
        self._escapes = [[empty] * num_experts for _ in range(num_layers)]
        self._escape_count = 0  # kept as experts load: expert_nbytes is read every step
        self.esc_offsets: list[torch.Tensor] = []
        self.esc_index: list[torch.Tensor] = []
        self.esc_bits: list[torch.Tensor] = []
        self._sealed = False
        self._registered = [t for t in (*self.lo, *self.hi, *self.base) if getattr(t, "_ferry_host_registered", False)]
        weakref.finalize(self, unregister_host_blocks, self._registered)  # the list grows as seal() registers escapes
        self._copied = False  # set by the first copy: the escape layout is final from then on

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.bfloat16,
        pin: bool | None = None,
        progress: bool = True,
        meminfo: Path = MEMINFO,
        huge_pages: bool | None = None,
        activation: ExpertActivation = SILU_AND_MUL,
    ) -> "PackedHostBanks":
        """Uninitialised banks (with room for escapes checked); `pin=None` pins exactly when CUDA is available;
        `huge_pages` advises the planes onto huge pages or not (None: as FERRY_HOST_HUGE_PAGES says);
        `activation`: the experts' (the model's: `for_model`)."""
        if dtype != torch.bfloat16:
            raise ValueError(f"packed expert banks hold bf16 experts, not {dtype}")
        pin = torch.cuda.is_available() if pin is None else pin
        needed = P.packed_bank_bytes(num_layers, num_experts, 3 * intermediate_size * hidden_size)
        check_host_memory(
            needed,
            f"packed host banks for {num_layers} MoE layers x {num_experts} experts "
            f"({format_bytes(needed // max(1, num_layers * num_experts))} each)",
            meminfo,
        )
        return cls(
            num_layers, num_experts, hidden_size, intermediate_size, pin, progress, meminfo, huge_pages, activation
        )

    @classmethod
    def for_model(cls, spec: ModelSpec, dtype: str, **kwargs) -> "PackedHostBanks":
        if dtype != "bfloat16":
            raise ValueError(f"packed expert banks hold bf16 experts, not {dtype}")
        epilogue = expert_epilogue(spec)  # packed banks hold no biases: only the activation can differ
        activation = SILU_AND_MUL if epilogue is None else epilogue[1]
        return cls.allocate(
            len(spec.moe_layer_indices),
            spec.num_experts,
            spec.hidden_size,
            spec.moe_intermediate_size,
            activation=activation,
            **kwargs,
        )

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def escape_count(self) -> int:
        return self._escape_count

    @property
    def slot_rows(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one expert's w13 row as the slots receive it (unpacked)."""
        return (2 * self.intermediate_size, self.hidden_size), self.dtype

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert's copy moves, on average (lo, hi, base and its share of the escapes)."""
        experts = self.num_layers * self.num_experts
        escapes = self.escape_count * P.PACKED_ESCAPE_BYTES
        return self.lo[0][0].nbytes + self.hi[0][0].nbytes + self.base[0][0].nbytes + escapes // experts

    @property
    def nbytes(self) -> int:
        fixed = sum(t.nbytes for t in (*self.lo, *self.hi, *self.base))
        return fixed + self.escape_count * P.PACKED_ESCAPE_BYTES + self.num_layers * (self.num_experts + 1) * 8

    # ---- loading -------------------------------------------------------------------------------
    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        """Pack one expert in checkpoint layout (gate, up [I, H]; down [H, I]) into its rows. Packed banks hold
        no biases: the plan keeps experts with biases in plain banks (plan/expert_formats/registry.py)."""
        if bias is not None:
            raise ValueError(f"MoE layer {moe_layer} expert {expert} has biases, which packed banks do not hold")
        check_expert_shapes(
            f"MoE layer {moe_layer} expert {expert}", gate, up, down, self.intermediate_size, self.hidden_size
        )
        dev = self._packing_device()
        w13 = torch.cat([gate.to(dev, torch.bfloat16), up.to(dev, torch.bfloat16)]).unsqueeze(0)
        self._pack(moe_layer, expert, w13, down.to(dev, torch.bfloat16).unsqueeze(0))

    def fill_dummy(
        self, seed: int = 0, std: float = DUMMY_STD, down_std: float = DUMMY_DOWN_STD, progress: bool = True
    ) -> None:
        """The plain banks' dummy weights (DummyPattern: the same bits), a group of experts at a
        time through a buffer of the packer's size (not a whole plain layer: host RAM the plan
        does not price)."""
        i, h, e = self.intermediate_size, self.hidden_size, self.num_experts
        device = self._packing_device()
        group = min(e, max(1, PACK_TEMP_BYTES // (PACK_BYTES_PER_VALUE * (self.v13 + self.v2))))
        pin = self.pinned and device.type == "cuda"  # pinned: it crosses to the packer fast
        w13 = pinnable_host_block((group, 2 * i, h), torch.bfloat16, pin)
        w2 = pinnable_host_block((group, h, i), torch.bfloat16, pin)
        try:
            pattern = DummyPattern(torch.bfloat16, seed, std, down_std)
            for layer in tqdm(
                range(self.num_layers), desc="filling packed dummy expert banks", unit="layer", disable=not progress
            ):
                values = pattern.next_layer(e * self.v13, e * self.v2)
                for first in range(0, e, group):
                    n = min(group, e - first)
                    values.fill(w13[:n], w2[:n], first * self.v13, first * self.v2)
                    # _pack waits for its escape counts: the buffer has crossed when it returns
                    self._pack(
                        layer, first, w13[:n].to(device, non_blocking=True), w2[:n].to(device, non_blocking=True)
                    )
        finally:
            unregister_host_blocks([t for t in (w13, w2) if getattr(t, "_ferry_host_registered", False)])

    def _packing_device(self) -> torch.device:
        """The GPU when one expert's packing temporaries fit in PACK_TEMP_BYTES, else the CPU (the
        same bits, slower): loading never takes device memory the plan did not price."""
        fits = PACK_BYTES_PER_VALUE * (self.v13 + self.v2) <= PACK_TEMP_BYTES
        return torch.device("cuda") if torch.cuda.is_available() and fits else torch.device("cpu")

    def _pack(self, layer: int, first: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Experts first.. of `layer` from bf16 w13 [n, 2I, H], w2 [n, H, I] on the packing device."""
        if self._copied:  # a reload would move escapes that copies (and captured CUDA graphs) read
            raise RuntimeError(
                f"packed host banks: MoE layer {layer} expert {first} is loaded after the banks' "
                "first copy into the device slots; load every expert before copying from them"
            )
        p = pack_experts(w13, w2)
        n = w13.shape[0]
        self.lo[layer][first : first + n].copy_(p["lo"])
        self.hi[layer][first : first + n].copy_(p["hi"])
        self.base[layer][first : first + n].copy_(p["base"])
        counts = p["counts"].tolist()
        index, bits = p["esc_index"].cpu(), p["esc_bits"].cpu()
        start = 0
        for k, c in enumerate(counts):
            self._escape_count += c - len(self._escapes[layer][first + k][0])
            self._escapes[layer][first + k] = (index[start : start + c].clone(), bits[start : start + c].clone())
            start += c
        self._sealed = False

    def seal(self) -> None:
        """Lay the escapes out per layer (offsets [E + 1], positions, bits), page-locked and mapped
        for the unpacking kernel. Each layer's loose lists become views of its blocks as it goes,
        so sealing holds one layer's escapes twice at most. Again after a later load (before the
        first copy: `_pack` refuses loads after it)."""
        if self._sealed:
            return
        allowance = P.packed_escape_allowance(self.v13 + self.v2) * self.num_layers * self.num_experts
        if self.escape_count > allowance:  # the plan priced fewer: the host RAM check below is the guard
            log.warning(
                "packed_banks_escapes_above_plan",
                escapes=self.escape_count,
                planned=allowance,
                extra_bytes=(self.escape_count - allowance) * P.PACKED_ESCAPE_BYTES,
            )
        # what sealing adds on top of the loose lists: one layer's escapes (the reserve was checked with the banks)
        largest = max(sum(len(i) for i, _ in layer) for layer in self._escapes)
        check_host_memory(
            largest * P.PACKED_ESCAPE_BYTES,
            f"laying out one layer's {largest:,} escaped values",
            self.meminfo,
            reserve=0,
        )
        old = [
            t
            for t in (*self.esc_offsets, *self.esc_index, *self.esc_bits)
            if getattr(t, "_ferry_host_registered", False)
        ]
        unregister_host_blocks(old)  # no copy has read them (a load after one is refused)
        self._registered[:] = [t for t in self._registered if not any(t is o for o in old)]
        self.esc_offsets, self.esc_index, self.esc_bits = [], [], []
        for layer in self._escapes:
            counts = torch.tensor([len(i) for i, _ in layer], dtype=torch.int64)
            n = int(counts.sum())
            offsets = pinnable_host_block((self.num_experts + 1,), torch.int64, self.pinned)
            offsets[0] = 0
            torch.cumsum(counts, 0, out=offsets[1:])
            index = pinnable_host_block(
                (max(1, n),), torch.int32, self.pinned
            )  # one unread element when there are none
            bits = pinnable_host_block((max(1, n),), torch.int16, self.pinned)
            if n:
                torch.cat([i for i, _ in layer], out=index[:n])
                torch.cat([b for _, b in layer], out=bits[:n])
            ends = offsets.tolist()
            layer[:] = [(index[ends[e] : ends[e + 1]], bits[ends[e] : ends[e + 1]]) for e in range(self.num_experts)]
            self.esc_offsets.append(offsets)
            self.esc_index.append(index)
            self.esc_bits.append(bits)
            self._registered += [t for t in (offsets, index, bits) if getattr(t, "_ferry_host_registered", False)]
        self._sealed = True

    # ---- copies into device slots ----------------------------------------------------------------
    def expert(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13 [2I, H], w2 [H, I]) unpacked on the host, as the slots receive them."""
        index, bits = self._escapes[moe_layer][expert]
        flat = unpack_expert_reference(
            self.lo[moe_layer][expert], self.hi[moe_layer][expert], self.base[moe_layer][expert], index, bits, self.v13
        )
        i, h = self.intermediate_size, self.hidden_size
        return flat[: self.v13].view(2 * i, h), flat[self.v13 :].view(h, i)

    def escapes(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's escapes: positions (int32, into its V values) and their bf16 bits (int16),
        loose lists while loading, views of the sealed layout after (the host's expert readers)."""
        return self._escapes[moe_layer][expert]

    def copy_experts(
        self,
        moe_layer: int,
        pairs: list[tuple[int, int]],
        dst13: torch.Tensor,
        dst2: torch.Tensor,
        non_blocking: bool = False,
        **tuning,
    ) -> None:
        """dst13[s], dst2[s] = expert e for each (e, s) listed on the host: the list crosses in one
        small copy on the current stream, then the unpacking kernel runs (`non_blocking` is moot:
        kernels never block the host; `tuning`: its grid, kernels/expert_pack.py)."""
        if not pairs:
            return
        self._copied = True
        if not use_triton(dst13):  # CPU: the reference's bits
            for e, s in pairs:
                w13, w2 = self.expert(moe_layer, e)
                dst13[s].copy_(w13)
                dst2[s].copy_(w2)
            return
        listed = torch.tensor(pairs, dtype=torch.int32)
        if dst13.is_cuda:
            listed = listed.pin_memory().to(dst13.device, non_blocking=True)
        self.copy_listed(moe_layer, dst13, dst2, listed, len(pairs), **tuning)

    def copy_listed(
        self,
        moe_layer: int,
        dst13: torch.Tensor,
        dst2: torch.Tensor,
        misses: torch.Tensor,
        count: torch.Tensor | int,
        **tuning,
    ) -> None:
        """The first `count` (expert, slot) rows of `misses` (on the device; `count` an int32 [1]
        device tensor: graph-capturable, or an int), unpacked by the GPU from the mapped banks."""
        if not self._sealed:
            self.seal()
        self._copied = True
        unpack_experts_triton(
            self.lo[moe_layer],
            self.hi[moe_layer],
            self.base[moe_layer],
            self.esc_offsets[moe_layer],
            self.esc_index[moe_layer],
            self.esc_bits[moe_layer],
            dst13,
            dst2,
            misses,
            count,
            **tuning,
        )
