"""Probe: can the decode forward be captured in a CUDA graph as it stands, and what does replay save?

Boots a model all-resident (`boot_worker`, the serving path), prefills one request, then captures
the model forward of one single-token decode step (sampler excluded) in a CUDA graph and replays it
against eager execution on the same inputs: logits equal, and the median step time of each.

    python3 bench/graph_probe.py --model DIR --load-format dummy --gpu-memory 60GiB
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_decode import Streams  # noqa: E402
from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402
from ferry.services.worker.forward_batch import ForwardBatch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_flags(parser)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    executor, plan = boot_worker(boot_config_from_args(args))
    rng = np.random.default_rng(0)
    vocab = executor.spec.vocab_size
    streams = Streams(executor, 1, 256, first_req_id=1)
    streams.prefill([rng.integers(0, vocab, 64).tolist()])
    model, pools = executor.model, executor.pools

    captured = {}

    def batch_for(token: int) -> ForwardBatch:
        # the StepBatch Streams.step would send, turned into device tensors
        from ferry.shared.step import StepBatch

        n = 1
        table = np.arange(1, 1 + streams.pages_each, dtype=np.int32)[None]
        step = StepBatch(
            step_id=0,
            req_ids=np.array([1]),
            tokens=np.array([token], np.int32),
            query_lens=np.array([1], np.int32),
            context_lens=np.array(streams.context, np.int32),
            page_table=table,
            linear_state_slots=np.arange(1, n + 1, dtype=np.int32),
            reset_linear_state=np.array([False]),
            sample=np.array([True]),
        )
        return ForwardBatch.from_step(step, plan.kv.page_size, executor.device)

    def eager_times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            fb = batch_for(int(rng.integers(0, vocab)))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(fb, pools)
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    eager = eager_times(args.steps)
    print(f"eager decode forward: median {1e3 * statistics.median(eager):.2f} ms")
    try:
        static = batch_for(5)
        with torch.inference_mode():
            for _ in range(3):
                model(static, pools)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured["logits"] = model(static, pools)
            graph.replay()
            torch.cuda.synchronize()
            want = model(static, pools)
            print(
                "graph logits == eager:",
                torch.equal(captured["logits"], want),
                float((captured["logits"] - want).abs().max()),
            )
            times = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print(f"graph replay: median {1e3 * statistics.median(times):.2f} ms")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print("capture failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
