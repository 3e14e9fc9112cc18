# temporary GPU check + benchmark of the quantized expert kernels (deleted after the run)
import os
import sys
import time

sys.path.insert(0, "tests/unit/kernels")
import torch
import triton

import ferry.kernels.quantized_expert_gemm as qk
import ferry.kernels.quantized_expert_gemv as qpair
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton
from ferry.kernels.grouped_expert_gemm import align_pairs_by_slot, block_m_for, grouped_expert_rows_triton
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_rows_reference
from ferry.kernels.quantized_experts import QuantizedFamily, dequantize_slot, quantized_expert_rows_reference
from quantized_slots import PART_ALIGN, _parts, make_experts

OUT = os.environ.get("OUT", "/tmp")
log = open(os.path.join(OUT, "log.txt"), "w")


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    log.write(s + "\n")
    log.flush()


dev = "cuda"
say(torch.__version__, triton.__version__, torch.cuda.get_device_name())

# ---------------- correctness on the GPU ----------------
def case(fmt, seed, T, K, H, I, S, dtype, skip=0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_experts(fmt, H, I, S, g, device=dev)
    x = torch.randn(T, H, generator=g).to(dtype).to(dev)
    topk = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    for _ in range(skip):
        topk[torch.randint(T, (1,), generator=g), torch.randint(K, (1,), generator=g)] = -1
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, topk.to(dev), w.to(dev), w13, w2


def dense(f, S, dtype):
    return torch.stack([dequantize_slot(f, s, dtype) for s in range(S)])


bad = 0
for fmt in ("nvfp4", "fp8-block"):
    for dtype in (torch.float32, torch.bfloat16):
        for (T, K, H, I, S) in ((2, 4, 64, 32, 6), (3, 2, 256, 192, 4), (1, 8, 2048, 768, 16), (40, 8, 2048, 768, 16),
                                (300, 8, 2048, 768, 16)):
            x, topk, w, w13, w2 = case(fmt, 1, T, K, H, I, S, dtype, skip=1)
            want = torch.full((T, K, H), float("nan"), device=dev)
            quantized_expert_rows_reference(x, topk, w, w13, w2, want)
            d13, d2 = dense(w13, S, dtype), dense(w2, S, dtype)
            ok = topk >= 0
            rms = want[ok].pow(2).mean().sqrt().item()
            for name, fn in (("pair", expert_pair_rows_triton), ("grouped", grouped_expert_rows_triton)):
                if name == "pair" and T * K > 64:
                    continue
                got = torch.full_like(want, float("nan"))
                fn(x, topk, w, w13, w2, got)
                plain = torch.full_like(want, float("nan"))
                fn(x, topk, w, d13, d2, plain)
                untouched = torch.isnan(got[~ok]).all().item() and not torch.isnan(got[ok]).any().item()
                err = ((got - want)[ok].abs().max() / rms).item()
                perr = ((plain - want)[ok].abs().max() / rms).item()
                rel = ((got - want)[ok].abs() / (want[ok].abs() + 1e-5 * rms)).max().item()
                flag = ""
                if dtype == torch.float32:
                    try:
                        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5 * max(1.0, rms))
                    except AssertionError:
                        flag = " <-- FP32 MISMATCH"
                        bad += 1
                elif err > 3 * perr + 0.02:
                    flag = " <-- BF16 WORSE THAN PLAIN"
                    bad += 1
                if not untouched:
                    flag += " <-- ROWS"
                    bad += 1
                say(f"{fmt:9s} {str(dtype)[6:]:8s} {name:7s} T={T:3d} H={H} I={I}: err/rms {err:.2e} (plain on dense {perr:.2e})"
                    f" rel {rel:.1e}{flag}")
say("correctness problems:", bad)


# ---------------- benchmarks ----------------
def gpu_family(fmt, rows, cols, part_rows, S):
    layout, cursor = [], 0
    for name, dt, shape in _parts(fmt, rows, cols, part_rows):
        n = dt.itemsize * int(torch.tensor(shape).prod())
        layout.append((name, dt, shape, cursor, n))
        cursor = -(-(cursor + n) // PART_ALIGN) * PART_ALIGN
    buf = torch.randint(0, 256, (S, cursor), dtype=torch.uint8, device=dev)
    v = {name: buf[:, o : o + n].view(dt).unflatten(-1, shape) for name, dt, shape, o, n in layout}
    if fmt == "nvfp4":
        v["gscale"].copy_(0.01 * torch.rand(v["gscale"].shape, device=dev) + 0.005)
        v["scale"].copy_((torch.rand(v["scale"].shape, device=dev) * 2 + 0.5).to(torch.float8_e4m3fn))
    else:
        for s in range(S):
            v["q"][s].copy_((torch.randn(v["q"].shape[1:], device=dev) * 0.5).to(torch.float8_e4m3fn))
        v["scale"].copy_(torch.rand(v["scale"].shape, device=dev) * 0.01 + 0.01)
    return QuantizedFamily(fmt, rows, cols, part_rows, v["q"], v["scale"], v.get("gscale")), cursor


H, I, E, K = 2048, 768, 128, 8
LAYERS = 6
S = E * LAYERS
fams = {}
for fmt in ("nvfp4", "fp8-block"):
    f13, b13 = gpu_family(fmt, 2 * I, H, I, S)
    f2, b2 = gpu_family(fmt, H, I, H, S)
    fams[fmt] = (f13, f2, b13 + b2)
    say(fmt, "bytes per expert", b13 + b2)
plain13 = torch.randn(S, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
plain2 = torch.randn(S, H, I, device=dev, dtype=torch.bfloat16) * 0.02
fams["bf16"] = (plain13, plain2, 3 * H * I * 2)
say("bf16 bytes per expert", 3 * H * I * 2)


def graph_time(calls, reps=20):
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps / len(calls) * 1e3  # us per call


def pair_bench(fmt, T, label=""):
    w13, w2, per = fams[fmt]
    calls = []
    n = 24
    for j in range(n):
        layer = j % LAYERS
        topk = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int32)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w = torch.softmax(torch.randn(T, K, device=dev), -1)
        rows = torch.empty(T, K, H, device=dev)
        calls.append(lambda x=x, topk=topk, w=w, rows=rows, off=layer * E: expert_pair_rows_triton(x, topk, w, w13, w2, rows, slot_offset=off))
    us = graph_time(calls)
    bw = T * K * per / (us * 1e-6) / 1e12
    say(f"pair {fmt:9s} T={T:2d} {label:28s} {us:8.1f} us  {bw:5.2f} TB/s of weights (pairs x expert bytes)")
    return us


def grouped_bench(fmt, T, label=""):
    w13, w2, per = fams[fmt]
    calls = []
    n = 6
    for j in range(n):
        topk = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]) if T <= 64 else torch.randint(0, E, (T, K), device=dev)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w = torch.softmax(torch.randn(T, K, device=dev), -1)
        rows = torch.empty(T, K, H, device=dev)
        aligned = align_pairs_by_slot(topk, E, block_m_for(T * K), E)
        calls.append(lambda x=x, topk=topk, w=w, rows=rows, al=aligned, off=(j % LAYERS) * E:
                     grouped_expert_rows_triton(x, topk, w, w13, w2, rows, aligned=al, slot_window=(0, E, off)))
    us = graph_time(calls, reps=5 if T > 1000 else 20)
    distinct = min(E, T * K)
    tflops = 2 * 3 * H * I * T * K / (us * 1e-6) / 1e12
    say(f"grouped {fmt:9s} T={T:4d} {label:28s} {us:9.1f} us  {tflops:6.1f} TFLOP/s  {distinct * per / (us * 1e-6) / 1e12:5.2f} TB/s (distinct experts' bytes)")
    return us


for T in (1, 4, 8):
    for fmt in ("bf16", "nvfp4", "fp8-block"):
        pair_bench(fmt, T, "default")

# sweeps of the pair kernels' tiles
defaults = (qpair.GATE_UP_BLOCK_N, qpair.DOWN_BLOCK_N, qpair.NVFP4_GROUPS_PER_STEP, qpair.FP8_BLOCKS_PER_STEP)
for T in (1, 8):
    for gu, dn in ((16, 32), (8, 16), (32, 32), (16, 16), (32, 64)):
        for groups in (8, 16, 32):
            qpair.GATE_UP_BLOCK_N, qpair.DOWN_BLOCK_N, qpair.NVFP4_GROUPS_PER_STEP = gu, dn, groups
            pair_bench("nvfp4", T, f"BN {gu}/{dn} groups {groups}")
        for blocks in (1, 2):
            qpair.GATE_UP_BLOCK_N, qpair.DOWN_BLOCK_N, qpair.FP8_BLOCKS_PER_STEP = gu, dn, blocks
            pair_bench("fp8-block", T, f"BN {gu}/{dn} blocks {blocks}")
qpair.GATE_UP_BLOCK_N, qpair.DOWN_BLOCK_N, qpair.NVFP4_GROUPS_PER_STEP, qpair.FP8_BLOCKS_PER_STEP = defaults

for T in (16, 64, 512, 4096):
    for fmt in ("bf16", "nvfp4", "fp8-block"):
        grouped_bench(fmt, T, "default")
gdefaults = (qk.BLOCK_N, qk.BLOCK_K_16BIT)
for T in (64, 4096):
    for bn, bk in ((64, 64), (128, 64), (128, 128), (64, 128)):
        qk.BLOCK_N, qk.BLOCK_K_16BIT = bn, bk
        for fmt in ("nvfp4", "fp8-block"):
            grouped_bench(fmt, T, f"BN {bn} BK {bk}")
qk.BLOCK_N, qk.BLOCK_K_16BIT = gdefaults
say("done")
