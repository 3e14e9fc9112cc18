"""The host's own expert kernel (kernels/host_experts_c/, issue 25): HostExperts' `c` backend.

torch's CPU matmuls read plain bf16 banks at a sixth of the H200 host's memory bandwidth, and the
quantized banks' decode through torch ops is 10-60x slower still (bench/NOTES.md, "The host
computing an expert"). The C kernel reads each used expert's rows once for all its tokens, decoding
nvfp4 and fp8-block codes in registers, with AVX-512 BF16 where the CPU has it (chosen at load by
cpuid) and portable C elsewhere, on a pthread pool of its own sized by `threads`.

The library is built from source by `pip install` (pyproject.toml's ext-modules, optional: a
machine without a C compiler still installs) and loaded with ctypes, which releases the GIL for the
call; torch is no build requirement. `library()` says why it is not there when it is not.

FERRY_HOST_KERNEL_ISA=portable|avx512|auto picks the rows' instruction set (the tests force each)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import weakref
from collections.abc import Sequence

import torch

LIBRARY_MODULE = "ferry.kernels._host_experts_c"
ISA_ENV = "FERRY_HOST_KERNEL_ISA"
ISAS = {"auto": 0, "portable": 1, "avx512": 2}  # enum ferry_isa (expert_job.h)
F32, BF16, FP8_BLOCK, NVFP4 = range(4)  # enum ferry_format
ACTS = {torch.float32: 0, torch.bfloat16: 1}  # enum ferry_act: the compute dtypes the kernel has
ERRORS = {-1: "an invalid job", -2: "an instruction set this CPU lacks", -3: "out of memory"}


class Family(ctypes.Structure):
    """ferry_family (expert_job.h): one weight family's rows in a layer's bank."""

    _fields_ = [("base", ctypes.c_void_p), ("expert_stride", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("part_rows", ctypes.c_int64), ("q_offset", ctypes.c_int64),
                ("scale_offset", ctypes.c_int64), ("gscale_offset", ctypes.c_int64),
                ("col_blocks", ctypes.c_int64)]  # fmt: skip


class Job(ctypes.Structure):
    """ferry_job (expert_job.h): one call."""

    _fields_ = [("format", ctypes.c_int64), ("act", ctypes.c_int64), ("isa", ctypes.c_int64),
                ("tokens", ctypes.c_int64), ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("x", ctypes.c_void_p), ("n_pairs", ctypes.c_int64), ("pair_token", ctypes.c_void_p),
                ("pair_expert", ctypes.c_void_p), ("pair_weight", ctypes.c_void_p), ("w13", Family),
                ("w2", Family), ("out", ctypes.c_void_p)]  # fmt: skip


class KernelUnavailable(RuntimeError):
    """The C kernel cannot compute these banks here (no library, a format or dtype it lacks, an ISA the CPU lacks)."""


def library_path() -> str | None:
    """Where the built library lies (the extension's file, found as an import would find it), or None."""
    try:
        spec = importlib.util.find_spec(LIBRARY_MODULE)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


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
    lib.ferry_host_isa_available.argtypes = [ctypes.c_int]
    lib.ferry_host_isa_available.restype = ctypes.c_int
    lib.ferry_host_kernel_create.argtypes = [ctypes.c_int]
    lib.ferry_host_kernel_create.restype = ctypes.c_void_p
    lib.ferry_host_kernel_destroy.argtypes = [ctypes.c_void_p]
    lib.ferry_host_kernel_destroy.restype = None
    lib.ferry_host_kernel_compute.argtypes = [ctypes.c_void_p, ctypes.POINTER(Job)]
    lib.ferry_host_kernel_compute.restype = ctypes.c_int
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


def _family(rows: torch.Tensor, out_rows: int, cols: int, part_rows: int, layout=None) -> Family:
    """One layer's bank of one family: plain rows [E, O, IN], or quantized byte rows [E, B] with their layout."""
    f = Family(base=rows.data_ptr(), expert_stride=rows.stride(0) * rows.element_size(), rows=out_rows, cols=cols,
               part_rows=part_rows)  # fmt: skip
    if layout is not None:
        parts = {p.name: p for p in layout.parts}
        f.q_offset, f.scale_offset = parts["q"].offset, parts["scale"].offset
        f.gscale_offset = parts["gscale"].offset if "gscale" in parts else 0
        f.col_blocks = -(-cols // 128)
    return f


def bank_format(banks) -> int:
    """The kernel's format code for these banks, or KernelUnavailable."""
    if getattr(banks, "packed", False):
        raise KernelUnavailable("packed banks have no C kernel yet (12-bit decode: the torch path)")
    name = banks.format.name
    if banks.format.quantized:
        codes = {"nvfp4": NVFP4, "fp8-block": FP8_BLOCK}
    else:
        codes = {"float32": F32, "bf16": BF16}
    if name not in codes:
        raise KernelUnavailable(f"banks of {name} experts have no C kernel")
    return codes[name]


class HostKernel:
    """The C kernel over one set of host banks, computing in `dtype` on `threads` threads (its own pool)."""

    def __init__(self, banks, dtype: torch.dtype, threads: int, isa: str | None = None):
        lib, why = library()
        if lib is None:
            raise KernelUnavailable(why)
        if dtype not in ACTS:
            raise KernelUnavailable(f"the C kernel computes in float32 or bfloat16, not {dtype}")
        self.format, self.act, self.isa = bank_format(banks), ACTS[dtype], resolve_isa(isa)
        if not lib.ferry_host_isa_available(ISAS[self.isa]):
            raise KernelUnavailable(f"this CPU lacks the {self.isa} instructions the host kernel was asked for")
        for block in (*banks.w13, *banks.w2):
            if not block.is_contiguous():
                raise KernelUnavailable("the C kernel reads contiguous bank blocks")
        h, i = banks.hidden_size, banks.intermediate_size
        quantized = banks.format.quantized
        layout13, layout2 = (banks.format.layout13, banks.format.layout2) if quantized else (None, None)
        self.families = [(_family(w13, 2 * i, h, i, layout13), _family(w2, h, i, h, layout2))
                         for w13, w2 in zip(banks.w13, banks.w2)]  # fmt: skip
        self.banks, self.hidden, self.inter = banks, h, i  # the banks stay alive while their pointers are held
        self.lib, self.handle = lib, lib.ferry_host_kernel_create(threads)
        if not self.handle:
            raise KernelUnavailable(f"the host kernel could not start {threads} threads")
        self._destroy = weakref.finalize(self, lib.ferry_host_kernel_destroy, self.handle)  # joins its threads

    def compute(self, moe_layer: int, x: torch.Tensor, pairs: Sequence[tuple[int, int, float]]) -> torch.Tensor:
        """float32 [T, H], HostExperts.compute's contract; x [T, H] in the compute dtype, on the CPU."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        tokens = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        experts = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        weights = torch.tensor([p[2] for p in pairs], dtype=torch.float32)
        w13, w2 = self.families[moe_layer]
        job = Job(format=self.format, act=self.act, isa=ISAS[self.isa], tokens=x.shape[0], hidden=self.hidden,
                  inter=self.inter, x=x.data_ptr(), n_pairs=len(pairs), pair_token=tokens.data_ptr(),
                  pair_expert=experts.data_ptr(), pair_weight=weights.data_ptr(), w13=w13, w2=w2,
                  out=out.data_ptr())  # fmt: skip
        if not self._destroy.alive:
            raise RuntimeError("the host kernel is closed")
        err = self.lib.ferry_host_kernel_compute(self.handle, ctypes.byref(job))
        if err:
            raise RuntimeError(f"the host expert kernel refused the call: {ERRORS.get(err, err)}")
        return out

    def close(self) -> None:
        self._destroy()
