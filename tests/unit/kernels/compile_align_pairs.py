"""The alignment's four kernels (kernels/align_pairs.py) compiled for Hopper without a GPU
(hopper_compile.py; run by test_align_pairs.py), for both index dtypes a caller passes."""

from __future__ import annotations

import json

from hopper_compile import compile_each

import ferry.kernels.align_pairs as a


def signatures() -> list:
    i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
    out = []
    for dtype in ("i32", "i64"):
        count = {
            "slots_ptr": f"*{dtype}",
            "hist_ptr": "*i32",
            "sorted_ptr": "*i32",
            **i32("n", "num_slots", "tile", "fill_len", "fill_share"),
            "CHUNK": "constexpr",
            "BINS": "constexpr",
        }
        scatter = {
            "slots_ptr": f"*{dtype}",
            "hist_ptr": "*i32",
            "block_start_ptr": "*i32",
            "sorted_ptr": "*i32",
            "block_slot_ptr": "*i32",
            **i32("n", "num_slots", "tile", "block_m", "num_blocks", "block_share", "search_steps", "fill_len"),
            "SUB": "constexpr",
        }
        out.append((f"_count_kernel[{dtype}]", a._count_kernel, count, {"CHUNK": a.CHUNK, "BINS": a.BINS}))
        out.append((f"_scatter_kernel[{dtype}]", a._scatter_kernel, scatter, {"SUB": a.SUB}))
    column = {
        "hist_ptr": "*i32",
        "block_start_ptr": "*i32",
        **i32("num_tiles", "num_slots", "block_m"),
        "BINS": "constexpr",
    }
    prefix = {"block_start_ptr": "*i32", "num_slots": "i32", "BINS": "constexpr"}
    out.append(("_column_kernel", a._column_kernel, column, {"BINS": a.BINS}))
    out.append(("_prefix_kernel", a._prefix_kernel, prefix, {"BINS": a.BINS}))
    return out


if __name__ == "__main__":
    print(json.dumps(compile_each(signatures())))
