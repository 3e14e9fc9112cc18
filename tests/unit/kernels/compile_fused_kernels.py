"""Compile the fused RMSNorm and q/k norm + rotary + KV-write kernels for Hopper (sm_90) without a
GPU, in a child process started by test_fused_kernels_compile.py with TRITON_INTERPRET unset (as
compile_grouped_expert_gemm.py does): a kernel that would not compile fails on CPU CI. Prints JSON."""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ferry.kernels.qk_norm_rope import _qk_norm_rope_kv_kernel
from ferry.kernels.rms_norm import _rms_norm_kernel

HOPPER = GPUTarget("cuda", 90, 32)


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
    return out


def main() -> None:
    results = {}
    for dtype in ("bf16", "fp32"):
        for name, fn, sig, consts in signatures(dtype):
            try:
                src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts)
                compiled = triton.compile(src, target=HOPPER)
                results[name] = {"cubin": "cubin" in compiled.asm}
            except Exception as exc:  # noqa: BLE001 - reported to the parent test
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
