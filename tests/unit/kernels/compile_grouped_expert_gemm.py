"""The routed-expert kernels (grouped GEMM, pair GEMV, row sum, and their NVFP4 / MXFP4 / FP8-block twins)
compiled for Hopper without a GPU (hopper_compile.py; run by test_grouped_expert_gemm.py). The GGUF twins:
compile_gguf_expert_kernels.py, with these entries' helpers."""

from __future__ import annotations

import torch
from hopper_compile import print_results

import ferry.kernels.expert_pair_gemv as pair
import ferry.kernels.expert_rows_sum as rows_sum
import ferry.kernels.grouped_expert_gemm as k
import ferry.kernels.quantized_expert_gemm as qk
import ferry.kernels.quantized_expert_gemv as qpair
from ferry.kernels.expert_epilogue import GELU_TANH_CODE, SILU_CODE, SWIGLU_CODE
from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES
from ferry.kernels.pair_tiles import TILES
from ferry.kernels.quantized_experts import FP4_SCALES, FP8_BLOCK, MXFP4, NVFP4
from ferry.plan.expert_formats import BF16

# the grouped kernels: the decode and the prefill block, each over every block and over a streamed window's
GROUPED_VARIANTS = [(block_m, windowed) for block_m in (16, 64) for windowed in (False, True)]
# a step past ROWS_FLOAT32_MAX_TOKENS (kernels/expert_rows_sum.py) writes its rows in the model's dtype: the
# prefill block's down kernels, over every block and over a window, and the row sum compile for those rows too
LONG_STEP_VARIANTS = [(64, windowed) for windowed in (False, True)]


def grouped_entries(fn, sig: dict, dtype: str, consts_of, fmt: str | None = None) -> list:
    """`fn` at every GROUPED_VARIANTS entry; a down kernel also into rows in `dtype` (not fp32's own). `fmt`:
    the quantized format it computes, named in the entries (the fp4 kernels serve two)."""
    out = []
    tag = f"{fmt}, " if fmt in FP4_SCALES or fmt in GGUF_KERNEL_TYPES else ""
    for block_m, windowed in GROUPED_VARIANTS:
        consts = consts_of(block_m) | {"WINDOWED": windowed}
        out.append(
            (
                f"{fn.__name__}[{tag}{dtype}, BLOCK_M={block_m}, WINDOWED={windowed}]",
                fn,
                {**sig, **{c: "constexpr" for c in consts}},
                consts,
            )
        )
    if "down" in fn.__name__ and dtype != "fp32":
        for block_m, windowed in LONG_STEP_VARIANTS:
            consts = consts_of(block_m) | {"WINDOWED": windowed}
            out.append(
                (
                    f"{fn.__name__}[{tag}{dtype}, rows {dtype}, BLOCK_M={block_m}, WINDOWED={windowed}]",
                    fn,
                    {**sig, "rows_ptr": f"*{dtype}", **{c: "constexpr" for c in consts}},
                    consts,
                )
            )
    return out


MARK_PTRS = {"table_ptr": "*i32", "n_rows_ptr": "*i32"}
EPILOGUE_FLOATS = {"alpha": "fp32", "limit": "fp32"}  # the clamped SwiGLU's (kernels/expert_epilogue.py)


def epilogue_consts(fn, gpt_oss: bool, gelu: bool = False) -> dict:
    """HAS_BIAS (and a gate/up kernel's SWIGLU, the activation's code): off for every model but gpt-oss's experts
    (biases, the clamped SwiGLU) and Gemma 4's (`gelu`: no biases, gelu-tanh)."""
    if "gate_up" in fn.__name__:
        code = GELU_TANH_CODE if gelu else SWIGLU_CODE if gpt_oss else SILU_CODE
        return {"HAS_BIAS": gpt_oss, "SWIGLU": code}
    return {"HAS_BIAS": gpt_oss}  # the resident store's routed table, marked by gate/up


def mark_variants(fn) -> list[dict]:
    """A pair gate/up kernel compiles unmarked and marking (with and without padding rows); the rest once."""
    if "gate_up" not in fn.__name__:
        return [{}]
    return [{"MARK": mark, "HAS_N_ROWS": n_rows} for mark, n_rows in ((False, False), (True, False), (True, True))]


def signatures(dtype: str) -> list:
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    upcast, precision = dtype == "fp32", ("ieee" if dtype == "fp32" else None)
    gate_up = {
        "x_ptr": f"*{dtype}",
        "w13_ptr": f"*{dtype}",
        "b13_ptr": f"*{dtype}",
        "act_ptr": f"*{dtype}",
        "sorted_pairs_ptr": "*i32",
        "block_slot_ptr": "*i32",
        "block_start_ptr": "*i32",
        **ints(
            "num_pairs",
            "top_k",
            "H",
            "I",
            "slot_lo",
            "slot_hi",
            "slot_shift",
            "stride_xt",
            "stride_xh",
            "stride_ws",
            "stride_wn",
            "stride_wh",
            "stride_b13",
        ),
        **EPILOGUE_FLOATS,
        **ints("stride_am", "stride_an"),
    }
    down = {
        "act_ptr": f"*{dtype}",
        "w2_ptr": f"*{dtype}",
        "b2_ptr": f"*{dtype}",
        "rows_ptr": "*fp32",
        "weights_ptr": "*fp32",
        "sorted_pairs_ptr": "*i32",
        "block_slot_ptr": "*i32",
        "block_start_ptr": "*i32",
        **ints(
            "num_pairs",
            "H",
            "I",
            "slot_lo",
            "slot_hi",
            "slot_shift",
            "stride_am",
            "stride_an",
            "stride_ws",
            "stride_wh",
            "stride_wi",
            "stride_b2",
        ),
    }
    out = []
    for fn, sig in ((k._gate_up_kernel, gate_up), (k._down_kernel, down)):
        out += grouped_entries(
            fn,
            sig,
            dtype,
            lambda block_m: (
                {
                    "BLOCK_M": block_m,
                    "BLOCK_N": 64,
                    "BLOCK_K": 64,
                    "UPCAST": upcast,
                    "PRECISION": precision,
                }
                | epilogue_consts(fn, False)
            ),
        )
    pair_gate_up = {
        "x_ptr": f"*{dtype}",
        "w13_ptr": f"*{dtype}",
        "b13_ptr": f"*{dtype}",
        "act_ptr": f"*{dtype}",
        "slots_ptr": "*i64",
        **ints("slot_offset", "top_k", "H", "I"),
        **MARK_PTRS,
        **ints("stride_xt", "stride_ws", "stride_wn", "stride_b13"),
        **EPILOGUE_FLOATS,
    }
    pair_down = {
        "act_ptr": f"*{dtype}",
        "w2_ptr": f"*{dtype}",
        "b2_ptr": f"*{dtype}",
        "rows_ptr": "*fp32",
        "weights_ptr": f"*{dtype}",
        "slots_ptr": "*i32",
        **ints("slot_offset", "H", "I", "stride_ws", "stride_wh", "stride_b2"),
    }
    bf16 = TILES[BF16]
    for fn, sig, block_n, block_k in (
        (pair._pair_gate_up_kernel, pair_gate_up, bf16.gate_up_rows, bf16.gate_up_k),
        (pair._pair_down_kernel, pair_down, bf16.down_rows, bf16.down_k),
    ):
        for marks in mark_variants(fn):
            consts = {"BLOCK_N": block_n, "BLOCK_K": block_k} | marks | epilogue_consts(fn, False)
            out.append((f"{fn.__name__}[{dtype}, {consts}]", fn, {**sig, **{c: "constexpr" for c in consts}}, consts))
    if dtype == "bf16":  # gpt-oss's experts: biases and the clamped SwiGLU, as decode and prefill launch them
        grouped = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "UPCAST": False, "PRECISION": None, "WINDOWED": False}
        pair_up = {"BLOCK_N": bf16.gate_up_rows, "BLOCK_K": bf16.gate_up_k, "MARK": True, "HAS_N_ROWS": True}
        pair_down_consts = {"BLOCK_N": bf16.down_rows, "BLOCK_K": bf16.down_k}
        for fn, sig, consts in (
            (k._gate_up_kernel, gate_up, grouped),
            (k._down_kernel, down, grouped),
            (pair._pair_gate_up_kernel, pair_gate_up, pair_up),
            (pair._pair_down_kernel, pair_down, pair_down_consts),
        ):
            consts = consts | epilogue_consts(fn, True)
            name = f"{fn.__name__}[bf16, biases, clamped swiglu]"
            out.append((name, fn, {**sig, **{c: "constexpr" for c in consts}}, consts))
        for fn, sig, consts in (
            (k._gate_up_kernel, gate_up, grouped),
            (pair._pair_gate_up_kernel, pair_gate_up, pair_up),
        ):
            consts = consts | epilogue_consts(fn, False, gelu=True)  # Gemma 4's experts
            out.append((f"{fn.__name__}[bf16, gelu-tanh]", fn, {**sig, **{c: "constexpr" for c in consts}}, consts))
    sum_sig = {"rows_ptr": "*fp32", "out_ptr": f"*{dtype}", "top_k": "i32", "H": "i32", "BLOCK": "constexpr"}
    out.append((f"_sum_rows_kernel[{dtype}]", rows_sum._sum_rows_kernel, sum_sig, {"BLOCK": rows_sum.BLOCK_H}))
    if dtype != "fp32":
        out.append(
            (
                f"_sum_rows_kernel[{dtype}, rows {dtype}]",
                rows_sum._sum_rows_kernel,
                {**sum_sig, "rows_ptr": f"*{dtype}"},
                {"BLOCK": rows_sum.BLOCK_H},
            )
        )
    return out + quantized_signatures(dtype)


def fp4_consts(fmt: str) -> dict:
    """The fp4 kernels' format constexprs (kernels/quantized_experts.py's FP4_SCALES); none for fp8-block."""
    if fmt not in FP4_SCALES:
        return {}
    fp4 = FP4_SCALES[fmt]
    return {"GROUP": fp4.group, "E8M0": fp4.e8m0, "ROW_SCALE": fp4.row_scale}


def quantized_signatures(dtype: str) -> list:
    """The NVFP4, MXFP4 and FP8-block kernels: codes, scales (and NVFP4's per-row gscale) in place of the
    weights; the fp4 kernels once a format (its group, scale kind and row scale constexpr)."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    upcast, precision = dtype == "fp32", ("ieee" if dtype == "fp32" else None)
    fp4_ptrs = {  # mxfp4 has no row scale: its scale bytes stand in for g_ptr (never read)
        NVFP4: {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32"},
        MXFP4: {"q_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*u8"},
    }
    fp8 = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    aligned = {"sorted_pairs_ptr": "*i32", "block_slot_ptr": "*i32", "block_start_ptr": "*i32"}
    window = ("slot_lo", "slot_hi", "slot_shift")
    grouped = [  # (kernel, format, arguments in the kernels' order)
        entry
        for fmt in FP4_SCALES
        for entry in (
            (
                qk._fp4_gate_up_kernel,
                fmt,
                {
                    "x_ptr": f"*{dtype}",
                    **fp4_ptrs[fmt],
                    "act_ptr": f"*{dtype}",
                    **aligned,
                    **ints(
                        "num_pairs",
                        "top_k",
                        "H",
                        "I",
                        *window,
                        "stride_xt",
                        "stride_xh",
                        "stride_qs",
                        "stride_qo",
                        "stride_ss",
                        "stride_so",
                        "stride_gs",
                        "stride_am",
                        "stride_an",
                    ),
                    "b_ptr": fp4_ptrs[fmt]["s_ptr"],  # no biases: a stand-in, never read
                    "stride_bs": "i32",
                    **EPILOGUE_FLOATS,
                },
            ),
            (
                qk._fp4_down_kernel,
                fmt,
                {
                    "act_ptr": f"*{dtype}",
                    **fp4_ptrs[fmt],
                    "rows_ptr": "*fp32",
                    "weights_ptr": "*fp32",
                    **aligned,
                    **ints(
                        "num_pairs",
                        "H",
                        "I",
                        *window,
                        "stride_am",
                        "stride_an",
                        "stride_qs",
                        "stride_qo",
                        "stride_ss",
                        "stride_so",
                        "stride_gs",
                    ),
                    "b_ptr": fp4_ptrs[fmt]["s_ptr"],
                    "stride_bs": "i32",
                },
            ),
        )
    ] + [
        (
            qk._fp8_gate_up_kernel,
            FP8_BLOCK,
            {
                "x_ptr": f"*{dtype}",
                **fp8,
                "act_ptr": f"*{dtype}",
                **aligned,
                **ints(
                    "num_pairs",
                    "top_k",
                    "H",
                    "I",
                    *window,
                    "up_row_block",
                    "stride_xt",
                    "stride_xh",
                    "stride_qs",
                    "stride_qo",
                    "stride_ss",
                    "stride_so",
                    "stride_am",
                    "stride_an",
                ),
            },
        ),
        (
            qk._fp8_down_kernel,
            FP8_BLOCK,
            {
                "act_ptr": f"*{dtype}",
                **fp8,
                "rows_ptr": "*fp32",
                "weights_ptr": "*fp32",
                **aligned,
                **ints(
                    "num_pairs",
                    "H",
                    "I",
                    *window,
                    "stride_am",
                    "stride_an",
                    "stride_qs",
                    "stride_qo",
                    "stride_ss",
                    "stride_so",
                ),
            },
        ),
    ]
    out = []
    act = torch.float32 if dtype == "fp32" else torch.bfloat16
    for fn, fmt, sig in grouped:
        out += grouped_entries(
            fn,
            sig,
            dtype,
            lambda block_m, fmt=fmt: {
                "BLOCK_M": block_m,
                "BLOCK_N": qk.BLOCK_N,
                "BLOCK_K": qk.block_k_for(fmt, block_m, act),
                "UPCAST": upcast,
                "PRECISION": precision,
                **fp4_consts(fmt),
                **(epilogue_consts(fn, False) if fmt in FP4_SCALES else {}),
            },
            fmt,
        )
    pair = [
        entry
        for fmt in FP4_SCALES
        for entry in (
            (
                qpair._fp4_pair_gate_up_kernel,
                fmt,
                {
                    "x_ptr": f"*{dtype}",
                    **fp4_ptrs[fmt],
                    "act_ptr": f"*{dtype}",
                    "slots_ptr": "*i64",
                    **ints("slot_offset", "top_k", "H", "I"),
                    **MARK_PTRS,
                    **ints("stride_xt", "stride_qs", "stride_qo", "stride_ss", "stride_so", "stride_gs"),
                    "b_ptr": fp4_ptrs[fmt]["s_ptr"],
                    "stride_bs": "i32",
                    **EPILOGUE_FLOATS,
                },
                {"BLOCK_N": TILES[fmt].gate_up_rows, "GROUPS": TILES[fmt].gate_up_k, **fp4_consts(fmt)},
            ),
            (
                qpair._fp4_pair_down_kernel,
                fmt,
                {
                    "act_ptr": f"*{dtype}",
                    **fp4_ptrs[fmt],
                    "rows_ptr": "*fp32",
                    "weights_ptr": f"*{dtype}",
                    "slots_ptr": "*i32",
                    **ints("slot_offset", "H", "I", "stride_qs", "stride_qo", "stride_ss", "stride_so", "stride_gs"),
                    "b_ptr": fp4_ptrs[fmt]["s_ptr"],
                    "stride_bs": "i32",
                },
                {"BLOCK_N": TILES[fmt].down_rows, "GROUPS": TILES[fmt].down_k, **fp4_consts(fmt)},
            ),
        )
    ] + [
        (
            qpair._fp8_pair_gate_up_kernel,
            FP8_BLOCK,
            {
                "x_ptr": f"*{dtype}",
                **fp8,
                "act_ptr": f"*{dtype}",
                "slots_ptr": "*i64",
                **ints("slot_offset", "top_k", "H", "I", "up_row_block"),
                **MARK_PTRS,
                **ints("stride_xt", "stride_qs", "stride_qo", "stride_ss", "stride_so"),
            },
            {"BLOCK_N": TILES[FP8_BLOCK].gate_up_rows, "BLOCKS": TILES[FP8_BLOCK].gate_up_k},
        ),
        (
            qpair._fp8_pair_down_kernel,
            FP8_BLOCK,
            {
                "act_ptr": f"*{dtype}",
                **fp8,
                "rows_ptr": "*fp32",
                "weights_ptr": f"*{dtype}",
                "slots_ptr": "*i32",
                **ints("slot_offset", "H", "I", "stride_qs", "stride_qo", "stride_ss", "stride_so"),
            },
            {"BLOCK_N": TILES[FP8_BLOCK].down_rows, "BLOCKS": TILES[FP8_BLOCK].down_k},
        ),
    ]
    for fn, fmt, sig, tiles in pair:
        for consts in (tiles | marks for marks in mark_variants(fn)):
            consts |= epilogue_consts(fn, False) if fmt in FP4_SCALES else {}
            name = f"{fn.__name__}[{fmt}, {dtype}, {consts}]"
            out.append((name, fn, {**sig, **{c: "constexpr" for c in consts}}, consts))
    if dtype == "bf16":  # gpt-oss's mxfp4 experts: float32 biases and the clamped SwiGLU, decode and prefill
        grouped_sigs = {fn: sig for fn, fmt, sig in grouped if fmt == MXFP4}
        pair_sigs = {fn: (sig, tiles) for fn, fmt, sig, tiles in pair if fmt == MXFP4}
        block = {"BLOCK_M": 64, "BLOCK_N": qk.BLOCK_N, "BLOCK_K": qk.block_k_for(MXFP4, 64, act), "UPCAST": False}
        block |= {"PRECISION": None, "WINDOWED": False, **fp4_consts(MXFP4)}
        for fn, sig, consts in (
            (qk._fp4_gate_up_kernel, grouped_sigs[qk._fp4_gate_up_kernel], block),
            (qk._fp4_down_kernel, grouped_sigs[qk._fp4_down_kernel], block),
            (qpair._fp4_pair_gate_up_kernel, *pair_sigs[qpair._fp4_pair_gate_up_kernel]),
            (qpair._fp4_pair_down_kernel, *pair_sigs[qpair._fp4_pair_down_kernel]),
        ):
            consts = (
                consts
                | epilogue_consts(fn, True)
                | ({"MARK": True, "HAS_N_ROWS": True} if "pair_gate_up" in fn.__name__ else {})
            )
            sig = {**sig, "b_ptr": "*fp32", **{c: "constexpr" for c in consts}}
            out.append((f"{fn.__name__}[mxfp4, bf16, biases, clamped swiglu]", fn, sig, consts))
    return out


if __name__ == "__main__":
    print_results(signatures)
