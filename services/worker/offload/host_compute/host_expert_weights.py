"""One routed expert's weights in the compute dtype, read on the host from the bank the PCIe copies read
(host_banks.py, packed_banks.py): what host_experts.py multiplies by. No second copy of a bank: a
plain bank in the compute dtype is used in place, and every other bank is decoded one expert at a
time into a scratch of one expert, which the next expert overwrites.

Decoding uses only torch's vectorised elementwise ops on contiguous tensors of one dtype, in place
on buffers allocated once. On a 2-core EPYC host (one w13 of the Qwen3-30B shapes,
3.1 M values, one thread) an int16 pass costs 0.07-0.14 ms, while torch's float8 -> float conversion is
a scalar loop (12.6 ms), a gather from a 256-entry table (index_select) 0.9 ms for half the values, and
a strided or mixed-dtype op 1-4 ms. So each format's codes become float16 *bit patterns* through
integer ops:

* e4m3 (fp8 weights, nvfp4 group scales): its 7 magnitude bits shifted left 7 land on float16's
  exponent and mantissa fields, and since both formats start their exponent field at 0 with the
  same subnormal rule, the float16 read is the value times 2^-8 exactly, subnormals included;
* e2m1 (nvfp4 codes): its 3 magnitude bits shifted left 9 are the value times 2^-14, the same way;
* packed bf16 (kernels/expert_pack.py): the sign, mantissa and exponent code are put back into
  bf16's bits, as unpack_expert_reference does (a code 0 keeps its byte's mantissa bits, which the
  packer writes only for an escape, overwritten from the escape list).

float16 -> float32 is a vectorised conversion, and the power of two is folded into the scales, so
every weight is dequantized exactly as kernels/quantized_experts.py does: float32 math, one rounding
to the compute dtype. e4m3fn's NaN code (0x7F) decodes as 480 x scale instead: quantizers clamp to
448, so no checkpoint holds it, and a test on it would cost a pass over every weight.

Each reader answers `expert(moe_layer, expert) -> (w13 [2I, H], w2 [H, I])`, valid until its next
call, `biases(moe_layer, expert) -> (b13 [2I], b2 [H])` in the compute dtype (rounded to it as the reference
twin rounds them), or (None, None) for experts without biases, and has the experts' `activation`
(kernels/expert_epilogue.py). A reader and its scratch belong to one thread (host_experts.py's)."""

from __future__ import annotations

import sys

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL, ExpertActivation
from ferry.kernels.quantized_experts import QuantizedFamily

if sys.byteorder != "little":  # the int16 lanes of an int32 word below are read in little-endian order
    raise ImportError("host expert decoding assumes a little-endian host")

# int16 masks, written as the signed values torch's int16 ops take
SIGN_AND_MANTISSA = 0x807F - 0x10000  # bf16: sign bit and 7 mantissa bits, from a sign-extended byte
NOT_BIT_14 = 0xBFFF - 0x10000  # e4m3 shifted left 7: drops the sign's extension below bit 15
E2M1_FIELDS = 0x8E00 - 0x10000  # e2m1 code shifted to float16: sign and the 3 magnitude bits
NIBBLE_LANES = 0x000F000F  # a byte's two nibbles, each at the bottom of its int16 lane
SPREAD_NIBBLES = 1 + (1 << 12)  # b * 4097 = b | b << 12 (no carry: b < 256)
E4M3_IN_FP16 = 2.0**8  # what an e4m3 read as float16 bits (shifted left 7) is short of
E2M1_IN_FP16 = 2.0**14  # the same for an e2m1 code shifted left 9
# Values a decoding pass covers: a chunk's temporaries stay in the caches between passes. On the 2-core
# EPYC (Qwen3-30B experts of 4.7 M values, 1 / 2 threads) chunks of 1 Mi decode an fp8 expert in
# 2.4 / 1.7 ms against 3.0 / 2.8 in chunks of 2 Mi, an nvfp4 one in 3.3 / 3.4 against 5.0 / 3.6, a packed
# one in 2.2-2.3 / 1.5-1.9 against 2.2-2.9 / 1.8-2.9 whole; chunks of 128 Ki take 2.8-5.0 ms, paying
# torch's few microseconds a call.
DECODE_CHUNK = 1 << 20


def nibble_codes(packed: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., N] of two 4-bit codes each (element 2j in the low nibble) -> int16 codes
    [..., 2N], in `words` (int32 [..., N]): each byte spread so its two nibbles sit at the bottom
    of the word's two int16 lanes, low lane first."""
    words.copy_(packed)
    return words.mul_(SPREAD_NIBBLES).bitwise_and_(NIBBLE_LANES).view(torch.int16)


def e4m3_as_fp16(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [...] -> float16 [...] of the value x 2^-8, through `out` (int16, same shape)."""
    out.copy_(codes.view(torch.int8))  # sign-extended: the sign fills bits 7-15
    return out.bitwise_left_shift_(7).bitwise_and_(NOT_BIT_14).view(torch.float16)


def e2m1_as_fp16(codes: torch.Tensor) -> torch.Tensor:
    """int16 e2m1 codes (0-15, bit 3 the sign) -> float16 of the value x 2^-14, in place."""
    # shifted to the top and back arithmetically, the sign bit fills bits 12-15; the mask keeps bit 15
    return codes.bitwise_left_shift_(12).bitwise_right_shift_(3).bitwise_and_(E2M1_FIELDS).view(torch.float16)


class PlainReader:
    """Plain banks (HostBanks of w13 [E, 2I, H], w2 [E, H, I]): the bank's own rows when they are in the
    compute dtype, else each expert converted into a scratch. `biased`: each expert's rows continue past its
    weights with its biases (bf16.py's bias_rows: the gate/up biases flat from row 2I of w13, the down biases
    from row H of w2)."""

    def __init__(self, banks, dtype: torch.dtype, biased: bool = False, activation: ExpertActivation = SILU_AND_MUL):
        self.banks, self.dtype, self.in_place = banks, dtype, banks.dtype == dtype
        self.biased, self.activation = biased, activation
        self.inter, self.hidden = banks.intermediate_size, banks.hidden_size
        if not self.in_place:
            (shape13, _), (shape2, _) = banks.format.row_shapes()
            self.w13, self.w2 = torch.empty(shape13, dtype=dtype), torch.empty(shape2, dtype=dtype)

    def expert(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = self.banks.w13[moe_layer][expert], self.banks.w2[moe_layer][expert]
        if not self.in_place:
            w13, w2 = self.w13.copy_(w13), self.w2.copy_(w2)
        return w13[: 2 * self.inter], w2[: self.hidden]  # the weight rows: the bias rows, if any, follow

    def biases(self, moe_layer: int, expert: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.biased:
            return None, None
        w13, w2 = self.banks.w13[moe_layer][expert], self.banks.w2[moe_layer][expert]
        b13 = w13[2 * self.inter :].reshape(-1)[: 2 * self.inter]
        b2 = w2[self.hidden :].reshape(-1)[: self.hidden]
        return b13.to(self.dtype), b2.to(self.dtype)


class PackedReader:
    """Packed banks (PackedHostBanks): lo, hi, base and the escapes of one expert back into bf16 bits."""

    def __init__(self, banks, dtype: torch.dtype, chunk: int = DECODE_CHUNK):
        if chunk < 2 or chunk % 2:
            raise ValueError(f"packed experts decode an even number of values a chunk, not {chunk}")
        self.banks = banks
        i, h, v13 = banks.intermediate_size, banks.hidden_size, banks.v13
        v = v13 + banks.v2
        self.families = ((0, v13), (v13, v))  # value ranges of w13 and w2, each with its exponent base
        self.chunk = chunk = min(chunk, v)
        self.words = torch.empty(chunk // 2, dtype=torch.int32)  # a chunk's exponent codes, then fields
        self.nonzero = torch.empty(chunk, dtype=torch.int16)
        self.bf16 = torch.empty(v, dtype=torch.bfloat16)
        # float32 (or any other) compute: the bf16 values converted once more, exactly
        self.values = self.bf16 if dtype == torch.bfloat16 else torch.empty(v, dtype=dtype)
        self.w13 = self.values[:v13].view(2 * i, h)
        self.w2 = self.values[v13:].view(h, i)
        # packed banks hold experts without biases (packed_banks.py refuses them), with their model's activation
        self.activation = banks.format.activation

    def biases(self, moe_layer: int, expert: int) -> tuple[None, None]:
        return None, None

    def expert(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.banks
        lo, hi, bits = b.lo[moe_layer][expert], b.hi[moe_layer][expert], self.bf16.view(torch.int16)
        for (first, end), base in zip(self.families, b.base[moe_layer][expert].tolist()):
            for a in range(first, end, self.chunk):  # even bounds: V13 is a multiple of 4 (check_packable)
                z = min(self.chunk, end - a)
                exponent = nibble_codes(hi[a // 2 : (a + z) // 2], self.words[: z // 2])
                # code 0 is a zero (or an escape): exponent field 0; any other code sits `base` above
                nonzero = torch.clamp(exponent, max=1, out=self.nonzero[:z])
                exponent.add_(nonzero.mul_(base)).bitwise_left_shift_(7)
                # lo is the sign then 7 mantissa bits: read as int8 it sign-extends, and the mask keeps
                # the sign at bit 15
                out = bits[a : a + z].copy_(lo[a : a + z].view(torch.int8))
                out.bitwise_and_(SIGN_AND_MANTISSA).bitwise_or_(exponent)
        index, escaped = b.escapes(moe_layer, expert)
        if index.numel():
            bits[index.long()] = escaped
        if self.values is not self.bf16:
            self.values.copy_(self.bf16)
        return self.w13, self.w2


class QuantizedFamilyReader:
    """One weight family (w13 or w2) of a quantized bank, dequantized into a scratch [O, IN], a chunk
    of rows at a time: the codes as float16 bits, to float32, times the scales (with the bits' power
    of two folded in), rounded once to the compute dtype. Each quantized format's reader
    (services/worker/expert_formats/<format>.py) adds its scratch and decodes a chunk (`decode_rows`)."""

    def __init__(self, family: QuantizedFamily, dtype: torch.dtype, chunk: int = DECODE_CHUNK):
        rows, cols = family.rows, family.cols
        self.chunk_rows = max(1, min(rows, chunk // cols))
        self.codes = torch.empty(self.chunk_rows, cols, dtype=torch.int16)
        self.words = self.codes.view(torch.int32)  # nvfp4: one code byte per word, spread into two lanes
        self.out = torch.empty(rows, cols, dtype=dtype)
        # float32 compute scales in place; any other dtype is rounded from a float32 chunk
        self.float32 = None if dtype == torch.float32 else torch.empty(self.chunk_rows, cols, dtype=torch.float32)

    def weights(self, f: QuantizedFamily, expert: int) -> torch.Tensor:
        """Expert `expert` of family `f` (of this reader's layout: any MoE layer's)."""
        for r0 in range(0, f.rows, self.chunk_rows):
            r1 = min(f.rows, r0 + self.chunk_rows)
            stage = self.out[r0:r1] if self.float32 is None else self.float32[: r1 - r0]
            self.decode_rows(f, expert, r0, r1, stage)
            if self.float32 is not None:
                self.out[r0:r1].copy_(stage)
        return self.out

    def decode_rows(self, f: QuantizedFamily, expert: int, r0: int, r1: int, stage: torch.Tensor) -> None:
        """Rows r0:r1 of expert `expert` of family `f`, dequantized in float32 (or the compute dtype) into `stage`."""
        raise NotImplementedError


class QuantizedReader:
    """Quantized banks (HostBanks in a quantized format: nvfp4, mxfp4, fp8-block...): each family's byte rows read
    through the format's typed views (kernels/quantized_experts.py), dequantized per expert."""

    def __init__(self, banks, dtype: torch.dtype, chunk: int = DECODE_CHUNK):
        self.views = [
            banks.format.gemm_views(w13, w2, layer) for layer, (w13, w2) in enumerate(zip(banks.w13, banks.w2))
        ]
        self.dtype = dtype
        self.w13 = banks.format.family_reader(self.views[0][0], dtype, chunk)
        self.w2 = banks.format.family_reader(self.views[0][1], dtype, chunk)
        self.activation = self.views[0][0].activation

    def expert(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        family13, family2 = self.views[moe_layer]
        return self.w13.weights(family13, expert), self.w2.weights(family2, expert)

    def biases(self, moe_layer: int, expert: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows' float32 bias parts, rounded to the compute dtype (as the twin adds them)."""
        family13, family2 = self.views[moe_layer]
        if family13.bias is None:
            return None, None
        return family13.bias[expert].to(self.dtype), family2.bias[expert].to(self.dtype)


def expert_reader(banks, dtype: torch.dtype, chunk: int = DECODE_CHUNK):
    """The reader for these banks' format (its `host_reader`), computing in `dtype`, decoding about `chunk`
    values a pass."""
    return banks.format.host_reader(banks, dtype, chunk)
