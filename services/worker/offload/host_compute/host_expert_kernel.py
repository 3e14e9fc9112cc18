"""The host's own expert kernel (kernels/host_experts_c/): HostExperts' `c` backend.

torch's CPU matmuls read plain bf16 banks at about a sixth of a server host's memory bandwidth, and the quantized
banks' decode through torch ops is 10-60x slower still. The C kernel reads each used expert's rows once for all its
tokens, decoding nvfp4, mxfp4 and fp8-block codes and GGUF blocks (each family's block type: gguf-mixed's differ by
layer) in registers, with AVX-512 BF16 where the CPU has it (chosen at load by cpuid) and portable C elsewhere, on a
pthread pool of its own sized by `threads`.

The library is built from source by `pip install` (pyproject.toml's ext-modules, optional: a
machine without a C compiler still installs) and loaded with ctypes, which releases the GIL for the
call; torch is no build requirement. `library()` says why it is not there when it is not.

Packed banks (packed_banks.py, the default host format for bf16 models) are decoded in the rows too:
lo, hi and the family's exponent base into bf16 bits in registers, the escapes written from the
sealed escape lists (the banks are sealed here if they are not yet), then the plain bf16 rows' math.

FERRY_HOST_KERNEL_ISA=portable|avx512|auto picks the rows' instruction set (the tests force each).
FERRY_HOST_KERNEL_PREFETCH=N (bytes, default 4096; 0: none) has the AVX-512 rows ask the CPU for the weights
N bytes ahead of those they multiply: a server core's hardware prefetcher stops at each 4 KiB page, which a
bf16 row of 2,048 values fills; plain and packed banks read 7-25 % faster so on a server host, nvfp4 (bound
by its decode) the same.
FERRY_HOST_POOL_SPIN_US=N (default 50) is how long the pool's idle workers spin before they sleep.

The pool's threads run on `cpus` in order (plan/expert_backend.chosen_host_cpus): the first is the caller's,
taken only by a thread that runs nothing but the pool's calls (a decode graph's host nodes on the CUDA
driver's thread, or the polling thread: decode_share.py), the rest the started workers'."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import weakref
from collections.abc import Sequence

import torch

from ferry.kernels.expert_epilogue import (
    GELU_TANH_AND_MUL,
    GELU_TANH_CODE,
    SILU_AND_MUL,
    SILU_CODE,
    SWIGLU_CODE,
    ExpertActivation,
)

LIBRARY_MODULE = "ferry.kernels._host_experts_c"
ISA_ENV = "FERRY_HOST_KERNEL_ISA"
PREFETCH_ENV = "FERRY_HOST_KERNEL_PREFETCH"
# one bf16 row ahead: a server core's hardware prefetcher stops at each 4 KiB page, which such a row fills
DEFAULT_PREFETCH_BYTES = 4096
SPIN_ENV = "FERRY_HOST_POOL_SPIN_US"
# an idle worker's spin before it sleeps: past it, the next call wakes it by a futex. A longer spin loses on a
# small host with a busy process on the workers' core, where spinning takes that process's time; on cores of
# their own FERRY_HOST_POOL_SPIN_US=N may do better (a decode step's layers come ~0.3-0.7 ms apart)
DEFAULT_SPIN_US = 50
ISAS = {"auto": 0, "portable": 1, "avx512": 2}  # enum ferry_isa (expert_job.h)
F32, BF16, FP8_BLOCK, NVFP4, PACKED, MXFP4, GGUF = range(7)  # enum ferry_format
# enum ferry_ggml_type (gguf_blocks.h): a GGUF family's block type, by its ggml name
GGML_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
NO_GGML_TYPE = -1  # ferry_family's ggml_type of the other formats
ACTS = {torch.float32: 0, torch.bfloat16: 1}  # enum ferry_act: the compute dtypes the kernel has
# enum ferry_activation (expert_job.h): the experts' activations the kernel computes, by kernels/expert_epilogue.py's
# code; any other is refused here (`activation_of`), never computed as another
ACTIVATIONS = {SILU_CODE: "silu", SWIGLU_CODE: "clamped SwiGLU", GELU_TANH_CODE: "gelu_tanh"}
NO_BIAS = -1  # ferry_family's bias_offset of experts without biases
ERRORS = {-1: "an invalid job", -2: "an instruction set this CPU lacks", -3: "out of memory"}


class Family(ctypes.Structure):
    """ferry_family (expert_job.h): one weight family's rows in a layer's bank."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("expert_stride", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("part_rows", ctypes.c_int64),
        ("q_offset", ctypes.c_int64),
        ("scale_offset", ctypes.c_int64),
        ("gscale_offset", ctypes.c_int64),
        ("col_blocks", ctypes.c_int64),
        ("hi", ctypes.c_void_p),
        ("hi_stride", ctypes.c_int64),
        ("exp_base", ctypes.c_void_p),
        ("esc_offsets", ctypes.c_void_p),
        ("esc_index", ctypes.c_void_p),
        ("esc_bits", ctypes.c_void_p),
        ("first_value", ctypes.c_int64),
        ("bias_offset", ctypes.c_int64),  # -1: no biases (NO_BIAS)
        ("ggml_type", ctypes.c_int64),  # GGUF: GGML_TYPES' index of the rows' block type
    ]


class Job(ctypes.Structure):
    """ferry_job (expert_job.h): one call."""

    _fields_ = [
        ("format", ctypes.c_int64),
        ("act", ctypes.c_int64),
        ("isa", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("n_pairs", ctypes.c_int64),
        ("pair_token", ctypes.c_void_p),
        ("pair_expert", ctypes.c_void_p),
        ("pair_weight", ctypes.c_void_p),
        ("w13", Family),
        ("w2", Family),
        ("out", ctypes.c_void_p),
        ("swiglu_limit", ctypes.c_double),  # the clamped SwiGLU's (ACTIVATIONS' CLAMPED_SWIGLU)
        ("swiglu_alpha", ctypes.c_double),
        ("activation", ctypes.c_int64),  # enum ferry_activation: ACTIVATIONS' codes
    ]


class KernelUnavailable(RuntimeError):
    """The C kernel cannot compute these banks here (no library, a format or dtype it lacks, an ISA the CPU lacks)."""


def library_path() -> str | None:
    """Where the built library lies (the extension's file, found as an import would find it), or None."""
    try:
        spec = importlib.util.find_spec(LIBRARY_MODULE)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


# every entry point's (argtypes, restype), bound by `bind`
SIGNATURES = {
    "ferry_host_isa_available": ([ctypes.c_int], ctypes.c_int),
    "ferry_host_kernel_create": ([ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int], ctypes.c_void_p),
    "ferry_host_kernel_pinned": ([ctypes.c_void_p], ctypes.c_int),
    "ferry_host_kernel_set_prefetch": ([ctypes.c_void_p, ctypes.c_int64], None),
    "ferry_host_kernel_set_spin": ([ctypes.c_void_p, ctypes.c_int64], None),
    "ferry_host_kernel_pin_caller": ([ctypes.c_void_p], ctypes.c_int),
    "ferry_host_kernel_caller_pinned": ([ctypes.c_void_p], ctypes.c_int),
    "ferry_host_kernel_destroy": ([ctypes.c_void_p], None),
    "ferry_host_kernel_compute": ([ctypes.c_void_p, ctypes.POINTER(Job)], ctypes.c_int),
    "ferry_host_decode_packed": (
        [ctypes.POINTER(Family), ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p],
        ctypes.c_int,
    ),
    "ferry_host_decode_rows": (
        [
            ctypes.POINTER(Family),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ],
        ctypes.c_int,
    ),
    "ferry_host_node": ([ctypes.c_void_p], None),  # host_node.h: a decode layer's host share (decode_share.py)
    "ferry_host_node_hist_bounds": ([ctypes.POINTER(ctypes.c_int64)], None),
    # host_poller.h: the same share handed over by polling (decode_share.py, FERRY_HOST_HANDOFF)
    "ferry_poller_create": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64], ctypes.c_void_p),
    "ferry_poller_destroy": ([ctypes.c_void_p], None),
    "ferry_poller_rounds": ([ctypes.c_void_p], ctypes.c_int64),
    "ferry_poll_flags_size": ([], ctypes.c_ulong),
}


def bind(lib: ctypes.CDLL) -> list[str]:
    """Give `lib`'s entry points their signatures; returns the names it lacks (a build of other sources, such as
    an older commit's kernel loaded to compare against)."""
    missing = []
    for name, (argtypes, restype) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.argtypes, fn.restype = argtypes, restype
    return missing


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not): loaded once a process."""
    path = library_path()
    if path is None:
        return None, f"{LIBRARY_MODULE} is not built (pip install builds it; it needs a C compiler)"
    try:
        lib = ctypes.CDLL(path)  # CDLL, not PyDLL: every call releases the GIL
    except OSError as e:
        return None, f"{path} failed to load: {e}"
    missing = bind(lib)
    if missing:
        return None, f"{path} lacks {', '.join(missing)}: it was built from other sources (pip install rebuilds it)"
    return lib, ""


def resolve_isa(isa: str | None) -> str:
    """The rows' instruction set: `isa`, else FERRY_HOST_KERNEL_ISA, else auto (the best the CPU has)."""
    isa = isa or os.environ.get(ISA_ENV, "").strip() or "auto"
    if isa not in ISAS:
        raise ValueError(f"unknown host kernel instruction set {isa!r} ({ISA_ENV}: one of {', '.join(ISAS)})")
    lib, _ = library()
    if isa == "auto" and lib is not None:
        return "avx512" if lib.ferry_host_isa_available(ISAS["avx512"]) else "portable"
    return isa


def _whole_setting(value: int | None, env: str, default: int, what: str, unit: str) -> int:
    """`value`, else the environment's `env`, else `default`: a whole number of `unit`, 0 or more."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ValueError(f"{env} must be a whole number of {unit}, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{what} must be 0 or more {unit}, got {value} ({env})")
    return value


def resolve_prefetch(prefetch: int | None) -> int:
    """The rows' prefetch distance in bytes: `prefetch`, else FERRY_HOST_KERNEL_PREFETCH, else the default."""
    return _whole_setting(
        prefetch, PREFETCH_ENV, DEFAULT_PREFETCH_BYTES, "the host kernel's prefetch distance", "bytes"
    )


def resolve_spin_us(spin_us: int | None) -> int:
    """How long the pool's idle workers spin before they sleep, in µs: `spin_us`, else FERRY_HOST_POOL_SPIN_US,
    else the default."""
    return _whole_setting(spin_us, SPIN_ENV, DEFAULT_SPIN_US, "the host pool's spin", "µs")


def _family(
    rows: torch.Tensor,
    out_rows: int,
    cols: int,
    part_rows: int,
    bias_offset: int,
    layout=None,
    ggml_type: str | None = None,
) -> Family:
    """One layer's bank of one family: plain rows [E, O, IN], or quantized byte rows [E, B] with their layout
    (GGUF blocks: of `ggml_type`); `bias_offset`: bytes from an expert's row start to its biases (NO_BIAS: none)."""
    f = Family(
        base=rows.data_ptr(),
        expert_stride=rows.stride(0) * rows.element_size(),
        rows=out_rows,
        cols=cols,
        part_rows=part_rows,
        bias_offset=bias_offset,
        ggml_type=NO_GGML_TYPE if ggml_type is None else GGML_TYPES.index(ggml_type),
    )
    if layout is not None:
        parts = {p.name: p for p in layout.parts}
        f.q_offset = parts["q"].offset
        f.scale_offset = parts["scale"].offset if "scale" in parts else 0  # GGUF: the scales are in the blocks
        f.gscale_offset = parts["gscale"].offset if "gscale" in parts else 0
        f.col_blocks = -(-cols // 128)
    return f


def _packed_families(banks, layer: int) -> tuple[Family, Family]:
    """One layer of packed banks (lo [E, V], hi [E, V // 2], base [E, 2], the sealed escapes): w13's
    values 0..V13 of each expert's row, w2's V13..V, each with its own exponent base."""
    lo, hi, base = banks.lo[layer], banks.hi[layer], banks.base[layer]
    h, i, v13 = banks.hidden_size, banks.intermediate_size, banks.v13
    escapes = dict(
        esc_offsets=banks.esc_offsets[layer].data_ptr(),
        esc_index=banks.esc_index[layer].data_ptr(),
        esc_bits=banks.esc_bits[layer].data_ptr(),
    )

    def family(which: int, first: int, rows: int, cols: int, part_rows: int) -> Family:
        return Family(
            base=lo.data_ptr() + first,
            expert_stride=lo.stride(0),
            rows=rows,
            cols=cols,
            part_rows=part_rows,
            hi=hi.data_ptr() + first // 2,
            hi_stride=hi.stride(0),
            exp_base=base.data_ptr() + 4 * which,
            first_value=first,
            bias_offset=NO_BIAS,
            **escapes,
        )

    return family(0, 0, 2 * i, h, i), family(1, v13, h, i, h)


def check_packed(banks) -> None:
    """KernelUnavailable unless the C kernel can read these packed banks as packed_rows.h does: even
    H and I (a row's codes start on a byte) and each expert's escape positions ascending (a row's
    escapes one run, walked in order; pack_experts writes them so)."""
    if banks.hidden_size % 2 or banks.intermediate_size % 2:
        raise KernelUnavailable(
            f"packed banks of odd shapes ({banks.hidden_size} x {banks.intermediate_size}) "
            "have no C kernel: a row's codes must start on a byte"
        )
    for blocks in (banks.lo, banks.hi, banks.base):
        if not all(b.is_contiguous() for b in blocks):
            raise KernelUnavailable("the C kernel reads contiguous bank blocks")
    v = banks.v13 + banks.v2
    for offsets, index in zip(banks.esc_offsets, banks.esc_index):
        n = int(offsets[-1])
        if n < 2:
            continue
        experts = torch.repeat_interleave(torch.arange(banks.num_experts), offsets.diff())
        key = experts * v + index[:n].long()  # strictly ascending exactly when each expert's positions are
        if not bool((key.diff() > 0).all()):
            raise KernelUnavailable("packed banks whose escapes are not in ascending order have no C kernel")


def bank_format(banks) -> int:
    """The kernel's format code for these banks (their expert format's), or KernelUnavailable."""
    return banks.format.host_kernel_format()


def activation_of(banks) -> tuple[int, float, float]:
    """(the kernel's activation code, the clamped SwiGLU's limit and alpha) of the banks' experts (their format's
    `activation`; a format without one: silu(gate) * up), or KernelUnavailable naming an activation the kernel
    lacks: it is compared whole, so a field the kernel does not read (a gelu that also clamps, a field added to
    ExpertActivation later) is refused rather than dropped."""
    activation = getattr(banks.format, "activation", SILU_AND_MUL)
    known = ", ".join(ACTIVATIONS.values())
    if isinstance(activation, ExpertActivation):
        if activation == GELU_TANH_AND_MUL:
            return GELU_TANH_CODE, 0.0, 1.0
        limit, alpha = float(activation.swiglu_limit), float(activation.swiglu_alpha)
        if activation == ExpertActivation(activation.swiglu_limit, activation.swiglu_alpha):
            if limit == 0.0:
                return SILU_CODE, 0.0, 1.0
            if limit > 0.0 and math.isfinite(limit) and math.isfinite(alpha):
                return SWIGLU_CODE, limit, alpha
    raise KernelUnavailable(f"the C kernel computes {known} experts, not these experts' activation {activation!r}")


def check_call(
    banks, dtype: torch.dtype, moe_layer: int, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor
) -> None:
    """A host expert call over `banks` in `dtype` (HostExperts' contract, both backends), or ValueError
    naming what is wrong: the layer, x [T, H] on the CPU in the compute dtype, each pair's token row and
    expert (int64 [P] each). The C code reads the banks by these indices unchecked."""
    if not 0 <= moe_layer < banks.num_layers:
        raise ValueError(f"MoE layer {moe_layer} is outside the banks' {banks.num_layers} layers")
    if x.dim() != 2 or x.shape[1] != banks.hidden_size or x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(
            f"x must be a CPU {dtype} tensor [T, {banks.hidden_size}], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    bad = (tokens < 0) | (tokens >= x.shape[0]) | (experts < 0) | (experts >= banks.num_experts)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"pair (token {int(tokens[i])}, expert {int(experts[i])}) is outside {x.shape[0]} tokens "
            f"and {banks.num_experts} experts"
        )


class HostKernel:
    """The C kernel over one set of host banks, computing in `dtype` on `threads` threads (its own pool) on
    `cpus`, the caller's first, then the started workers' (thread_pool.c; empty: unpinned); `pinned` says how
    many started workers were pinned, `caller_pinned` whether a caller was (1, an errno, or 0 before any asked);
    `prefetch`: the rows' prefetch distance in bytes (default: FERRY_HOST_KERNEL_PREFETCH, else 4096);
    `spin_us`: the idle workers' spin (default: FERRY_HOST_POOL_SPIN_US, else 50); `lib`: a loaded build of the
    library other than this tree's (`bind` given it its signatures), by default `library()`."""

    def __init__(
        self,
        banks,
        dtype: torch.dtype,
        threads: int,
        isa: str | None = None,
        cpus: Sequence[int] = (),
        prefetch: int | None = None,
        spin_us: int | None = None,
        lib: ctypes.CDLL | None = None,
    ):
        lib, why = (lib, "") if lib is not None else library()  # `lib`: another build, bound (a bench's)
        if lib is None:
            raise KernelUnavailable(why)
        if dtype not in ACTS:
            raise KernelUnavailable(f"the C kernel computes in float32 or bfloat16, not {dtype}")
        self.format, self.act, self.isa = bank_format(banks), ACTS[dtype], resolve_isa(isa)
        # the experts' activation: its code and the clamped SwiGLU's parameters (ferry_job's fields)
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation_of(banks)
        self.isa_code = ISAS[self.isa]
        self.dtype = dtype
        if not lib.ferry_host_isa_available(self.isa_code):
            raise KernelUnavailable(f"this CPU lacks the {self.isa} instructions the host kernel was asked for")
        self.banks, self.hidden, self.inter = (
            banks,
            banks.hidden_size,
            banks.intermediate_size,
        )  # alive while pointed at
        if self.format == PACKED:
            self._escape_blocks = None
            self._packed_layout()
        else:
            self.families = self._plain_or_quantized_families(banks)
        cpu_array = (ctypes.c_int * max(1, len(cpus)))(*cpus)
        self.lib, self.handle = lib, lib.ferry_host_kernel_create(threads, cpu_array, len(cpus))
        if not self.handle:
            raise KernelUnavailable(f"the host kernel could not start {threads} threads")
        self.cpus = list(cpus)
        self.pinned = lib.ferry_host_kernel_pinned(self.handle)
        self._destroy = weakref.finalize(self, lib.ferry_host_kernel_destroy, self.handle)  # joins its threads
        self.set_prefetch(resolve_prefetch(prefetch))
        self.set_spin(resolve_spin_us(spin_us))

    def set_spin(self, spin_us: int) -> None:
        """How long the pool's idle threads spin before they sleep, from their next wait on."""
        self.spin_us = resolve_spin_us(spin_us)
        self.lib.ferry_host_kernel_set_spin(self.handle, self.spin_us * 1000)

    @property
    def caller_pinned(self) -> int:
        """1 once a caller thread (a host node's, the poller's) was pinned to cpus[0], an errno where the OS
        refused, 0 before any asked (or with no CPUs)."""
        return self.lib.ferry_host_kernel_caller_pinned(self.handle)

    def set_prefetch(self, nbytes: int) -> None:
        """The rows' prefetch distance from the next call on (between calls: a decode graph's host nodes
        read it as they start); it changes no result, only how the weights are read."""
        self.prefetch = resolve_prefetch(nbytes)
        self.lib.ferry_host_kernel_set_prefetch(self.handle, self.prefetch)

    @staticmethod
    def _plain_or_quantized_families(banks) -> list[tuple[Family, Family]]:
        for block in (*banks.w13, *banks.w2):
            if not block.is_contiguous():
                raise KernelUnavailable("the C kernel reads contiguous bank blocks")
        h, i = banks.hidden_size, banks.intermediate_size
        bias13, bias2 = banks.format.host_bias_offsets()
        if not banks.format.quantized:
            return [
                (_family(w13, 2 * i, h, i, bias13), _family(w2, h, i, h, bias2)) for w13, w2 in zip(banks.w13, banks.w2)
            ]
        families = []
        for layer, (w13, w2) in enumerate(zip(banks.w13, banks.w2)):
            # each MoE layer's own layouts and GGUF block types: gguf-mixed's differ by layer
            layout13, layout2 = banks.format.layer_layouts(layer)
            view13, view2 = banks.format.gemm_views(w13, w2, layer)
            families.append(
                (
                    _family(w13, 2 * i, h, i, bias13, layout13, view13.ggml_type),
                    _family(w2, h, i, h, bias2, layout2, view2.ggml_type),
                )
            )
        return families

    def _packed_layout(self) -> None:
        """The packed families over the banks' sealed escapes, (re)made when they are (re)laid out: a load
        after the last seal unseals the banks, and seal() lays the escapes out in new blocks."""
        banks = self.banks
        banks.seal()  # a no-op when sealed
        if self._escape_blocks is not None and all(a is b for a, b in zip(self._escape_blocks, banks.esc_index)):
            return
        check_packed(banks)
        self.families = [_packed_families(banks, layer) for layer in range(banks.num_layers)]
        self._escape_blocks = list(banks.esc_index)  # held: the pointers above stay valid until remade

    def decode_packed(self, moe_layer: int, expert: int) -> torch.Tensor:
        """One packed expert's V values (w13 then w2, flattened) as this kernel's rows decode them, bf16:
        the tests hold it bit for bit to unpack_expert_reference."""
        if self.format != PACKED or not 0 <= expert < self.banks.num_experts:
            raise ValueError(f"decode_packed reads an expert of packed banks, not expert {expert} of these")
        self._packed_layout()
        out = torch.empty(self.banks.v13 + self.banks.v2, dtype=torch.bfloat16)
        at = out.data_ptr()
        for f in self.families[moe_layer]:
            err = self.lib.ferry_host_decode_packed(ctypes.byref(f), self.isa_code, expert, 0, f.rows, at)
            if err:
                raise RuntimeError(f"the packed decode refused the call: {ERRORS.get(err, err)}")
            at += f.rows * f.cols * 2
        return out

    def decode_rows(self, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's w13 [2I, H] and w2 [H, I] of quantized (or plain) banks, float32, as this kernel's rows
        decode them for float32 compute: the tests hold it bit for bit to the twin's dequantization."""
        if self.format == PACKED or not 0 <= expert < self.banks.num_experts:
            raise ValueError(f"decode_rows reads an expert of unpacked banks, not expert {expert} of these")
        out = []
        for f in self.families[moe_layer]:
            rows = torch.empty(f.rows, f.cols, dtype=torch.float32)
            err = self.lib.ferry_host_decode_rows(
                ctypes.byref(f), self.format, self.isa_code, expert, 0, f.rows, rows.data_ptr()
            )
            if err:
                raise RuntimeError(f"the row decode refused the call: {ERRORS.get(err, err)}")
            out.append(rows)
        return out[0], out[1]

    def compute(self, moe_layer: int, x: torch.Tensor, pairs: Sequence[tuple[int, int, float]]) -> torch.Tensor:
        """float32 [T, H], HostExperts.compute's contract; x [T, H] in the compute dtype, on the CPU. Every
        index the C code follows is checked here first (it reads the banks by them, unchecked)."""
        tokens = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        experts = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        weights = torch.tensor([p[2] for p in pairs], dtype=torch.float32)
        check_call(self.banks, self.dtype, moe_layer, x, tokens, experts)
        if self.format == PACKED:
            self._packed_layout()
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        w13, w2 = self.families[moe_layer]
        job = Job(
            format=self.format,
            act=self.act,
            isa=self.isa_code,
            tokens=x.shape[0],
            hidden=self.hidden,
            inter=self.inter,
            x=x.data_ptr(),
            n_pairs=len(pairs),
            pair_token=tokens.data_ptr(),
            pair_expert=experts.data_ptr(),
            pair_weight=weights.data_ptr(),
            w13=w13,
            w2=w2,
            out=out.data_ptr(),
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
            activation=self.activation,
        )
        if not self._destroy.alive:
            raise RuntimeError("the host kernel is closed")
        err = self.lib.ferry_host_kernel_compute(self.handle, ctypes.byref(job))
        if err:
            raise RuntimeError(f"the host expert kernel refused the call: {ERRORS.get(err, err)}")
        return out

    def close(self) -> None:
        self._destroy()
