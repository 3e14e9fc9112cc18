"""Measure the two ceilings the offload bound is made of: pinned host->device copy bandwidth
(PCIe) and device-to-device copy bandwidth (HBM, bytes read + written). CUDA events, warm-up,
medians. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(size_bytes: int = 1 << 30, repeats: int = 20) -> dict:
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    h2d_ms = _time_ms(lambda: dev.copy_(host, non_blocking=True), repeats)
    d2d_ms = _time_ms(lambda: dev2.copy_(dev), repeats)
    # one expert of Qwen3-30B-A3B (9 MiB): the copy size the offload loop actually issues
    expert = 9_437_184
    h2d_expert_ms = _time_ms(lambda: dev[:expert].copy_(host[:expert], non_blocking=True), repeats * 5)
    return {
        "h2d_pinned_GBps": size_bytes / h2d_ms / 1e6,
        "h2d_pinned_9MiB_GBps": expert / h2d_expert_ms / 1e6,
        "hbm_copy_GBps": 2 * size_bytes / d2d_ms / 1e6,  # read + write
        "size_bytes": size_bytes,
        "device": torch.cuda.get_device_name(),
    }


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """The device's bf16 matmul rate on an n x n x n product (TFLOP/s): the compute bound's ceiling."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / _time_ms(lambda: a @ b, repeats) / 1e9


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=1 << 30)
    args = parser.parse_args()
    print(json.dumps(measure(args.size)))
