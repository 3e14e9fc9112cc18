"""The routed-expert kernels (grouped GEMM, pair GEMV, row sum) compiled for Hopper without a GPU
(hopper_compile.py; run by test_grouped_expert_gemm.py)."""

from __future__ import annotations

from hopper_compile import print_results

import ferry.kernels.expert_pair_gemv as pair
import ferry.kernels.expert_rows_sum as rows_sum
import ferry.kernels.grouped_expert_gemm as k


def signatures(dtype: str) -> list:
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    upcast, precision = dtype == "fp32", ("ieee" if dtype == "fp32" else None)
    gate_up = {"x_ptr": f"*{dtype}", "w13_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "sorted_pairs_ptr": "*i32",
               "block_slot_ptr": "*i32", **ints("num_pairs", "top_k", "H", "I", "slot_lo", "slot_hi", "slot_shift", "stride_xt", "stride_xh", "stride_ws",
                                                "stride_wn", "stride_wh", "stride_am", "stride_an")}  # fmt: skip
    down = {"act_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}", "rows_ptr": "*fp32", "weights_ptr": "*fp32",
            "sorted_pairs_ptr": "*i32", "block_slot_ptr": "*i32",
            **ints("num_pairs", "H", "I", "slot_lo", "slot_hi", "slot_shift", "stride_am", "stride_an", "stride_ws", "stride_wh", "stride_wi")}  # fmt: skip
    out = []
    for fn, sig in ((k._gate_up_kernel, gate_up), (k._down_kernel, down)):
        for block_m in (16, 64):  # the decode and the prefill block
            consts = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "UPCAST": upcast, "PRECISION": precision}
            out.append((f"{fn.__name__}[{dtype}, BLOCK_M={block_m}]", fn, {**sig, **{c: "constexpr" for c in consts}},
                        consts))  # fmt: skip
    pair_gate_up = {"x_ptr": f"*{dtype}", "w13_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "slots_ptr": "*i64",
                    **ints("slot_offset", "top_k", "H", "I", "stride_xt", "stride_ws", "stride_wn")}  # fmt: skip
    pair_down = {"act_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}", "rows_ptr": "*fp32", "weights_ptr": f"*{dtype}",
                 "slots_ptr": "*i32", **ints("slot_offset", "H", "I", "stride_ws", "stride_wh")}  # fmt: skip
    for fn, sig, block_n in ((pair._pair_gate_up_kernel, pair_gate_up, pair.GATE_UP_BLOCK_N),
                             (pair._pair_down_kernel, pair_down, pair.DOWN_BLOCK_N)):  # fmt: skip
        consts = {"BLOCK_N": block_n, "BLOCK_K": pair.BLOCK_K}
        out.append((f"{fn.__name__}[{dtype}]", fn, {**sig, **{c: "constexpr" for c in consts}}, consts))
    sum_sig = {"rows_ptr": "*fp32", "out_ptr": f"*{dtype}", "top_k": "i32", "H": "i32", "BLOCK": "constexpr"}
    out.append((f"_sum_rows_kernel[{dtype}]", rows_sum._sum_rows_kernel, sum_sig, {"BLOCK": rows_sum.BLOCK_H}))
    return out


if __name__ == "__main__":
    print_results(signatures)
