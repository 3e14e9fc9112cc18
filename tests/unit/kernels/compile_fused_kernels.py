"""The fused RMSNorm and q/k norm + rotary + KV-write kernels, and the paged attention kernels,
compiled for Hopper without a GPU (hopper_compile.py; run by test_fused_kernels_compile.py)."""

from __future__ import annotations

from hopper_compile import print_results

from ferry.kernels.paged_attention_triton import _decode_kernel, _prefill_kernel
from ferry.kernels.qk_norm_rope import _qk_norm_rope_kv_kernel
from ferry.kernels.rms_norm import _rms_norm_kernel


def signatures(dtype: str) -> list:
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    out = []
    norm = {**{p: f"*{dtype}" for p in ("x_ptr", "res_ptr", "out_ptr", "res_out_ptr", "w_ptr", "gate_ptr")},
            **ints("D", "inner", "stride_outer", "stride_inner", "gate_stride_outer", "gate_stride_inner"),
            "eps": "fp32"}  # fmt: skip
    for has_res, zc, gated in ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
                               (False, False, True)):  # fmt: skip
        consts = {"HAS_RESIDUAL": has_res, "ZERO_CENTERED": zc, "GATED": gated, "BLOCK_D": 2048}
        out.append((f"rms_norm[{dtype}, residual={has_res}, zc={zc}, gated={gated}]", _rms_norm_kernel, norm, consts))
    rope = {**{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                                          "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}, "slot_ptr": "*i64",
            **ints("heads", "D", "ROT", "HALF", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                   "stride_vh", "stride_ct", "cache_row"), "eps": "fp32"}  # fmt: skip
    for zc in (False, True):
        consts = {"ZERO_CENTERED": zc, "BLOCK_D": 256}
        out.append((f"qk_norm_rope_kv[{dtype}, zc={zc}]", _qk_norm_rope_kv_kernel, rope, consts))
    strides = ints("stride_qt", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
                   "stride_vh", "stride_ot", "stride_oh", "stride_pt")  # fmt: skip
    paged = {**{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}, "page_table_ptr": "*i32",
             "positions_ptr": "*i64", **strides, "scale": "fp32"}  # fmt: skip
    shape = {"PAGE_SIZE": 16, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 32}
    out.append((f"paged_attention_decode[{dtype}]", _decode_kernel, {**paged, "token_req_ptr": "*i32"}, shape))
    prefill = {**paged, **{p: "*i32" for p in ("query_start_ptr", "block_req_ptr", "block_first_ptr")}}
    out.append((f"paged_attention_prefill[{dtype}]", _prefill_kernel, prefill,
                {**shape, "BLOCK_M": 16, "FP32_DOT": dtype == "fp32"}))  # fmt: skip
    return out


if __name__ == "__main__":
    print_results(signatures)
