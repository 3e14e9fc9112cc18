"""Routed experts computed on the host, from the host banks the PCIe copies read.

A miss can be paid by copying the expert into a GPU slot, or by computing it where it lies. Given
the hidden states of a few tokens (x [T, H], in the compute dtype) and (token row, expert, router
weight) pairs of one MoE layer, `HostExperts.compute` returns float32 [T, H]: per pair gate/up and their
biases, then the activation (SiLU(gate) * up, gpt-oss's clamped SwiGLU or Gemma's gelu_tanh(gate) * up), then down
and its bias, in the compute dtype as the reference twin does
(kernels/grouped_expert_gemm_reference.py), times the router weight in float32, summed per token in
the order the pairs are listed. That is the share of the layer's MoE output the GPU path would have
added for those pairs.

Each listed expert is read once, whatever the number of its tokens. Two backends (`kernel=`):

* `c`: the host's own kernel (host_expert_kernel.py, kernels/host_experts_c/): decodes and multiplies
  in one pass over the bank, AVX-512 BF16 where the CPU has it, on a pthread pool of `threads`;
  plain (bf16, float32), packed (12-bit bf16), fp8-block and nvfp4 banks, computing in float32 or bf16;
* `torch`, the reference twin: the bank read in place (plain banks in the compute dtype) or decoded
  into a scratch of one expert (host_expert_weights.py), and multiplied with torch's CPU kernels
  (F.linear: oneDNN). torch reaches about a sixth of a server host's read bandwidth on plain banks, and
  its decode of the other formats is 10-60x slower still: it is the oracle.

`auto` takes `c` where it can compute these banks, else `torch` (float16, packed banks of odd shapes, an
activation the kernel lacks, a library that is not built), saying once in a log line why.

Threads: the work runs on one dedicated Python thread whose intra-op team is `threads` wide. The
calls that matter here (F.linear through oneDNN, the elementwise ops) parallelise with OpenMP, whose
team size is a per-thread setting: `torch.set_num_threads` in that thread sizes its team and leaves
the worker's main thread (which drives the GPU and its own CPU ops) with its own. A pool of several
Python threads would only add a hand-off per expert: one expert's matrices are already spread over
the team. What `set_num_threads` also writes globally is the default of a thread that has not run
a parallel op yet: the worker's main thread has, long before any expert is computed on the host.
(The `c` backend's pool is its own: the dedicated thread only calls into it, the GIL released.)
The main thread's own team must leave the cores to this one, though: with both teams' threads
above the cores, libgomp puts its helpers to sleep between parallel regions and every small op of
a decode pays a wake-up (on a 2-core host a packed decode took 7.3 ms beside a main team of 2
threads, 1.5 ms beside none), so whoever sizes `threads` sizes the main thread too.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import torch
import torch.nn.functional as F

from ferry.kernels.expert_epilogue import SILU_AND_MUL, ExpertActivation
from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel, KernelUnavailable, check_call
from ferry.services.worker.offload.host_compute.host_expert_weights import DECODE_CHUNK, expert_reader

log = structlog.get_logger("worker.offload")
KERNELS = ("auto", "c", "torch")

Pair = tuple[int, int, float]  # (token row of x, expert id in the layer, router weight)


def expert_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: ExpertActivation = SILU_AND_MUL,
) -> torch.Tensor:
    """One expert for the rows of x [n, H]: w13 [2I, H] (gate rows, then up rows), w2 [H, I], their biases
    b13 [2I] and b2 [H] (or None) and the activation; [n, H] in x's dtype. Each bias is added after its
    product, in x's dtype, as the reference twin adds it (not F.linear's fused bias, which rounds once)."""
    h = F.linear(x, w13)
    if b13 is not None:
        h = h + b13
    gate, up = h.chunk(2, dim=-1)
    y = F.linear(activation(gate, up), w2)
    return y if b2 is None else y + b2


@functools.cache
def _torch_path_once(reason: str) -> None:
    """One log line a process for each reason the C kernel was not taken."""
    log.info("host_experts_torch_path", reason=reason)


class HostExperts:
    """The host's expert computation over one set of host banks (HostBanks in any expert format, or
    PackedHostBanks), in `dtype` (the run dtype: x must be in it), on `threads` CPU threads;
    `decode_chunk`: values a decoding pass covers (host_expert_weights.py; the tests cross chunk edges);
    `kernel`: auto | c | torch (module docstring; `c` raises KernelUnavailable where it cannot);
    `isa`: the C kernel's instruction set, auto | avx512 | portable (default: FERRY_HOST_KERNEL_ISA, else auto);
    `cpus`: the C kernel's threads' CPUs, the caller's first, then its started workers'
    (plan/expert_backend.chosen_host_cpus; the torch path's threads are torch's own and stay unpinned)."""

    def __init__(
        self,
        banks,
        dtype: torch.dtype,
        threads: int,
        decode_chunk: int = DECODE_CHUNK,
        kernel: str = "auto",
        isa: str | None = None,
        cpus: Sequence[int] = (),
    ):
        if threads < 1:
            raise ValueError(f"host experts need at least one thread, got {threads}")
        if kernel not in KERNELS:
            raise ValueError(f"unknown host expert kernel {kernel!r} (one of {', '.join(KERNELS)})")
        self.banks, self.dtype, self.threads, self.decode_chunk = banks, dtype, threads, decode_chunk
        self.c_kernel = None
        if kernel != "torch":
            try:
                self.c_kernel = HostKernel(banks, dtype, threads, isa, cpus)
            except KernelUnavailable as e:
                if kernel == "c":
                    raise
                _torch_path_once(str(e))
        self.backend = "c" if self.c_kernel is not None else "torch"
        self.num_layers, self.num_experts, self.hidden_size = banks.num_layers, banks.num_experts, banks.hidden_size
        self._reader = None  # made on the dedicated thread, whose scratch it is
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="host-experts", initializer=torch.set_num_threads, initargs=(threads,)
        )
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def submit(self, moe_layer: int, x: torch.Tensor, pairs: Sequence[Pair]) -> Future:
        """`compute` on the dedicated thread; x must stay unchanged until the future is done."""
        self._check(moe_layer, x, pairs)
        return self._pool.submit(self._compute, moe_layer, x, list(pairs))

    def compute(self, moe_layer: int, x: torch.Tensor, pairs: Sequence[Pair]) -> torch.Tensor:
        """float32 [T, H]: the sum over `pairs` of router weight x expert(x[token]) (module docstring).
        The C kernel runs on the caller's thread (its own pool does the work, the GIL released): a hop
        to the dedicated thread, a Future's hand-off and wake-up, would only add latency to a call that
        runs no torch op."""
        if self.c_kernel is not None:  # it checks the call itself, before its C code follows any index
            return self.c_kernel.compute(moe_layer, x, list(pairs))
        return self.submit(moe_layer, x, pairs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.c_kernel is not None:
            self.c_kernel.close()

    def _check(self, moe_layer: int, x: torch.Tensor, pairs: Sequence[Pair]) -> None:
        tokens = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        experts = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        check_call(self.banks, self.dtype, moe_layer, x, tokens, experts)

    @torch.no_grad()
    def _compute(self, moe_layer: int, x: torch.Tensor, pairs: list[Pair]) -> torch.Tensor:
        if self.c_kernel is not None:
            return self.c_kernel.compute(moe_layer, x, pairs)
        if self._reader is None:
            self._reader = expert_reader(self.banks, self.dtype, self.decode_chunk)
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32)
        if not pairs:
            return out
        tokens = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        weights = torch.tensor([p[2] for p in pairs], dtype=torch.float32)
        rows = torch.empty(len(pairs), self.hidden_size, dtype=torch.float32)
        by_expert: dict[int, list[int]] = {}
        for i, (_, expert, _) in enumerate(pairs):
            by_expert.setdefault(expert, []).append(i)
        for expert, listed in by_expert.items():  # in order of first appearance
            w13, w2 = self._reader.expert(moe_layer, expert)
            b13, b2 = self._reader.biases(moe_layer, expert)
            which = torch.tensor(listed, dtype=torch.int64)
            y = expert_rows(x.index_select(0, tokens[which]), w13, w2, b13, b2, self._reader.activation)
            rows[which] = y.float() * weights[which, None]
        return out.index_add_(0, tokens, rows)  # one row at a time, in the pairs' order
