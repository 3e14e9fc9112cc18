"""What the quantized expert formats share: one byte row per weight family (plan/expert_formats/registry.py's
`family_layout`), written part by part, viewed part by part.

A row's parts are typed views of its bytes: `part(row, p)` for one row [B] (loading), `part(rows, p)`
for [S, B] (the kernels' `QuantizedFamily`, strided: one slot's parts are B bytes apart)."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL, ExpertActivation
from ferry.kernels.quantized_experts import E2M1_VALUES, QuantizedFamily
from ferry.plan import expert_formats as F
from ferry.services.worker.dummy_weights import name_seed
from ferry.services.worker.expert_formats.expert_shapes import ExpertBias, check_expert_shapes
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.host_expert_weights import QuantizedFamilyReader, QuantizedReader
from ferry.services.worker.quantized_weight import QuantizedWeight

TORCH_PART_DTYPES = {"uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}
# Dummy weights (--load-format dummy): the dummy recipe's scales (dummy_weights.py), the weights
# that feed the residual stream (down) ten times weaker, so routing follows the token.
DUMMY_STD, DUMMY_DOWN_STD = 0.02, 0.002
E4M3_MAX = 448.0  # the largest float8_e4m3fn magnitude
E2M1_MAX = 6.0  # the largest e2m1 magnitude (nvfp4's and mxfp4's codes)
# the root mean square of a uniformly random e2m1 code: what a dummy weight's scales divide by
E2M1_RMS = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5
DUMMY_EXPERT_STRIDE = 4099  # bytes between consecutive experts' windows of a layer's pattern (prime)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (uint8, sign in bit 3) of every value of x (already scaled into [-6, 6]; a tie to the
    smaller magnitude)."""
    mag = x.abs().clamp(max=E2M1_MAX)
    code = (mag.unsqueeze(-1) - torch.tensor(E2M1_VALUES, device=x.device)).abs().argmin(dim=-1)
    return (code | torch.where(x < 0, 8, 0)).to(torch.uint8)


def raw(rows: torch.Tensor, p: F.RowPart) -> torch.Tensor:
    """Part `p`'s bytes in a byte row [B] ([p.nbytes]) or in byte rows [S, B] ([S, p.nbytes])."""
    return rows[..., p.offset : p.offset + p.nbytes]


def part(rows: torch.Tensor, p: F.RowPart) -> torch.Tensor:
    """Part `p` of a byte row [B] ([*p.shape]) or of byte rows [S, B] ([S, *p.shape])."""
    return raw(rows, p).view(TORCH_PART_DTYPES[p.dtype]).unflatten(-1, p.shape)


def weight_parts(layout: F.FamilyLayout) -> F.FamilyLayout:
    """The layout without its bias part: what a format's own writer and dummy fill lay out (the bias part,
    where there is one, is written by QuantizedExperts itself)."""
    return dataclasses.replace(layout, parts=tuple(p for p in layout.parts if p.name != F.BIAS_PART))


def fill_bytes_of(rows: torch.Tensor, p: F.RowPart, value: float) -> None:
    """Every element of part `p` = `value` (written as the part's bytes: float8 has no fill)."""
    one = torch.tensor([value], dtype=torch.float32).to(TORCH_PART_DTYPES[p.dtype]).view(torch.uint8)
    raw(rows, p).view(*rows.shape[:-1], -1, one.numel()).copy_(one)


class QuantizedExperts(ABC):
    """A quantized expert format over experts of hidden size H and intermediate size I: `plan` (its
    plan/expert_formats object) prices its rows, a subclass writes and fills them (`_write`,
    `_fill_dummy`), names its host kernel code and its host reader of a family (`family_reader`), and
    gives `quantize_linear`, the published layout's tensors of one linear (services/quantized_checkpoint.py)."""

    plan: F.ExpertFormat
    name: str  # plan.name
    quantized = True
    copy_engine_default = False  # a quantized miss is small: the graph's core copies beat the eager copy-engine path
    views_per_layer = False  # one layout for every MoE layer (gguf_mixed.py's differ)
    ggml_type: str | None = None  # GGUF blocks: the ggml type a family's `q` holds (its scales inside the blocks)
    host_kernel_code: int  # the C host kernel's enum ferry_format (offload/host_compute/host_expert_kernel.py)
    family_reader: type[QuantizedFamilyReader]  # the host reader of one family's rows

    def __init__(self, hidden: int, inter: int, bias: bool = False, activation: ExpertActivation = SILU_AND_MUL):
        self.hidden, self.inter = hidden, inter
        self.bias, self.activation = bias, activation  # a bias part in each row (BIAS_PART); the activation
        self.layout13 = self.plan.family_layout(2 * inter, hidden, inter, bias)
        self.layout2 = self.plan.family_layout(hidden, inter, hidden, bias)

    @classmethod
    def for_shapes(cls, hidden: int, inter: int, dtype: torch.dtype, epilogue=None) -> QuantizedExperts:
        """The format for experts of these sizes (the rows are the same bytes whatever the run dtype); `epilogue`
        (bias rows, activation) for experts with biases or the clamped SwiGLU, in a format that `holds_biases`."""
        if epilogue is None:
            return cls(hidden, inter)
        if not cls.plan.holds_biases:
            raise ValueError(f"{cls.plan.name} expert rows hold no biases and its kernels compute no clamped SwiGLU")
        bias_rows, activation = epilogue
        return cls(hidden, inter, bias_rows != (0, 0), activation)

    @property
    def has_epilogue(self) -> bool:
        return self.bias or self.activation != SILU_AND_MUL

    def host_kernel_format(self) -> int:
        return self.host_kernel_code

    def host_bias_offsets(self) -> tuple[int, int]:
        """(w13, w2): bytes from an expert's row start to its float32 bias part, K.NO_BIAS without one."""
        return tuple(
            next((p.offset for p in layout.parts if p.name == F.BIAS_PART), K.NO_BIAS)
            for layout in (self.layout13, self.layout2)
        )

    def host_reader(self, banks, dtype: torch.dtype, chunk: int) -> QuantizedReader:
        return QuantizedReader(banks, dtype, chunk)

    def row_shapes(self):
        return ((self.layout13.nbytes,), torch.uint8), ((self.layout2.nbytes,), torch.uint8)

    def gemm_views(
        self, w13: torch.Tensor, w2: torch.Tensor, moe_layer: int | None = None
    ) -> tuple[QuantizedFamily, QuantizedFamily]:
        return self.family(w13, self.layout13), self.family(w2, self.layout2)

    def family(self, rows: torch.Tensor, layout: F.FamilyLayout) -> QuantizedFamily:
        views = {p.name: part(rows, p) for p in layout.parts}
        activation = self.activation if layout is self.layout13 else SILU_AND_MUL
        return QuantizedFamily(
            self.name,
            layout.rows,
            layout.cols,
            layout.part_rows,
            views["q"],
            views.get("scale"),
            views.get("gscale"),
            ggml_type=self.ggml_type,
            bias=views.get(F.BIAS_PART),
            activation=activation,
        )

    def write_expert(
        self, dst13: torch.Tensor, dst2: torch.Tensor, gate, up, down, where: str, bias: ExpertBias | None = None
    ) -> None:
        for name, t in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(t, QuantizedWeight):
                raise ValueError(
                    f"{where}: {name} is not quantized in the checkpoint, but config.json's "
                    f"quantization_config makes the routed experts {self.name}: every expert must be"
                )
        check_expert_shapes(where, gate, up, down, self.inter, self.hidden)
        self._write(dst13, weight_parts(self.layout13), (gate, up))
        self._write(dst2, weight_parts(self.layout2), (down,))
        if bias is not None and not self.bias:
            raise ValueError(f"{where} has biases, but this model's experts have none (config.json)")
        if self.bias:  # float32 in the row; none given (dummy weights): zero
            values13, values2 = (None, None) if bias is None else (bias.gate_up, bias.down)
            for row, layout, values, want in (
                (dst13, self.layout13, values13, 2 * self.inter),
                (dst2, self.layout2, values2, self.hidden),
            ):
                target = part(row, next(p for p in layout.parts if p.name == F.BIAS_PART))
                if values is None:
                    target.zero_()
                elif tuple(values.shape) != (want,):
                    raise ValueError(f"{where}: a bias has shape {tuple(values.shape)}, expected ({want},)")
                else:
                    target.copy_(values)

    @abstractmethod
    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[QuantizedWeight, ...]) -> None:
        """The projections (stacked along the rows) into one byte row: each part of the format."""

    def layer_layouts(self, moe_layer: int) -> tuple[F.FamilyLayout, F.FamilyLayout]:
        """(w13, w2) rows of MoE layer `moe_layer`'s experts: the slots' layouts, or a prefix of them for a format
        whose rows differ by layer (`views_per_layer`)."""
        return self.layout13, self.layout2

    def fill_dummy_layer(self, w13: torch.Tensor, w2: torch.Tensor, layer: int, seed: int) -> None:
        layout13, layout2 = self.layer_layouts(layer)
        for rows, layout, std, family in ((w13, layout13, DUMMY_STD, 0), (w2, layout2, DUMMY_DOWN_STD, 1)):
            gen = torch.Generator().manual_seed(name_seed(f"{self.name} experts, layer {layer}, family {family}", seed))
            self._fill_dummy(rows, weight_parts(layout), std, gen)
            for p in layout.parts:  # biases zero, as the dummy recipe's (dummy_weights.py)
                if p.name == F.BIAS_PART:
                    raw(rows, p).zero_()

    @abstractmethod
    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """One layer's rows [E, B] of one family: weights of about `std`, drawn from `gen`."""


def expert_windows(pattern: torch.Tensor, experts: int, width: int) -> torch.Tensor:
    """[experts, width] windows of a 1-D pattern, DUMMY_EXPERT_STRIDE apart: experts differ, one copy fills them."""
    return pattern.as_strided((experts, width), (DUMMY_EXPERT_STRIDE, 1))


def dummy_pattern(experts: int, width: int) -> int:
    """The length of a pattern whose `expert_windows` cover `experts` rows of `width`."""
    return (experts - 1) * DUMMY_EXPERT_STRIDE + width
