"""The fused RMSNorm, rotary tables and q/k norm + rotary + KV-write kernels, the paged attention kernels, the
MoE block's router / routed-marking / SiLU-and-mul / combine kernels, and the Gated DeltaNet decode
and prefill-conv kernels, compiled for Hopper without a GPU (hopper_compile.py; run by
test_fused_kernels_compile.py)."""

from __future__ import annotations

from hopper_compile import print_results

from ferry.kernels.causal_conv1d import BLOCK_C as CONV_BLOCK_C
from ferry.kernels.causal_conv1d import BLOCK_T as CONV_BLOCK_T
from ferry.kernels.causal_conv1d import _conv_prefill_kernel, _conv_state_kernel
from ferry.kernels.gated_deltanet_decode import _conv_decode_kernel, _rule_norm_kernel, rule_norm_warps
from ferry.kernels.kv_gather_triton import BLOCK_T as GATHER_BLOCK_T
from ferry.kernels.kv_gather_triton import _gather_dequantize_kernel
from ferry.kernels.moe_combine import _moe_combine_kernel, _silu_mul_kernel
from ferry.kernels.paged_attention_triton import (
    DECODE_SPLITS,
    _decode_combine_kernel,
    _decode_split_kernel,
    _prefill_kernel,
    prefill_tiles,
)
from ferry.kernels.qk_norm_rope import _qk_norm_rope_kv_kernel
from ferry.kernels.rms_norm import _rms_norm_kernel
from ferry.kernels.rotary_cos_sin import _cos_sin_kernel
from ferry.kernels.router_topk import _mark_routed_kernel, _router_topk_kernel


def signatures(dtype: str) -> list:
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    out = []
    norm = {
        **{p: f"*{dtype}" for p in ("x_ptr", "res_ptr", "out_ptr", "res_out_ptr", "w_ptr", "gate_ptr")},
        **ints("D", "inner", "stride_outer", "stride_inner", "gate_stride_outer", "gate_stride_inner"),
        "eps": "fp32",
    }
    for has_res, zc, gated in (
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (True, True, False),
        (False, False, True),
    ):
        consts = {
            "HAS_RESIDUAL": has_res,
            "ZERO_CENTERED": zc,
            "GATED": gated,
            "ROWS": False,
            "TOP_K": 1,
            "BLOCK_D": 2048,
        }
        out.append((f"rms_norm[{dtype}, residual={has_res}, zc={zc}, gated={gated}]", _rms_norm_kernel, norm, consts))
    rows = {**norm, "x_ptr": "*fp32", "gate_ptr": "*fp32"}  # a MoE block's unsummed rows (expert_rows_sum.py)
    for zc in (False, True):
        consts = {"HAS_RESIDUAL": True, "ZERO_CENTERED": zc, "GATED": False, "ROWS": True, "TOP_K": 8, "BLOCK_D": 2048}
        out.append((f"rms_norm[{dtype}, rows, zc={zc}]", _rms_norm_kernel, rows, consts))
    rope = {
        **{
            p: f"*{dtype}"
            for p in (
                "q_ptr",
                "k_ptr",
                "v_ptr",
                "qw_ptr",
                "kw_ptr",
                "cos_ptr",
                "sin_ptr",
                "q_out_ptr",
                "k_cache_ptr",
                "v_cache_ptr",
                "ks_ptr",
                "vs_ptr",
            )
        },
        "slot_ptr": "*i64",
        **ints(
            "heads",
            "D",
            "ROT",
            "HALF",
            "stride_qt",
            "stride_qh",
            "stride_kt",
            "stride_kh",
            "stride_vt",
            "stride_vh",
            "stride_ct",
            "cache_row",
        ),
        "eps": "fp32",
    }
    for zc in (False, True):
        consts = {"ZERO_CENTERED": zc, "BLOCK_D": 256, "KV_FP8": False}
        out.append((f"qk_norm_rope_kv[{dtype}, zc={zc}]", _qk_norm_rope_kv_kernel, rope, consts))
    tables = {
        "pos_ptr": "*i64",
        "freq_ptr": "*fp32",
        "cos_ptr": f"*{dtype}",
        "sin_ptr": f"*{dtype}",
        "R": "i32",
        "scaling": "fp32",
    }
    out.append((f"rotary_cos_sin[{dtype}]", _cos_sin_kernel, tables, {"BLOCK_R": 128}))
    strides = ints(
        "stride_qt",
        "stride_qh",
        "stride_kp",
        "stride_ks",
        "stride_kh",
        "stride_vp",
        "stride_vs",
        "stride_vh",
        "stride_ot",
        "stride_oh",
        "stride_pt",
        "stride_sp",
        "stride_ss",
        "stride_sh",
    )
    # a pool of the model dtype: the scale pointers are the caches, never read
    paged = {
        **{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "ks_ptr", "vs_ptr")},
        "page_table_ptr": "*i32",
        "positions_ptr": "*i64",
        **strides,
        "scale": "fp32",
    }
    shape = {"PAGE_SIZE": 16, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 32, "KV_FP8": False, "WINDOW": 0}
    shape["RING_PAGES"] = 0
    decode = {**paged, "token_req_ptr": "*i32", "part_ptr": "*fp32"}
    decode.pop("out_ptr")
    out.append(
        (
            f"paged_attention_decode[{dtype}]",
            _decode_split_kernel,
            decode,
            {**shape, "BLOCK_G": 16, "SPLITS": DECODE_SPLITS, "FP32_DOT": dtype == "fp32", "IEEE_DOT": dtype == "fp32"},
        )
    )
    out.append(
        (
            f"paged_attention_decode_combine[{dtype}]",
            _decode_combine_kernel,
            {"part_ptr": "*fp32", "out_ptr": f"*{dtype}", "sinks_ptr": f"*{dtype}", **ints("stride_ot", "stride_oh")},
            {"HEAD_DIM": 128, "BLOCK_D": 128, "SPLITS": DECODE_SPLITS, "HAS_SINKS": False},
        )
    )
    prefill = {**paged, **{p: "*i32" for p in ("query_start_ptr", "block_req_ptr", "block_first_ptr")}}
    prefill["sinks_ptr"] = f"*{dtype}"
    prefill["scale_log2"] = prefill.pop("scale")
    # with the tiles and warps the entry point launches, at both head sizes served: Qwen3-30B-A3B (32 heads,
    # 4 kv heads, 128) and Qwen3.5/3.6's gated attention (16 heads, 2 kv heads, 256)
    for head_dim, group in ((128, 8), (256, 8)):
        rows, keys, warps = prefill_tiles(head_dim, group)
        consts = {
            "PAGE_SIZE": 16,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "BLOCK_D": head_dim,
            "BLOCK_N": keys,
            "BLOCK_T": rows // group,
            "BLOCK_R": rows,
            "FP32_DOT": dtype == "fp32",
            "KV_FP8": False,
            "WINDOW": 0,
            "RING_PAGES": 0,
            "HAS_SINKS": False,
        }
        out.append(
            (
                f"paged_attention_prefill[{dtype}, d={head_dim}]",
                _prefill_kernel,
                prefill,
                consts,
                {"num_warps": warps, "num_stages": 2},
            )
        )
    if dtype == "bf16":
        out.extend(fp8_kv_signatures(rope, decode, prefill, shape))
        out.extend(sliding_sink_signatures(decode, prefill))
    out.extend(moe_block_signatures(dtype))
    out.extend(gated_deltanet_signatures(dtype))
    return out


def sliding_sink_signatures(decode: dict, prefill: dict) -> list:
    """gpt-oss's attention (bf16): 64 heads over 8 kv heads of 64, a sliding window of 128 keys and a sink per
    head, as decode (split + combine) and prefill launch them."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    rows, keys, warps = prefill_tiles(64, 8)
    shape = {
        "PAGE_SIZE": 16,
        "GROUP": 8,
        "HEAD_DIM": 64,
        "BLOCK_D": 64,
        "KV_FP8": False,
        "WINDOW": 128,
        "RING_PAGES": 0,
    }
    combine = {"part_ptr": "*fp32", "out_ptr": "*bf16", "sinks_ptr": "*bf16", **ints("stride_ot", "stride_oh")}
    prefill_consts = {**shape, "BLOCK_N": keys, "BLOCK_T": rows // 8, "BLOCK_R": rows, "FP32_DOT": False}
    decode_consts = {
        **shape,
        "BLOCK_N": 32,
        "BLOCK_G": 16,
        "SPLITS": DECODE_SPLITS,
        "FP32_DOT": False,
        "IEEE_DOT": False,
    }
    # its sliding layers in rings (plan/kv_groups.py): read through the requests' int64 slots, 520 pages a ring
    # (a window of 128 and an 8,192-token chunk)
    ring = {"RING_PAGES": 520}
    return [
        (
            "paged_attention_decode[bf16, window, sinks, ring]",
            _decode_split_kernel,
            {**decode, "page_table_ptr": "*i64"},
            {**decode_consts, **ring},
        ),
        (
            "paged_attention_prefill[bf16, window, sinks, ring, d=64]",
            _prefill_kernel,
            {**prefill, "page_table_ptr": "*i64"},
            {**prefill_consts, "HAS_SINKS": True, **ring},
            {"num_warps": warps, "num_stages": 2},
        ),
        (
            "paged_attention_decode[bf16, window, sinks]",
            _decode_split_kernel,
            decode,
            decode_consts,
        ),
        (
            "paged_attention_decode_combine[bf16, window, sinks]",
            _decode_combine_kernel,
            combine,
            {"HEAD_DIM": 64, "BLOCK_D": 64, "SPLITS": DECODE_SPLITS, "HAS_SINKS": True},
        ),
        (
            "paged_attention_prefill[bf16, window, sinks, d=64]",
            _prefill_kernel,
            prefill,
            {**prefill_consts, "HAS_SINKS": True},
            {"num_warps": warps, "num_stages": 2},
        ),
    ]


def fp8_kv_signatures(rope: dict, decode: dict, prefill: dict, shape: dict) -> list:
    """The same kernels on an fp8 KV pool (--kv-cache-dtype fp8; bf16 models): e4m3 caches, float32 scales,
    as they launch; and the long prefill's gather that dequantizes a request's K or V for FlashAttention."""
    fp8 = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    cache = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    out = [
        (
            "qk_norm_rope_kv[bf16, fp8 kv]",
            _qk_norm_rope_kv_kernel,
            {**rope, **cache},
            {"ZERO_CENTERED": True, "BLOCK_D": 256, "KV_FP8": True},
        ),
        (
            "paged_attention_decode[bf16, fp8 kv]",
            _decode_split_kernel,
            {**decode, **fp8},
            {**shape, "BLOCK_G": 16, "SPLITS": DECODE_SPLITS, "FP32_DOT": False, "IEEE_DOT": False, "KV_FP8": True},
        ),
    ]
    for head_dim, group in ((128, 8), (256, 8)):
        rows, keys, warps = prefill_tiles(head_dim, group)
        consts = {
            "PAGE_SIZE": 16,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "BLOCK_D": head_dim,
            "BLOCK_N": keys,
            "BLOCK_T": rows // group,
            "BLOCK_R": rows,
            "FP32_DOT": False,
            "KV_FP8": True,
            "WINDOW": 0,
            "RING_PAGES": 0,
            "HAS_SINKS": False,
        }
        out.append(
            (
                f"paged_attention_prefill[bf16, fp8 kv, d={head_dim}]",
                _prefill_kernel,
                {**prefill, **fp8},
                consts,
                {"num_warps": warps, "num_stages": 2},
            )
        )
    gather = {
        "cache_ptr": "*fp8e4nv",
        "scale_ptr": "*fp32",
        "pages_ptr": "*i32",
        "out_ptr": "*bf16",
        "length": "i32",
        **{n: "i32" for n in ("stride_cp", "stride_cs", "stride_ch", "stride_sp", "stride_ss", "stride_sh")},
    }
    out.append(
        (
            "kv_gather_dequantize[bf16, fp8 kv]",
            _gather_dequantize_kernel,
            gather,
            {"PAGE_SIZE": 16, "KV_HEADS": 2, "HEAD_DIM": 256, "BLOCK_T": GATHER_BLOCK_T, "BLOCK_D": 256},
        )
    )
    return out


def moe_block_signatures(dtype: str) -> list:
    """The MoE block's kernels at the H200 benchmark's shapes (Qwen3.6-35B-A3B: 256 experts, top 8,
    hidden 2048, shared expert intermediate 512)."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    out = []
    router = {
        "logits_ptr": f"*{dtype}",
        "ids_ptr": "*i64",
        "weights_ptr": f"*{dtype}",
        "shared_ptr": f"*{dtype}",
        "bias_ptr": f"*{dtype}",  # unused: router_topk_triton passes the logits there
        **ints("stride_t", "E", "group_size"),
        "scaling": "fp32",
    }
    for norm in (False, True):
        for shared in (False, True):
            consts = {"TOP_K": 8, "NORM_TOPK": norm, "HAS_SHARED": shared, "BLOCK_E": 256, "BLOCK_K": 8}
            consts.update(SIGMOID=False, HAS_BIAS=False, GROUPS=1, TOPK_GROUPS=1, BLOCK_G=1)  # as launched
            out.append((f"router_topk[{dtype}, norm={norm}, shared={shared}]", _router_topk_kernel, router, consts))
    # the sigmoid router (float32 logits): GLM-4.6's 160 experts in one group, DeepSeek-V3's 4 of 8 groups
    sigmoid_router = dict(router, logits_ptr="*fp32", bias_ptr="*fp32")
    for groups, topk_groups in ((1, 1), (8, 4)):
        consts = {"TOP_K": 8, "NORM_TOPK": True, "HAS_SHARED": False, "BLOCK_E": 256, "BLOCK_K": 8, "SIGMOID": True}
        consts.update(HAS_BIAS=True, GROUPS=groups, TOPK_GROUPS=topk_groups, BLOCK_G=groups)
        name = f"router_topk[{dtype}, sigmoid, groups={topk_groups}of{groups}]"
        out.append((name, _router_topk_kernel, sigmoid_router, consts))
    mark = {"ids_ptr": "*i64", "n_rows_ptr": "*i32", "table_ptr": "*i32", **ints("stride_t", "layer", "E")}
    for has_n_rows in (False, True):
        out.append(
            (
                f"mark_routed[{dtype}, n_rows={has_n_rows}]",
                _mark_routed_kernel,
                mark,
                {"TOP_K": 8, "HAS_N_ROWS": has_n_rows, "BLOCK_K": 8},
            )
        )
    silu = {"gate_up_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "I": "i32"}
    out.append((f"silu_mul[{dtype}]", _silu_mul_kernel, silu, {"BLOCK_I": 512}))
    combine = {**{p: f"*{dtype}" for p in ("routed_ptr", "gate_ptr", "shared_ptr", "out_ptr")}, "H": "i32"}
    out.append((f"moe_combine[{dtype}]", _moe_combine_kernel, combine, {"BLOCK_H": 1024, "ROWS": False, "TOP_K": 1}))
    out.append(
        (
            f"moe_combine[{dtype}, rows]",
            _moe_combine_kernel,
            {**combine, "routed_ptr": "*fp32", "shared_ptr": "*fp32"},
            {"BLOCK_H": 1024, "ROWS": True, "TOP_K": 8},
        )
    )
    return out


def gated_deltanet_signatures(dtype: str) -> list:
    """The Gated DeltaNet decode kernels and the prefill's conv kernels at the 35B's shapes (16 key heads,
    32 value heads, 128-dim heads, conv kernel 4)."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    conv = {
        **{p: f"*{dtype}" for p in ("x_ptr", "conv_ptr", "w_ptr", "out_ptr")},
        "slot_ptr": "*i64",
        **ints("C", "stride_x", "stride_cs", "stride_cc", "stride_wc"),
    }
    rule = {
        **{p: f"*{dtype}" for p in ("qkv_ptr", "z_ptr", "b_ptr", "a_ptr", "norm_w_ptr", "out_ptr")},
        **{p: "*fp32" for p in ("a_log_ptr", "dt_bias_ptr", "state_ptr")},
        "slot_ptr": "*i64",
        **ints(
            "stride_qkv", "stride_z", "stride_b", "stride_a", "stride_ss", "stride_sh", "key_size", "v_heads", "group"
        ),
        "scale": "fp32",
        "eps": "fp32",
    }
    prefill = {
        **{p: f"*{dtype}" for p in ("x_ptr", "conv_ptr", "w_ptr", "out_ptr")},
        "slot_ptr": "*i64",
        "start_ptr": "*i32",
        **ints("C", "stride_x", "stride_cs", "stride_cc", "stride_wc"),
    }
    state = {k: v for k, v in prefill.items() if k not in ("out_ptr", "stride_wc")}
    return [
        (
            f"gated_deltanet_conv_prefill[{dtype}]",
            _conv_prefill_kernel,
            prefill,
            {"KERNEL": 4, "BLOCK_T": CONV_BLOCK_T, "BLOCK_C": CONV_BLOCK_C},
        ),
        (
            f"gated_deltanet_conv_state[{dtype}]",
            _conv_state_kernel,
            state,
            {"KERNEL": 4, "BLOCK_K": 4, "BLOCK_C": CONV_BLOCK_C},
        ),
        (
            f"gated_deltanet_conv_decode[{dtype}]",
            _conv_decode_kernel,
            conv,
            {"KERNEL": 4, "BLOCK_K": 4, "BLOCK_C": 256},
        ),
        (
            f"gated_deltanet_rule_norm[{dtype}]",
            _rule_norm_kernel,
            rule,
            {"K_DIM": 128, "V_DIM": 128, "BLOCK_K": 128, "BLOCK_V": 128},
            {"num_warps": rule_norm_warps(128, 128)},
        ),
    ]


if __name__ == "__main__":
    print_results(signatures)
