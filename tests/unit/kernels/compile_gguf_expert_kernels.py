"""The GGUF block kernels (gguf_expert_gemv.py, gguf_expert_gemm.py; the decode: gguf_block_decode.py) compiled for
Hopper without a GPU (hopper_compile.py; run by test_gguf_expert_kernels.py), for the block types named on the
command line (every one of GGUF_KERNEL_TYPES without), in the models' dtype (bf16): their compiles are long."""

from __future__ import annotations

import json
import sys

from compile_grouped_expert_gemm import EPILOGUE_FLOATS, MARK_PTRS, epilogue_consts, grouped_entries, mark_variants
from hopper_compile import compile_each

import ferry.kernels.gguf_expert_gemm as gk
import ferry.kernels.gguf_expert_gemv as gpair
from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES

DTYPE = "bf16"
# gpt-oss's GGUF experts (ggml-org's files) are MXFP4 blocks with biases and the clamped SwiGLU: that type's kernels
# compile with the epilogue on too
EPILOGUE_TYPES = ("MXFP4",)


def gguf_signatures(ggml_types: list[str]) -> list:
    """Each type's kernels (its GGML constexpr): the grouped ones at every GROUPED_VARIANTS entry (the down ones also
    into bf16 rows), the pair ones at every marking; the file's bytes in place of the weights, the epilogue off, and
    for EPILOGUE_TYPES on (grouped at the prefill block, pair marking)."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    aligned = {"sorted_pairs_ptr": "*i32", "block_slot_ptr": "*i32", "block_start_ptr": "*i32"}
    window = ("slot_lo", "slot_hi", "slot_shift")
    no_bias = {"b_ptr": "*u8", "stride_bs": "i32"}  # the rows' bytes stand in (never read)
    gate_up = {
        "x_ptr": f"*{DTYPE}",
        "q_ptr": "*u8",
        "act_ptr": f"*{DTYPE}",
        **aligned,
        **ints("num_pairs", "top_k", "H", "I", *window, "stride_xt", "stride_xh", "stride_qs", "stride_qo"),
        **ints("stride_am", "stride_an"),
        **no_bias,
        **EPILOGUE_FLOATS,
    }
    down = {
        "act_ptr": f"*{DTYPE}",
        "q_ptr": "*u8",
        "rows_ptr": "*fp32",
        "weights_ptr": "*fp32",
        **aligned,
        **ints("num_pairs", "H", "I", *window, "stride_am", "stride_an", "stride_qs", "stride_qo"),
        **no_bias,
    }
    pair_gate_up = {
        "x_ptr": f"*{DTYPE}",
        "q_ptr": "*u8",
        "act_ptr": f"*{DTYPE}",
        "slots_ptr": "*i64",
        **ints("slot_offset", "top_k", "H", "I"),
        **MARK_PTRS,
        **ints("stride_xt", "stride_qs", "stride_qo"),
        **no_bias,
        **EPILOGUE_FLOATS,
    }
    pair_down = {
        "act_ptr": f"*{DTYPE}",
        "q_ptr": "*u8",
        "rows_ptr": "*fp32",
        "weights_ptr": f"*{DTYPE}",
        "slots_ptr": "*i32",
        **ints("slot_offset", "H", "I", "stride_qs", "stride_qo"),
        **no_bias,
    }
    tiles = gpair.GGUF_PAIR_TILES
    grouped_tile = {"BLOCK_N": gk.GGUF_BLOCK_N, "BLOCK_K": gk.GGUF_BLOCK_K, "UPCAST": False, "PRECISION": None}
    warps = {"num_warps": gk.GGUF_NUM_WARPS}
    out = []
    for ggml_type in ggml_types:
        ggml = GGUF_KERNEL_TYPES[ggml_type]
        for fn, sig in ((gk._gguf_gate_up_kernel, gate_up), (gk._gguf_down_kernel, down)):
            consts_of = lambda block_m, fn=fn: {  # noqa: E731
                "BLOCK_M": block_m,
                **grouped_tile,
                "GGML": ggml,
                **epilogue_consts(fn, False),
            }
            out += [(*entry, warps) for entry in grouped_entries(fn, sig, DTYPE, consts_of, ggml_type)]
        gate_up_tile = {"BLOCK_N": tiles["gate_up_rows"]}
        down_tile = {"BLOCK_N": tiles["down_rows"]}
        pair = ((gpair._gguf_pair_gate_up_kernel, pair_gate_up, gate_up_tile),
                (gpair._gguf_pair_down_kernel, pair_down, down_tile))  # fmt: skip
        pair_warps = {"num_warps": tiles["warps"]}
        for fn, sig, consts in pair:
            for marks in mark_variants(fn):
                c = consts | {"GGML": ggml} | marks | epilogue_consts(fn, False)
                sig_c = {**sig, **{k: "constexpr" for k in c}}
                out.append((f"{fn.__name__}[{ggml_type}, {DTYPE}, {c}]", fn, sig_c, c, pair_warps))
        if ggml_type in EPILOGUE_TYPES:  # biases in float32 and the clamped SwiGLU, decode and prefill
            block = {"BLOCK_M": 64, **grouped_tile, "WINDOWED": False, "GGML": ggml}
            for fn, sig, consts, options in (
                (gk._gguf_gate_up_kernel, gate_up, block, warps),
                (gk._gguf_down_kernel, down, block, warps),
                (
                    gpair._gguf_pair_gate_up_kernel,
                    pair_gate_up,
                    gate_up_tile | {"MARK": True, "HAS_N_ROWS": True},
                    pair_warps,
                ),
                (gpair._gguf_pair_down_kernel, pair_down, down_tile, pair_warps),
            ):
                c = consts | ({"GGML": ggml} if "pair" in fn.__name__ else {}) | epilogue_consts(fn, True)
                sig = {**sig, "b_ptr": "*fp32", **{k: "constexpr" for k in c}}
                out.append((f"{fn.__name__}[{ggml_type}, {DTYPE}, biases, clamped swiglu]", fn, sig, c, options))
    return out


if __name__ == "__main__":
    print(json.dumps(compile_each(gguf_signatures(sys.argv[1:] or list(GGUF_KERNEL_TYPES)))))
