"""The decode benchmarks of the device-side expert cache, end to end: for each workload, a bench model
directory (`ferry make-bench-model`, dummy weights whose routing changes with every token), `ferry
serve` with the workload's flags, then bench/serve_openai.py (the official openai client, streaming)
for TTFT of a 2,000-token prompt and decode at 1 and 8 streams, with the bound measured in the same
run (bench/bandwidth.py's ceilings). Writes OUT/decode_<workload>[_<variant>].json with the keys
bench/CURRENT.md tabulates: single_stream_tok_s, single_stream_bound_tok_s, streams8_tok_s, ttft_2k_s,
hit_rate, commit (and the whole serve_openai result under "detail"). `ttft_2k_s` is measured with a
text prompt of exactly 2,000 tokens (`ttft_2k_prompt` says so), `ttft_2k_ids_s` with the same
length sent as token ids; the `_wire_s` keys start the clock when the request leaves the client.

    python3 bench/decode_suite.py --out out --workloads 12layer,hybrid8 [--variants default,no-prefetch,eager]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_steal import StealMeter  # noqa: E402
from bench.long_context import LONG_PROMPT  # noqa: E402
from bench.serve_process import make_bench_model, start_serve  # noqa: E402
from ferry.services.bench_model import GGUF_PREFIX  # noqa: E402

MODELS = ROOT / "tests/data/models"
# name: (config, layers or None for all, serve flags[, checkpoint format: bf16 (default), nvfp4, fp8, mxfp4,
# gguf-TYPE])
HYBRID8 = ["--gpu-memory", "12GiB", "--max-running-requests", "8"]
RESIDENT = ["--gpu-memory", "40GiB", "--max-running-requests", "8"]
FULL = ["--gpu-memory", "24GiB", "--max-running-requests", "8", "--max-model-len", "8192"]
WORKLOADS = {
    "12layer": (
        MODELS / "qwen3-30b-a3b/config.json",
        12,
        ["--moe-cache-size", "512", "--gpu-memory", "12GiB", "--max-running-requests", "8"],
    ),
    "hybrid8": (
        MODELS / "qwen3.6-35b-a3b/config.json",
        8,
        ["--moe-cache-size", "640", "--gpu-memory", "12GiB", "--max-running-requests", "8"],
    ),
    "30b": (
        MODELS / "qwen3-30b-a3b/config.json",
        None,
        ["--gpu-memory", "24GiB", "--max-running-requests", "8", "--max-model-len", "8192"],
    ),
    "36b": (
        MODELS / "qwen3.6-35b-a3b/config.json",
        None,
        ["--gpu-memory", "24GiB", "--max-running-requests", "8", "--max-model-len", "8192"],
    ),
    # the quantized checkpoints (issue 21): the hybrid cut with 640 slots and with Ferry's own plan
    "hybrid8_nvfp4": (MODELS / "qwen3.6-35b-a3b/config.json", 8, ["--moe-cache-size", "640", *HYBRID8], "nvfp4"),
    "hybrid8_nvfp4_auto": (MODELS / "qwen3.6-35b-a3b/config.json", 8, HYBRID8, "nvfp4"),
    "hybrid8_fp8": (MODELS / "qwen3.6-35b-a3b/config.json", 8, ["--moe-cache-size", "640", *HYBRID8], "fp8"),
    "hybrid8_fp8_auto": (MODELS / "qwen3.6-35b-a3b/config.json", 8, HYBRID8, "fp8"),
    "36b_nvfp4": (MODELS / "qwen3.6-35b-a3b/config.json", None, FULL, "nvfp4"),
    # a 24 GiB card at Ferry's own defaults (issue 56): the plan sizes running requests and context from memory
    "36b_nvfp4_defaults": (MODELS / "qwen3.6-35b-a3b/config.json", None, ["--gpu-memory", "24GiB"], "nvfp4"),
    "36b_fp8": (MODELS / "qwen3.6-35b-a3b/config.json", None, FULL, "fp8"),
    "30b_fp8": (MODELS / "qwen3-30b-a3b/config.json", None, FULL, "fp8"),
    # the MTP draft layer's runs (issue 61, bench/speculation_oracle.py): Qwen3.5-35B-A3B's published config, Qwen3.6's
    # text architecture value for value with its MTP layer's keys (the stored Qwen3.6 copy lacks them), the 8-layer cut
    # resident and at 640 NVFP4 slots, and the full size at 24 GiB (its own plan: speculation off then holds the
    # expert slots the MTP layer's weights and K/V take with it on, so the ratio counts that memory too)
    "hybrid8_resident_mtp": (MODELS / "qwen3.5-35b-a3b/config.json", 8, RESIDENT + ["--moe-cache-size", "2048"]),
    "hybrid8_nvfp4_mtp": (MODELS / "qwen3.5-35b-a3b/config.json", 8, ["--moe-cache-size", "640", *HYBRID8], "nvfp4"),
    "36b_nvfp4_mtp": (MODELS / "qwen3.5-35b-a3b/config.json", None, FULL, "nvfp4"),
    # the other families at full size on a 24 GiB card, each in the format its users run (issue 59): gpt-oss-120b in
    # openai's mxfp4, GLM-4.5-Air in NVFP4 (its 106B in bf16 outgrow the device host's RAM), Gemma-4-26B-A4B in bf16
    "gptoss120b": (MODELS / "gpt-oss-120b/config.json", None, FULL, "mxfp4"),
    "glm_air_nvfp4": (MODELS / "glm-4.5-air/config.json", None, FULL, "nvfp4"),
    "gemma4_26b": (MODELS / "gemma-4-26b-a4b/config.json", None, FULL),
    # GGUF (issue 60): a Q4_K_M-style file of random blocks (make-bench-model --format gguf-q4_k_m --weights random,
    # read as written: a GGUF file is its weights), the hybrid cut at 640 slots and the full size at 24 GiB
    "hybrid8_q4km": (MODELS / "qwen3.6-35b-a3b/config.json", 8, ["--moe-cache-size", "640", *HYBRID8], "gguf-q4_k_m"),
    "36b_q4km": (MODELS / "qwen3.6-35b-a3b/config.json", None, FULL, "gguf-q4_k_m"),
    # every expert resident (issue 24): the compute path alone, against the HBM bound
    "hybrid8_resident": (MODELS / "qwen3.6-35b-a3b/config.json", 8, RESIDENT + ["--moe-cache-size", "2048"]),
    "12layer_resident": (MODELS / "qwen3-30b-a3b/config.json", 12, RESIDENT + ["--moe-cache-size", "1536"]),
    # one long prompt (issue 24): the full-size 35B at 24 GiB with a KV pool for its whole context;
    # bench/long_context.py instead of the decode runs, out/long_context_36b.json
    "long_context_36b": (
        MODELS / "qwen3.6-35b-a3b/config.json",
        None,
        ["--gpu-memory", "24GiB", "--max-running-requests", "8", "--num-tokens", "262144"],
    ),
}
VARIANTS = {
    "default": [],
    "no-prefetch": ["--no-expert-prefetch"],
    "eager": ["--enforce-eager"],
    # decode steps of 8 tokens copy with the GPU's cores inside the graph (the default before 8 streams
    # measured faster on the copy engine)
    "core-copies8": ["--expert-copy-engine-tokens", "9"],
    # every step copies with the copy engine, decode included: eager, its lists read on the host
    "copy-engine1": ["--expert-copy-engine-tokens", "1"],
    # the experts kept in host RAM as bf16 (the default packs them to 12 bits a value)
    "plain": ["--expert-bank-format", "plain"],
    # the host computes part of each streamed prefill's missed experts (offload/host_compute/prefill_share.py),
    # 12 of the H200 host's 16 cores
    "host-share": ["--expert-backend", "hybrid", "--host-expert-threads", "12"],
    # the same with no next-layer prefetch: every expert a decode layer lacks is then a miss the host may share
    "host-share-no-prefetch": ["--expert-backend", "hybrid", "--host-expert-threads", "12", "--no-expert-prefetch"],
    # the host's threads left to the OS scheduler (the default pins them one a core since dc27a33)
    "unpinned": ["--host-expert-cpus", "none"],
    # the GPU alone (what auto is since c642fec's measurements; before, auto took a host share)
    "gpu": ["--expert-backend", "gpu"],
    # two decode steps out beyond the oldest unanswered one (issue 24: the resident single stream's chain);
    # the default since c7b6274, kept by name for the runs before it
    "ahead2": ["--schedule-ahead-steps", "2"],
    # one decode step ahead (the default before two measured faster), on the GPU alone and under auto
    "ahead1": ["--schedule-ahead-steps", "1"],
    "gpu-ahead1": ["--expert-backend", "gpu", "--schedule-ahead-steps", "1"],
    # two GPUs, each owning half the experts (issue 26; eager, so compare with the eager variant too)
    "ep2": ["--expert-parallel-size", "2"],
    # a long prompt in 16,384-token chunks (issue 24): each chunk streams the experts without a slot once,
    # so twice the chunk halves that stream, against the larger workspace's slots (the plan's own choice where
    # most experts have no slot; its mixers run in slices of 8,192: services/worker/mixer_slices.py)
    "chunk16k": ["--max-prefill-tokens", "16384"],
    # the same prompt in 8,192-token chunks, the plan's choice before 16,384 was a candidate: beside
    # `default` on one commit, whether decode after a long prompt loses by 16k
    "chunk8k": ["--max-prefill-tokens", "8192"],
    # a long prompt's lending steps in ring chunks of 48 experts instead of 12: a quarter of the chunks,
    # each paying the host's launches once
    "ring48": ["--long-prefill-ring-chunk", "48"],
    # auto with the host pool's idle workers spinning 1 ms before they sleep (FERRY_HOST_POOL_SPIN_US,
    # VARIANT_ENV): a decode step's layers come ~0.4-0.6 ms apart, so at the default 50 µs every layer's
    # call wakes them
    "spin1000": [],
}
# variables a variant's server runs with, beside its flags
VARIANT_ENV = {"spin1000": {"FERRY_HOST_POOL_SPIN_US": "1000"}}


def commit() -> str:
    """FERRY_COMMIT, else this tree's HEAD; "unknown" for a tree that is not a checkout's top (a `git archive`
    unpacked inside another checkout would otherwise report that checkout's HEAD)."""
    if os.environ.get("FERRY_COMMIT"):
        return os.environ["FERRY_COMMIT"]
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True)
    if not top.stdout.strip() or Path(top.stdout.strip()).resolve() != ROOT.resolve():
        return "unknown"
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def expert_slots(metrics_url: str | None) -> tuple[str, int] | None:
    """(expert format, GPU expert slots) from the worker's /metrics."""
    import re
    import urllib.request

    if not metrics_url:
        return None
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        m = re.search(r'^ferry_worker_expert_slots\{format="([^"]+)"\} (\S+)$', r.read().decode(), re.M)
    return (m[1], int(float(m[2]))) if m else None


def host_share_series(metrics_url: str | None) -> dict | None:
    """What the host's decode share did in the run, from the worker's /metrics (None without one): the
    experts it computed, its host nodes' busy time and calls, the price of a host expert the split used
    last (boot's, or refined in service) and the time a host expert took, to hold against each other."""
    import re
    import urllib.request

    if not metrics_url:
        return None
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()

    def value(pattern: str) -> float | None:
        m = re.search(rf"^{pattern} (\S+)$", text, re.M)
        return float(m[1]) if m else None

    experts = value(r'ferry_worker_host_experts_total\{share="decode"\}')
    busy = value("ferry_worker_host_node_busy_seconds_total")
    if experts is None or busy is None:
        return None
    return {
        "experts": int(experts),
        "host_node_busy_s": round(busy, 4),
        "host_node_calls": int(value("ferry_worker_host_node_calls_total") or 0),
        "refinements": int(value("ferry_worker_host_share_refinements_total") or 0),
        "host_at_1_s": value(r'ferry_worker_host_share_cost_seconds\{path="host_at_1",share="decode"\}'),
        "host_node_s_per_expert": round(busy / experts, 9) if experts else None,
        # auto's guard: the scale of the host's price it settled on (0: the share off; None: no guard)
        "guard_price_scale": value("ferry_worker_host_decode_price_scale"),
        # the host nodes' calls by wall time: the calls at most `le` seconds, cumulative (a tail the mean hides)
        "host_node_calls_le": {
            m[1]: int(float(m[2]))
            for m in re.finditer(r'^ferry_worker_host_node_call_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
        },
    }


def workload_model(name: str, out: Path) -> tuple[Path, list[str], str]:
    """Workload `name`'s bench model made in `out` (ferry make-bench-model), the flags that serve it (--load-format
    dummy, but for a GGUF file, which is its weights and is read) and its experts' format."""
    config, layers, flags, *fmt = WORKLOADS[name]
    fmt = fmt[0] if fmt else "bf16"
    load = [] if fmt.startswith(GGUF_PREFIX) else ["--load-format", "dummy"]
    return make_bench_model(out, config, layers, fmt), [*load, *flags], fmt


def run_workload(name: str, variant: str, out: Path, ceilings: Path, args) -> dict:
    tag = name if variant == "default" else f"{name}_{variant}"
    model_dir, flags, fmt = workload_model(name, Path(tempfile.mkdtemp(prefix="ferry-bench-")) / tag)
    served = start_serve(
        model_dir,
        [*flags, *VARIANTS[variant]],
        out / f"serve_{tag}.log",
        env=VARIANT_ENV.get(variant),
    )
    print(f"[{tag}] {served.command}", flush=True)
    try:
        ready = served.wait_ready(args.ready_timeout)
        print(f"[{tag}] ready in {ready:.0f} s", flush=True)
        if name.startswith("long_context"):
            return _long_context(name, tag, model_dir, served, out, ceilings, ready, args)
        slots = expert_slots(served.worker_metrics)
        detail_path = out / f"openai_{tag}.json"
        cmd = [
            sys.executable,
            str(ROOT / "bench/serve_openai.py"),
            "--base-url",
            served.base + "/v1",
            "--streams",
            "1,8",
            "--max-tokens",
            str(args.max_tokens),
            "--ttft-prompt-len",
            str(args.ttft_prompt_len),
            "--settle-tokens",
            str(args.settle_tokens),
            "--metrics",
            served.worker_metrics,
            "--config",
            str(model_dir),
            "--ceilings",
            str(ceilings),
            "--out",
            str(detail_path),
        ]
        with StealMeter() as steal:  # a contended VM host slows the host's share (bench/cpu_steal.py)
            subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.run_timeout)
        host_share = host_share_series(served.worker_metrics)
    finally:
        stopped = served.stop()
    detail = json.loads(detail_path.read_text())
    one = next(r for r in detail["runs"] if r["streams"] == 1)
    eight = next(r for r in detail["runs"] if r["streams"] == 8)
    result = {
        "workload": name,
        "variant": variant,
        "serve": served.command,
        "ready_s": round(ready, 1),
        "single_stream_tok_s": round(one["median_stream_tok_s"], 2),
        "single_stream_bound_tok_s": round(one["bound_tok_s"], 2) if "bound_tok_s" in one else None,
        "single_stream_bound_fraction": round(one["bound_fraction"], 3) if "bound_fraction" in one else None,
        # the bound were the experts to cross as bf16 (plain banks), and what one expert's copy moved
        "single_stream_bound_bf16_tok_s": round(one["bound_bf16_tok_s"], 2) if "bound_bf16_tok_s" in one else None,
        "wire_bytes_per_expert": round(one["wire_bytes_per_expert"]) if "wire_bytes_per_expert" in one else None,
        "streams8_tok_s": round(eight["aggregate_tok_s"], 2),
        "ttft_2k_prompt": detail["ttft_prompt"],  # the prompt of ttft_2k_s: text, or token ids
        **{
            f"ttft_2k{k}": None if detail[f"ttft{k}"] is None else round(detail[f"ttft{k}"], 4)
            for k in ("_s", "_wire_s", "_ids_s", "_ids_wire_s")
        },
        "expert_format": slots[0] if slots else fmt,
        "expert_slots": slots[1] if slots else None,
        "hit_rate": one["expert_cache"]["hit_rate"] if one["expert_cache"] else None,
        "hit_rate_8": eight["expert_cache"]["hit_rate"] if eight["expert_cache"] else None,
        "prefetch_accuracy": one["expert_cache"]["prefetch_accuracy"] if one["expert_cache"] else None,
        "host_share": host_share,
        "cpu_steal_fraction": steal.fraction,
        "settle": detail.get("settle"),
        "commit": commit(),
        "ceilings": json.loads(ceilings.read_text()),
        "stopped": stopped,
        "detail": detail,
    }
    (out / f"decode_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"[{tag}] 1 stream {result['single_stream_tok_s']} tok/s (bound {result['single_stream_bound_tok_s']}, "
        f"{result['single_stream_bound_fraction']}; bf16 bound {result['single_stream_bound_bf16_tok_s']}), "
        f"8 streams {result['streams8_tok_s']} tok/s, TTFT 2k "
        f"{result['ttft_2k_s']} s as {result['ttft_2k_prompt']} (from the request leaving the client "
        f"{result['ttft_2k_wire_s']} s; as ids {result['ttft_2k_ids_s']} s), hit rate {result['hit_rate']}, "
        f"prefetch accuracy {result['prefetch_accuracy']}",
        flush=True,
    )
    return result


def _long_context(name: str, tag: str, model_dir: Path, served, out: Path, ceilings: Path, ready: float, args) -> dict:
    """bench/long_context.py against the served model (the suite's caller stops the server)."""
    path = out / f"{tag}.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/long_context.py"),
        "--base-url",
        served.base + "/v1",
        "--config",
        str(model_dir),
        "--serve-log",
        served.log.name,
        "--ceilings",
        str(ceilings),
        "--metrics",
        served.worker_metrics,
        "--prompt-len",
        str(args.long_prompt_len),
        "--out",
        str(path),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.run_timeout)
    slots = expert_slots(served.worker_metrics)  # what the chunk's workspace left decode (chunk16k against default)
    result = json.loads(path.read_text()) | {
        "workload": name,
        "variant": tag.removeprefix(name).lstrip("_") or "default",
        "serve": served.command,
        "ready_s": round(ready, 1),
        "commit": commit(),
        "expert_slots": slots[1] if slots else None,
    }
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"[{tag}] TTFT {result['ttft_s']:.1f} s for {result['prompt_tokens']} tokens "
        f"({result['prefill_tok_s']:.0f} tok/s; bound {result['bound_s']:.1f} s: compute {result['compute_s']}, "
        f"PCIe {result['pcie_s']:.1f}); decode "
        f"after it {result['decode_after_tok_s']} tok/s, with a short prompt {result['decode_short_tok_s']} "
        f"(medians of "
        f"{len(result['decode_after_runs'])} runs: {result['decode_after_repeats_median_tok_s']} after, "
        f"{result['decode_short_repeats_median_tok_s']} short); "
        f"{result['expert_slots']} expert slots",
        flush=True,
    )
    return result


def logged_event(log: Path, event: str) -> dict:
    """The fields of the first structlog line of `event` in a serve log ({} if none): JSON lines (the
    worker's log when it is not a terminal) or key=value ones."""
    import re

    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if line.startswith("{"):
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            if isinstance(fields, dict) and fields.get("event") == event:
                return fields
        elif re.search(rf"\b{event}\b", line):
            return dict(re.findall(r"(\w+)=(\S+)", line))
    return {}


def write_hybrid_cpu(workload: str, variant: str, gpu_only: dict, hybrid: dict, out: Path) -> dict:
    """decode_<workload>_hybrid_cpu.json (issue 25): the host sharing decode misses against GPU-only in the
    same run, with the bound of both paths together: a token's missed bytes over PCIe plus the host's
    kernel, from the GPU-only bound (missed bytes over the measured link) scaled by the experts a second
    the host adds to the link's: the link's copy as the worker measured it at boot (its host_decode line),
    the host's expert as its host nodes timed it in the run (boot's price where the run has no timing)."""
    tag = workload if variant == "host-share" else f"{workload}_{variant.removeprefix('host-share-')}"
    log = out / (f"serve_{workload}.log" if variant == "default" else f"serve_{workload}_{variant}.log")
    boot = logged_event(log, "host_decode")
    pcie_us, host_us = float(boot.get("pcie_us", "nan")), float(boot.get("host_us_at_1", "nan"))
    timed = (hybrid.get("host_share") or {}).get("host_node_s_per_expert")
    if timed:  # what a host expert took in this run, as its host nodes timed it, rather than boot's price
        host_us = timed * 1e6
    link_bound = gpu_only["single_stream_bound_tok_s"]
    both = link_bound * (1 + pcie_us / host_us) if link_bound and pcie_us == pcie_us and host_us == host_us else None
    result = {
        "workload": workload,
        "variant": variant,
        "commit": hybrid["commit"],
        "single_stream_tok_s": hybrid["single_stream_tok_s"],
        "streams8_tok_s": hybrid["streams8_tok_s"],
        "gpu_only_single_stream_tok_s": gpu_only["single_stream_tok_s"],
        "gpu_only_streams8_tok_s": gpu_only["streams8_tok_s"],
        "single_stream_speedup": round(hybrid["single_stream_tok_s"] / gpu_only["single_stream_tok_s"], 3),
        "streams8_speedup": round(hybrid["streams8_tok_s"] / gpu_only["streams8_tok_s"], 3),
        "pcie_bound_tok_s": link_bound,
        "bound_tok_s": round(both, 2) if both else None,
        "bound_host_us_per_expert": round(host_us, 1) if host_us == host_us else None,
        "bound_fraction": round(hybrid["single_stream_tok_s"] / both, 3) if both else None,
        "host_decode_boot": boot or None,
        "hit_rate": hybrid["hit_rate"],
        "gpu_only_hit_rate": gpu_only["hit_rate"],
        "host_share": hybrid.get("host_share"),  # what its host nodes took against the price the split used
    }
    (out / f"decode_{tag}_hybrid_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"[{tag} hybrid cpu] {result['single_stream_tok_s']} vs {result['gpu_only_single_stream_tok_s']} tok/s "
        f"single ({result['single_stream_speedup']}x; bound {result['bound_tok_s']}), {result['streams8_tok_s']} vs "
        f"{result['gpu_only_streams8_tok_s']} at 8 ({result['streams8_speedup']}x)",
        flush=True,
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--workloads", default="12layer,hybrid8")
    p.add_argument("--variants", default="default")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--settle-tokens",
        type=int,
        default=0,
        help="an untimed stream of this many tokens before the decode runs (serve_openai.py: what auto's "
        "guard settles on is then what is timed)",
    )
    p.add_argument("--ttft-prompt-len", type=int, default=2000)
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--run-timeout", type=float, default=300)
    p.add_argument("--long-prompt-len", type=int, default=LONG_PROMPT, help="the long_context workloads' prompt")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench.bandwidth import measure

    t0 = time.monotonic()
    ceilings = out / "ceilings.json"
    import torch

    if torch.cuda.is_available():
        from bench.bandwidth import matmul_tflops

        ceilings.write_text(json.dumps(measure(512 << 20) | {"bf16_matmul_TFLOPs": matmul_tflops()}) + "\n")
    else:  # a dry run of the suite on CPU: nominal ceilings, said so
        ceilings.write_text(
            json.dumps({"h2d_pinned_GBps": 55.0, "hbm_copy_GBps": 4200.0, "note": "nominal (no CUDA)"}) + "\n"
        )
    print(f"ceilings: {ceilings.read_text().strip()}", flush=True)
    failed = []
    for workload in args.workloads.split(","):
        results = {}
        for variant in args.variants.split(","):
            try:
                results[variant] = run_workload(workload, variant, out, ceilings, args)
            except Exception as exc:  # noqa: BLE001 - the next workload still runs
                failed.append(f"{workload}/{variant}: {type(exc).__name__}: {exc}")
                print(f"[{workload}/{variant}] FAILED: {exc}", flush=True)
        for variant in ("host-share", "host-share-no-prefetch", "default", "spin1000"):  # each against the GPU alone
            if "gpu" in results and variant in results:
                write_hybrid_cpu(workload, variant, results["gpu"], results[variant], out)
    print(f"suite done in {time.monotonic() - t0:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
