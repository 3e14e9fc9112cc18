"""The tile shapes of the decode expert GEMVs (kernels/expert_pair_gemv.py and its quantized twins in
kernels/quantized_expert_gemv.py), one entry per expert format, in one table so that the bench that
measures them (bench/pair_gemv_sweep.py) and the kernels read the same numbers.

A decode step reads each routed expert's weights once, so the kernels are paced by how many bytes
are in flight: the rows a program computes (`*_rows`) times the inputs it reads per loop step
(`*_k`: inputs for bf16, 16-input groups for NVFP4, 32-input ones for MXFP4, 128-input blocks for
FP8) set one program's loads, and the program count (pairs x outputs / rows) how many of those run at once. The values
are the sweep's best (rerun it on a new card). A tile decides the order in which
a program sums its products, so results move by float32 rounding from one tile to another; every
store computes a step with the same tiles, so offloaded and all-resident still agree bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.plan.expert_formats import BF16, FP8_BLOCK, MXFP4, NVFP4


@dataclass(frozen=True)
class PairTiles:
    gate_up_rows: int  # outputs (of I) a gate/up program computes, for gate and up each
    gate_up_k: int  # inputs (of H) a gate/up loop step reads: values (bf16), groups (NVFP4, MXFP4), blocks of 128 (FP8)
    down_rows: int  # outputs (of H) a down program computes
    down_k: int  # inputs (of I) a down loop step reads, in the same units
    gate_up_warps: int = 4
    down_warps: int = 4


# bench/pair_gemv_sweep.py, one layer's 8 pairs at 1 token and 64 at 8, 35B / 30B expert shapes,
# µs against the HBM bound (the quantized kernels summing per scale group):
#   bf16   16.3 / 26.9 at 1 token (bounds 12.8 / 19.2; the earlier 16-row, 128-input tiles: 36.4 / 41.0),
#          101.2 / 144.5 at 8 (bounds 96.1 / 144.2): 512 inputs a step keep 16 KB of loads in flight a program
#   nvfp4  17.7 / 24.0 at 1 token (bounds 3.5 / 5.2; 22.5 / 31.2 dequantizing every weight): no tile moved
#          it, the decoding of the codes paces it
#   fp8    11.2 / 13.9 at 1 token (bounds 6.2 / 9.2; 17.2 / 23.8 before), 61.6 / 83.0 at 8 (46.2 / 69.3)
TILES = {
    BF16: PairTiles(gate_up_rows=16, gate_up_k=512, down_rows=16, down_k=128, down_warps=8),
    NVFP4: PairTiles(gate_up_rows=8, gate_up_k=16, down_rows=16, down_k=16),
    FP8_BLOCK: PairTiles(gate_up_rows=8, gate_up_k=2, down_rows=32, down_k=2),
    # not swept yet: NVFP4's tiles, each step reading the same 256 (gate/up) and 256 (down) inputs
    MXFP4: PairTiles(gate_up_rows=8, gate_up_k=8, down_rows=16, down_k=8),
}
