"""What a decode layer's hand-off to the host costs beside its compute (issue 25), and what a polled one
would: a CUDA graph host node against GPU stream memory operations answered by a spinning host thread.

Each MoE layer of a hybrid decode step hands the host its share inside the step's CUDA graph: the pairs
and the input to pinned memory, a host node (cuLaunchHostFunc: the CUDA driver's callback thread wakes and
runs the C kernel), the host's sum back (copy-engine copies until ea2591a, now the GPU's own stores and
loads through the mapped buffers: the `_mapped` variants). With nothing for the host, boot measured
that hand-off at ~59 µs a layer on the H200 (bench/NOTES.md), ~0.7 ms of a 12-layer token. The
alternative: the GPU writes a word in pinned memory (cuStreamWriteValue32), a host thread that spins on it
answers in a second word, and the GPU waits for that (cuStreamWaitValue32); both are stream memory
operations, which a graph captures as batch memory-op nodes. This measures, per round, in a captured
graph of `--rounds` rounds replayed `--replays` times (the median replay over the rounds):

* `kernel`: one tiny kernel (a graph node's own cost, the floor);
* `host_node`: one host node running a function that does nothing (libc's free of NULL);
* `host_node_copies`: a 512-byte copy to pinned memory, the host node, an 8 KiB copy back (the hand-off's shape);
* `poll`: write the round's number, wait for the host thread's answer, clear it (bench/host_poll_probe.c);
* `poll_copies`: the same between the two copies;
* `host_node_copy_out`, `host_node_copy_back`: the host node with only the copy to pinned memory, or only
  the copy back (which of the two waits behind a loaded link);
* `host_node_mapped`, `poll_mapped`: the served hand-off's moves instead of the copies: the GPU's own
  stores of 512 bytes and one 2,048-wide bf16 row into pinned buffers, and the fold's loads of the
  8 KiB sum from one (kernels/host_share_rows.py).

A variant the driver cannot capture is reported with its error instead of a time.

`--link-load` times every variant again while another stream keeps PCIe's host-to-device direction
full, as a served decode step does: the next layer's prefetched experts cross while the host computes
this layer's share. `packed`: the GPU unpacks pinned 12-bit banks (the served cuts' copies); `plain`: the
copy kernel over bf16 banks; `ce`: the copy engine (bench/link_load.py). On an H100 the hybrid cut's host share
took ~440 µs from the hand-off kernel to the fold for three experts the host nodes timed at ~95 µs each,
with the prefetch's copy running beside it the whole time (bench/NOTES.md, 2026-12-05): whether the
hand-off's copies and the GPU's wait on the host's word (a PCIe read) queue behind that traffic is
what `poll_copies` under `packed` against `none` says. The load's GB/s over each variant's replays is
reported beside it (`link_load_GBps`).

    python3 bench/host_handoff_latency.py --out bench/results/host_handoff_latency_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.link_load import KINDS, LinkLoad  # noqa: E402
from bench.pair_gemv_sweep import replay_times_us  # noqa: E402
from ferry.kernels.host_share_rows import fold_host_sum, stage_for_host  # noqa: E402

PROBE_SOURCE = Path(__file__).with_name("host_poll_probe.c")
WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
WRITE_VALUE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: ordered after the stream's earlier work, with its writes


def build_probe(out_dir: Path) -> ctypes.CDLL:
    """bench/host_poll_probe.c built with the machine's C compiler and loaded."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler here: the polled hand-off's host thread is C")
    lib = out_dir / "host_poll_probe.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", str(PROBE_SOURCE), "-o", str(lib)], check=True)
    probe = ctypes.CDLL(str(lib))
    probe.probe_start.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    probe.probe_start.restype = ctypes.c_int
    probe.probe_stop.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    probe.probe_stop.restype = None
    probe.probe_size.restype = ctypes.c_ulong
    return probe


class Poller:
    """The probe's spinning thread over a block of flags (pinned on CUDA): go at offset 0, done at 64."""

    GO, DONE, ROUNDS = 0, 64, 192

    def __init__(self, probe: ctypes.CDLL, pin: bool):
        self.probe = probe
        self.flags = torch.zeros(int(probe.probe_size()), dtype=torch.uint8, pin_memory=pin)
        self.thread = ctypes.c_ulong()
        if probe.probe_start(self.flags.data_ptr(), ctypes.byref(self.thread)) != 0:
            raise RuntimeError("the polling thread did not start")

    def word(self, offset: int) -> int:
        return self.flags.data_ptr() + offset

    def rounds(self) -> int:
        return int(self.flags[self.ROUNDS : self.ROUNDS + 8].view(torch.int64)[0])

    def close(self) -> None:
        self.probe.probe_stop(self.flags.data_ptr(), ctypes.byref(self.thread))


def round_trip_on_host(poller: Poller, value: int, timeout_s: float = 5.0) -> None:
    """One round as the GPU would play it, played from here: write go, wait for done, clear it (the CPU test);
    TimeoutError where the thread does not answer within `timeout_s`."""
    go = ctypes.c_uint32.from_address(poller.word(Poller.GO))
    done = ctypes.c_uint32.from_address(poller.word(Poller.DONE))
    go.value = value
    deadline = time.monotonic() + timeout_s
    while done.value != value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the polling thread did not answer round {value} within {timeout_s} s")
    done.value = 0


def driver() -> dict:
    """The driver entry points the variants launch, with their ctypes signatures."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def entry(*names):
        for name in names:
            if hasattr(cuda, name):
                return getattr(cuda, name), name
        raise RuntimeError(f"libcuda has none of {names}")

    host_func, _ = entry("cuLaunchHostFunc")
    host_func.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    write, write_name = entry("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    wait, wait_name = entry("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    for fn in (write, wait):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    for fn in (host_func, write, wait):
        fn.restype = ctypes.c_int
    noop = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value  # free(NULL) does nothing
    return {"host_func": host_func, "write": write, "wait": wait, "noop": noop, "names": [write_name, wait_name]}


def check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUDA error {err}")


def variants(drv: dict, poller: Poller, device: torch.device) -> dict:
    """name -> fn(stream, i) queuing round i on `stream` (its torch handle)."""
    small = torch.zeros(128, dtype=torch.float32, device=device)
    small_host = torch.zeros(128, dtype=torch.float32, pin_memory=True)
    back_host = torch.zeros(2048, dtype=torch.float32, pin_memory=True)
    back = torch.zeros(2048, dtype=torch.float32, device=device)
    go, done = poller.word(Poller.GO), poller.word(Poller.DONE)

    def kernel(stream, i):
        small.add_(1.0)

    def host_node(stream, i):
        check(drv["host_func"](stream.cuda_stream, drv["noop"], None), "cuLaunchHostFunc")

    def poll(stream, i):
        value = i + 1
        check(drv["write"](stream.cuda_stream, go, value, WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")
        check(drv["wait"](stream.cuda_stream, done, value, WAIT_VALUE_EQ), "cuStreamWaitValue32")
        check(drv["write"](stream.cuda_stream, done, 0, WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def with_copies(middle, out: bool = True, back_in: bool = True):
        def fn(stream, i):
            if out:
                small_host.copy_(small, non_blocking=True)
            middle(stream, i)
            if back_in:
                back.copy_(back_host, non_blocking=True)

        return fn

    # the served hand-off's moves (kernels/host_share_rows.py): the GPU's own stores into the pinned buffers
    # and the fold's loads from the host's sum, through their mapped addresses
    block, block_host = small.view(torch.uint8), small_host.view(torch.uint8)
    x, x_host = (
        torch.zeros(1, 2048, dtype=torch.bfloat16, device=device),
        torch.zeros(1, 2048, dtype=torch.bfloat16, pin_memory=True),
    )
    rows, flags = (
        torch.zeros(1, 8, 2048, dtype=torch.float32, device=device),
        torch.zeros(8, dtype=torch.int8, device=device),
    )

    def with_mapped(middle):
        def fn(stream, i):
            stage_for_host(block, block_host, x, x_host)
            middle(stream, i)
            fold_host_sum(rows, flags, back_host.view(1, 2048))

        return fn

    return {
        "kernel": kernel,
        "host_node": host_node,
        "host_node_copies": with_copies(host_node),
        "host_node_copy_out": with_copies(host_node, back_in=False),
        "host_node_copy_back": with_copies(host_node, out=False),
        "host_node_mapped": with_mapped(host_node),
        "poll": poll,
        "poll_copies": with_copies(poll),
        "poll_mapped": with_mapped(poll),
    }


def time_variant(fn, rounds: int, replays: int, device: torch.device, load: LinkLoad | None = None) -> dict:
    """Capture `rounds` rounds in one graph, replay it; µs a round (median replay / rounds). With `load`,
    its stream is topped up before each timed replay, so the link stays full through it."""
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    try:
        with torch.cuda.graph(graph, stream=stream):
            for i in range(rounds):
                fn(torch.cuda.current_stream(device), i)
    except Exception as e:  # noqa: BLE001 - a variant the driver cannot capture is a result, not a failure
        torch.cuda.synchronize(device)
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    loaded = {}
    if load is None:
        times = replay_times_us(graph, rounds, replays)
    else:
        load.begin()
        times = []
        for _ in range(replays):
            load.keep_ahead()  # the link busy from before the replay starts to after it ends
            times.extend(replay_times_us(graph, rounds, 1))
        load.end_timed()
        rate = load.gbps()
        loaded = {"link_load_GBps": None if rate is None else round(rate, 1)}
    return {
        "us_per_round": round(statistics.median(times), 2),
        "us_min": round(min(times), 2),
        "us_max": round(max(times), 2),
        **loaded,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12, help="rounds in one graph (a step's MoE layers)")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument(
        "--link-load",
        default="none,packed",
        help="comma-separated: none, or a load beside the rounds (bench/link_load.py): packed (the served "
        "cuts' unpacking kernel), plain (the copy kernel over bf16 banks), ce (the copy engine)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loads = args.link_load.split(",")
    if not loads or any(k not in ("none", *KINDS) for k in loads):
        ap.error(f"--link-load {args.link_load}: a comma-separated list of none, {', '.join(KINDS)}")
    if not torch.cuda.is_available():
        print("host_handoff_latency: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        probe = build_probe(Path(tmp))
        poller = Poller(probe, pin=True)
        drv = driver()
        results = {}
        try:
            for kind in loads:
                load = None if kind == "none" else LinkLoad(kind, device)
                for name, fn in variants(drv, poller, device).items():
                    key = name if kind == "none" else f"{name}_under_{kind}"
                    results[key] = time_variant(fn, args.rounds, args.replays, device, load)
                    print(json.dumps({"variant": key, **results[key]}), flush=True)
                if load is not None:
                    load.close()
        finally:
            poller.close()
    out = {
        "rounds": args.rounds,
        "replays": args.replays,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "mem_op_entries": drv["names"],
        "polled_rounds_answered": poller.rounds(),
        "variants": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
