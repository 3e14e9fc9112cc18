"""The maintained benchmarks behind one entry point: `python3 -m bench WORKLOAD [ARGS...]` runs the workload's script
with ARGS (`python3 -m bench WORKLOAD --help` prints its own flags); `python3 -m bench --help` lists them.

Each workload is one script of this folder, which also runs on its own (`python3 bench/decode_suite.py ...`);
bench/README.md says what each measures and bench/CURRENT.md holds the latest figures. The scripts that are not
workloads (serve_process.py, cpu_steal.py) are the workloads' shared parts."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# workload -> (the script's module under bench/, what it measures)
WORKLOADS: dict[str, tuple[str, str]] = {
    "suite": (
        "decode_suite",
        "`ferry serve` per workload (12layer, hybrid8, 36b_nvfp4, long_context_36b, ...): TTFT-2k, decode at 1 "
        "and 8 streams, the bound",
    ),
    "serve": (
        "serve_openai",
        "decode and TTFT of any running OpenAI-compatible server through the official openai client",
    ),
    "peer": (
        "peer_compare",
        "Ferry against the peer FreeToken side by side: one checkpoint, one client, one memory line",
    ),
    "spec-oracle": (
        "speculation_oracle",
        "speculative decoding's decode tok/s with an oracle draft at set acceptance rates (0, 0.6, 0.8, 0.9; "
        "bench-only drafts) against speculation off",
    ),
    "long": ("long_context", "one long prompt's TTFT and the decode after it against a running server, with bounds"),
    "ttft": ("ttft_path", "where a served prompt's time to first token goes, phase by phase (FERRY_STEP_TRACE)"),
    "profile-decode": ("profile_decode", "torch.profiler over decode steps through boot + executor"),
    "profile-prefill": ("profile_prefill", "a long prefill's wall time, copy-engine busy time and gaps"),
    "profile-serve": ("profile_serve", "py-spy over a served decode's three processes, beside the step timeline"),
    "worker-decode": ("serve_decode", "decode and TTFT through the worker alone (boot + executor), with the bound"),
    "offload": ("offload_decode", "the expert offload cache's decode path alone at real shapes, against its bound"),
    "policy-sim": ("offload_policy_sim", "hit rates of the expert cache policies, on CPU, from routing alone"),
    "bandwidth": ("bandwidth", "the pinned host-to-device and device-to-device copy ceilings"),
    "gemv-sweep": ("dense_gemv_sweep", "the decode projections' GEMV tiles against cuBLAS (kernels/dense_gemv.py)"),
    "pair-sweep": ("pair_gemv_sweep", "the decode expert GEMVs' tile shapes (kernels/pair_tiles.py)"),
    "prefill-attention": (
        "prefill_attention",
        "the paged prefill attention kernel's tiles against SDPA/FlashAttention on long contexts",
    ),
    "wire-hop": ("wire_hop", "one hop of the scheduler-worker wire between two processes"),
    "json-depth": ("json_depth", "the API's JSON depth check and decode on adversarial 4 MiB bodies"),
    "cli-help": ("cli_help", "`ferry COMMAND --help`'s time for every command"),
}
HELPERS = ("__init__", "__main__", "serve_process", "cpu_steal")


def usage() -> str:
    width = max(map(len, WORKLOADS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in WORKLOADS.items())
    return (
        "usage: python3 -m bench WORKLOAD [ARGS...]   (python3 -m bench WORKLOAD --help: its flags)\n\n"
        f"workloads:\n{rows}\n\nbench/README.md says more; bench/CURRENT.md holds the latest figures.\n"
    )


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    name, *args = argv
    if name not in WORKLOADS:
        print(f"python3 -m bench: no workload {name!r}; choose one of: {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    module = WORKLOADS[name][0]
    sys.path.insert(0, str(ROOT))
    sys.argv = [str(ROOT / "bench" / f"{module}.py"), *args]
    try:
        runpy.run_module(f"bench.{module}", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if isinstance(done.code, str):  # sys.exit("message"): said, as the interpreter would
            print(done.code, file=sys.stderr)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
