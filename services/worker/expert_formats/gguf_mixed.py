"""The `gguf-mixed` expert format's worker side: a GGUF file's routed experts in several ggml block types, each
MoE layer's w13 and w2 rows in their own type (plan/expert_formats/gguf_mixed.py lists them and sizes the rows).

A slot (and a bank row) is the largest type's row; a layer of a smaller type fills and reads the row's prefix. Each
layer's rows are the one-type format's rows of its type (services/worker/expert_formats/gguf_blocks.py), so that
format's worker gives the layer's views, writes and dummy fill: the kernels' twin and the host reader then decode
the layer's blocks with its type (`gemm_views(w13, w2, moe_layer)`, one QuantizedFamily view per layer)."""

from __future__ import annotations

import dataclasses

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL
from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_mixed import GGUF_MIXED
from ferry.services.worker.expert_formats import worker_class
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts, GgufFamilyReader
from ferry.services.worker.expert_formats.quantized import QuantizedExperts, part
from ferry.services.worker.gguf_tensors import GgufWeight
from ferry.services.worker.offload.host_compute import host_expert_kernel as K


class GgufMixedExperts(QuantizedExperts):
    plan = F.get(GGUF_MIXED)
    name = plan.name
    views_per_layer = True
    family_reader = GgufFamilyReader

    def __init__(self, hidden: int, inter: int, layer_types: tuple[tuple[str, str], ...]):
        if not layer_types:
            raise ValueError(f"{self.name} experts need their types per MoE layer (quantization_config expert_types)")
        self.hidden, self.inter = hidden, inter
        types = sorted({t for pair in layer_types for t in pair})
        self.types: dict[str, GgufBlockExperts] = {
            t: worker_class(self.plan.type_format(t))(hidden, inter) for t in types
        }
        # per MoE layer, the one-type formats of its w13 and w2 rows
        self.layers = tuple((self.types[t13], self.types[t2]) for t13, t2 in layer_types)
        self.bias, self.activation = False, SILU_AND_MUL
        # the slots' rows: each family's largest over the layers
        self.layout13, self.layout2 = (
            dataclasses.replace(max(layouts, key=lambda layout: layout.nbytes), fmt=self.name)
            for layouts in zip(*(self.layer_layouts(layer) for layer in range(len(self.layers))))
        )

    @classmethod
    def for_shapes(cls, hidden: int, inter: int, dtype: torch.dtype, epilogue=None, layer_types=()):
        if epilogue is not None:
            raise ValueError(f"{cls.plan.name} expert rows hold no biases and its kernels compute no clamped SwiGLU")
        return cls(hidden, inter, tuple(layer_types))

    def layer_layouts(self, moe_layer: int) -> tuple[F.FamilyLayout, F.FamilyLayout]:
        w13, w2 = self.layers[moe_layer]
        return w13.layout13, w2.layout2

    def layer_row_nbytes(self, moe_layer: int) -> tuple[int, int]:
        """The bytes of a w13 and a w2 row that MoE layer `moe_layer`'s experts fill (the rows' prefix): what a
        copy of one of them must move (kernels/expert_copy.py's `used_bytes`)."""
        layout13, layout2 = self.layer_layouts(moe_layer)
        return layout13.nbytes, layout2.nbytes

    def host_kernel_format(self) -> int:
        return K.GGUF  # each layer's families of their own block types (host_expert_kernel.py reads them per layer)

    def gemm_views(self, w13: torch.Tensor, w2: torch.Tensor, moe_layer: int | None = None):
        if moe_layer is None:
            raise ValueError(f"{self.name} rows differ by MoE layer: their views need the layer")
        f13, f2 = self.layers[moe_layer]
        return f13.family(w13, f13.layout13), f2.family(w2, f2.layout2)

    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[GgufWeight, ...]) -> None:
        """The projections' blocks into the row's prefix, as their type's rows (each layer's type is the file's:
        plan/gguf_checkpoint.py read it from these tensors)."""
        kinds = {p.ggml_type for p in projections}
        if len(kinds) != 1 or not kinds <= set(self.types):
            shown = ", ".join(f"{p.source!r} is {p.ggml_type}" for p in projections)
            raise ValueError(
                f"{shown}: an expert's gate and up share one of this file's expert types ({', '.join(self.types)})"
            )
        for proj in projections:
            if proj.fmt != self.name:
                raise ValueError(
                    f"checkpoint tensor {proj.source!r} is {proj.fmt}, but the routed experts are {self.name}: "
                    "every expert must be"
                )
        (q,) = self.types[kinds.pop()].plan.family_layout(layout.rows, layout.cols, layout.part_rows).parts
        dst, first = part(row, q), 0
        for proj in projections:
            dst[first : first + proj.q.shape[0]].copy_(proj.q)
            first += proj.q.shape[0]

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """One layer's rows of one family (`layer_layouts`: its type's layout), filled as that type fills them."""
        fmt = next(w for w in self.types.values() if w.name == layout.fmt)
        fmt._fill_dummy(rows, layout, std, gen)
