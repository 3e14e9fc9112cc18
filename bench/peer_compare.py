"""Ferry against the peer engine FreeToken 0.1.2, side by side in one device call: the same random checkpoint,
the same client (bench/serve_openai.py with the same arguments), each engine's whole process held to the same
device-memory line (default 24 GiB, as nvidia-smi counts a process: its CUDA context included).

1. `ferry make-bench-model DIR --format nvfp4 --weights random --generate-on cuda`: the full-size model's random
   NVFP4 checkpoint in the Hugging Face per-expert layout under the published names (`model.language_model.`),
   served to both engines. The expert names are checked against those FreeToken's Qwen3.5/3.6 NVFP4 reader matches
   (`model.language_model.layers.N.mlp.experts.E.*`) before the checkpoint is written and again on its index: a
   checkpoint it cannot read stops the run with that said. `--num-layers N --format bf16` serves a cut instead: bf16
   experts in the layout FreeToken reads for the family (Qwen3.5/3.6 fused, Qwen3-MoE per expert; gpt-oss with
   `--format mxfp4`, fused as openai publishes it; GLM-4 MoE only with `--format nvfp4`, whose layout quantizes the
   dense layers' MLPs and the shared experts too, as FreeToken's GLM reader needs), e.g. the decode suite's cuts
   at their flags:

       --config tests/data/models/qwen3-30b-a3b/config.json --num-layers 12 --format bf16 --memory-line 12GiB \
       --ferry-args "--moe-cache-size 512 --max-running-requests 8" --freetoken-args "--moe-cache-size 512"
2. Ferry: `ferry serve DIR --load-format dummy --gpu-memory LINE` (its own defaults otherwise); dummy weights
   follow the same recipe as the checkpoint's (services/bench_model.py) and skip reading 20 GB
   (`--ferry-load-format auto` reads the checkpoint instead). The output says which.
3. FreeToken: `python3 -m freetoken --model-path DIR --memory-ratio R --port P --max-running-requests 8` with its
   wheels' folder alone on PYTHONPATH (it pins its own pydantic, fastapi and openai). Its ratio is a fraction of
   the free memory it sees at start and covers weights + expert cache + KV only; activations, CUDA graphs and the
   context come out of the rest. So R = (LINE - allowance) / free, with free read by nvidia-smi just before its
   start and a 1.5 GiB allowance for the rest, and the process's peak is measured: above the line, the run says
   `over_line: true` and, while the call's time allows, starts it once more with R lowered by the excess (plus a
   margin); both attempts are kept. Its expert cache is sized by its own default (`--moe-cache-auto`, which it
   turns on when no cache flag is given); `--max-running-requests 8` (its default is 4) lets 8 streams run at once.

Each engine's device memory is sampled every 0.5 s with `nvidia-smi --query-compute-apps` over its whole life
(boot, warm-up, the client's runs): the sum over the processes of its session (both start in a session of their
own). Where nvidia-smi's pids are not this machine's (a container's pid namespace), the sum over every compute
process is taken instead (one engine runs at a time) and `pids_matched: false` says so. Between the engines the
run waits until nvidia-smi no longer shows the stopped engine's processes.

Writes OUT/peer_compare_<card>.json (per engine: command, ready seconds, peak process MiB, over_line, 1-stream and
8-stream tok/s, TTFT of a 2,000-token prompt; the ratios Ferry / FreeToken) and prints a table last.

    python3 bench/peer_compare.py --out $OUT --freetoken-site /tmp/ft
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_process import free_port, http_get, start_serve  # noqa: E402
from ferry.services.bench_model import GGUF_FORMATS  # noqa: E402

MIB_PER = {"GiB": 1024, "MiB": 1, "GB": 1e9 / 2**20, "MB": 1e6 / 2**20}
CONFIG = ROOT / "tests/data/models/qwen3.6-35b-a3b/config.json"
# FreeToken 0.1.2's Qwen3.5/3.6 NVFP4 expert reader (freetoken/models/qwen3_5_moe/weight.py, _NVFP4_EXPERT_KEY_RE):
# only names of this form reach its host expert banks; input_scale it skips
FREETOKEN_EXPERT_KEY = re.compile(
    r"^model\.language_model\.layers\.\d+\.mlp\.experts\.\d+\."
    r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_2|input_scale)$"
)
EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.")
FUSED_EXPERT_KEY = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
# FreeToken 0.1.2's Qwen3.5/3.6 bf16 experts (freetoken/models/qwen3_5_moe/weight.py, _PACKED_EXPERT_PATTERN, after
# its rename of model.language_model. to model.)
FREETOKEN_FUSED_KEY = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
# FreeToken 0.1.2's gpt-oss reader (freetoken/models/gpt_oss/weight.py): mxfp4 experts only, each MoE layer's as these
# six fused tensors (openai's release), and no other name under .mlp.experts.
FREETOKEN_GPT_OSS_PARTS = tuple(
    f"{p}_{leaf}" for p in ("gate_up_proj", "down_proj") for leaf in ("blocks", "scales", "bias")
)
# FreeToken 0.1.2's GLM-4 MoE routed experts (freetoken/models/glm4_moe/weight.py, _ROUTED_EXPERT_KEY_RE), input
# scales aside (modelopt writes them; its reader leaves them)
FREETOKEN_GLM_EXPERT_KEY = re.compile(
    r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|weight_scale_2|input_scale)$"
)


def size_mib(text: str, flag: str) -> float:
    """'24GiB' (GiB, MiB, GB or MB) in MiB; a clear error naming `flag` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GiB|MiB|GB|MB)\s*", text)
    if not m or float(m[1]) <= 0:
        raise ValueError(f"{flag} {text!r}: a positive size with its unit, e.g. 24GiB or 1536MiB")
    return float(m[1]) * MIB_PER[m[2]]


def freetoken_memory_ratio(line_mib: float, free_mib: float, allowance_mib: float) -> float:
    """FreeToken's --memory-ratio that keeps its weights + caches to the line less the allowance (context,
    activations, graphs): a fraction of the free memory it will see at start, rounded down to 1e-4."""
    if free_mib <= 0:
        raise ValueError(f"the GPU shows {free_mib:.0f} MiB free: nothing can start")
    ratio = (line_mib - allowance_mib) / free_mib
    if not 0 < ratio <= 1:
        raise ValueError(
            f"--memory-line {line_mib:.0f} MiB less --freetoken-allowance {allowance_mib:.0f} MiB is "
            f"{ratio:.3f} of the {free_mib:.0f} MiB free: the ratio must be in (0, 1]"
        )
    return int(ratio * 1e4) / 1e4


def lowered_ratio(ratio: float, free_mib: float, excess_mib: float, margin_mib: float) -> float:
    """The ratio of a second start after a peak `excess_mib` over the line: lowered by the excess and a margin
    (the 0.5 s samples can miss the top of a peak), as a fraction of the same free memory."""
    lowered = ratio - (excess_mib + margin_mib) / free_mib
    if lowered <= 0:
        raise ValueError(f"FreeToken went {excess_mib:.0f} MiB over the line at ratio {ratio}: no lower ratio is left")
    return int(lowered * 1e4) / 1e4


def freetoken_layout_problem(config: dict, weight_map: dict[str, str]) -> str | None:
    """Why FreeToken 0.1.2 cannot read this checkpoint's routed experts, or None when it can (or when the checkpoint
    is not a kind this check knows: then nothing is claimed). Its readers: Qwen3.5/3.6 NVFP4 per expert under the
    published names; Qwen3.5/3.6 bf16 fused (`experts.gate_up_proj`, `experts.down_proj`); Qwen3-MoE bf16 per expert."""
    arch = (config.get("architectures") or [""])[0]
    quant = config.get("quantization_config") or {}
    experts = [n for n in weight_map if EXPERT_KEY.search(n)]
    fused = [n for n in weight_map if FUSED_EXPERT_KEY.search(n)]
    if arch.startswith("Qwen3_5Moe") and "fp4" in str(quant.get("quant_algo", "")).lower():
        if not experts:
            return (
                "the checkpoint has no per-expert tensors (model.*.mlp.experts.E.*): FreeToken's NVFP4 reader needs "
                "them"
            )
        unread = [n for n in experts if not FREETOKEN_EXPERT_KEY.match(n)]
        if unread:
            return (
                f"{len(unread)} of {len(experts)} expert tensors are named as FreeToken 0.1.2's NVFP4 reader does not "
                f"match (e.g. {unread[0]!r}; it reads only 'model.language_model.layers.N.mlp.experts.E.{{gate,up,"
                f"down}}_proj.{{weight,weight_scale,weight_scale_2}}', the published Qwen3.5/3.6 NVFP4 names), so its "
                f"host expert banks would get none of them"
            )
        return None
    if arch.startswith("GptOss"):
        if quant.get("quant_method") != "mxfp4":
            return "FreeToken 0.1.2 serves gpt-oss only with mxfp4 experts (quantization_config.quant_method mxfp4)"
        if experts:
            return (
                "FreeToken 0.1.2 reads gpt-oss's experts only fused, as openai publishes them "
                "('model.layers.N.mlp.experts.gate_up_proj_blocks' ...): write the checkpoint with "
                "`make-bench-model --format mxfp4 --expert-layout fused`"
            )
        layers = {n.split(".mlp.experts.")[0] for n in weight_map if ".mlp.experts." in n}
        missing = [f"{layer}.mlp.experts.{part}" for layer in sorted(layers) for part in FREETOKEN_GPT_OSS_PARTS]
        missing = [n for n in missing if n not in weight_map]
        if not layers or missing:
            return f"FreeToken 0.1.2 needs each MoE layer's six fused mxfp4 tensors (missing e.g. {missing[:1]})"
        return None
    if arch.startswith("Glm4Moe"):
        return _freetoken_glm_problem(config, quant, experts)
    if quant:
        return None
    if arch.startswith("Qwen3_5Moe"):
        if experts or not fused:
            return (
                "FreeToken 0.1.2 reads Qwen3.5/3.6 bf16 experts only fused, as the published checkpoints store them "
                "('model.language_model.layers.N.mlp.experts.{gate_up_proj,down_proj}'): write the checkpoint with "
                "`make-bench-model --expert-layout fused`"
            )
        unread = [n for n in fused if not FREETOKEN_FUSED_KEY.match(n)]
        if unread:
            return f"{len(unread)} fused expert tensors are not under model.language_model. (e.g. {unread[0]!r})"
        return None
    if arch.startswith("Qwen3Moe") and (fused or not experts):
        return "FreeToken 0.1.2 reads Qwen3-MoE bf16 experts only per expert (model.layers.N.mlp.experts.E.*)"
    return None


def expert_layout(config: dict, fmt: str) -> str:
    """The routed experts' layout FreeToken reads for this config and format: Qwen3.5/3.6 bf16 and gpt-oss fused,
    else per expert."""
    arch = (config.get("architectures") or [""])[0]
    fused = (fmt == "bf16" and arch.startswith("Qwen3_5Moe")) or arch.startswith("GptOss")
    return "fused" if fused else "per-expert"


def _freetoken_glm_problem(config: dict, quant: dict, experts: list[str]) -> str | None:
    """FreeToken 0.1.2's GLM-4 MoE reader (freetoken/models/glm4_moe/weight.py): NVFP4 only, the routed experts per
    expert under `model.layers.N.mlp.experts.E.{gate,up,down}_proj`, the dense layers' MLPs and the shared experts
    NVFP4 too (it reads their weight_scale), attention and routers bf16."""
    from ferry.plan.expert_formats.nvfp4 import FORMAT as NVFP4

    if "fp4" not in str(quant.get("quant_algo", "")).lower():
        return "FreeToken 0.1.2 serves GLM-4 MoE only in NVFP4 (write the checkpoint with --format nvfp4)"
    unread = [n for n in experts if not FREETOKEN_GLM_EXPERT_KEY.match(n)]
    if not experts or unread:
        return (
            "FreeToken 0.1.2's GLM-4 MoE reader takes only per-expert "
            "'model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight,weight_scale,weight_scale_2}'"
            + (f" (not {unread[0]!r})" if unread else ": the checkpoint has none")
        )
    dense = config.get("first_k_dense_replace", 0)
    modules = [f"model.layers.{i}.mlp.{p}_proj" for i in range(dense) for p in ("gate", "up", "down")]
    if config.get("n_shared_experts"):
        moe = range(dense, int(config.get("num_hidden_layers", dense + 1)))
        modules += [f"model.layers.{i}.mlp.shared_experts.{p}_proj" for i in moe for p in ("gate", "up", "down")]
    bf16 = [m for m in modules if m in quant.get("exclude_modules", ()) or not NVFP4.checkpoint_quantizes(m)]
    if bf16:
        return f"FreeToken 0.1.2 reads GLM-4 MoE's dense MLPs and shared experts only in NVFP4, and {bf16[0]} is not"
    return None


def planned_expert_names(config_path: str | Path, num_layers: int | None = None, layout: str = "per-expert"):
    """The routed-expert weight names `ferry make-bench-model` writes for this config (as a weight map with no
    shards): the layout check runs on them before gigabytes are written, and on the written index after."""
    from ferry.plan.model_config import load_model_config
    from ferry.services.bench_model import PER_EXPERT_NAME, cut_config, published_names
    from ferry.services.worker.dummy_weights import routed_expert_shapes

    config = cut_config(json.loads(Path(config_path).read_text()), num_layers)
    named = published_names(config)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        names = list(routed_expert_shapes(load_model_config(d)))
    if layout == "fused":
        layers = {m[1] for n in names if (m := PER_EXPERT_NAME.fullmatch(n))}
        # gpt-oss's published layout, quantized or not: its parts with their biases (FusedExperts)
        parts = FREETOKEN_GPT_OSS_PARTS if config.get("model_type") == "gpt_oss" else ("gate_up_proj", "down_proj")
        names = [f"{layer}.{t}" for layer in sorted(layers) for t in parts]
    return {named(n): "" for n in names}


def parse_compute_apps(text: str) -> list[tuple[int, float]]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` -> [(pid, MiB)]; rows
    whose memory reads [N/A] (or anything not a number) are left out."""
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                apps.append((int(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return apps


def engine_memory(apps: list[tuple[int, float]], session_of, sid: int) -> tuple[float, float, list[int]]:
    """(MiB of the processes of session `sid`, MiB of every compute process, the pids of that session) of one
    sample; `session_of(pid)` is a pid's session (None where this machine cannot see it)."""
    mine = [(pid, mib) for pid, mib in apps if session_of(pid) == sid]
    return sum(m for _, m in mine), sum(m for _, m in apps), [p for p, _ in mine]


def session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def smi(*query: str) -> str:
    return subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=30).stdout


def compute_apps() -> list[tuple[int, float]]:
    return parse_compute_apps(smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"))


def gpu_memory(index: int) -> dict[str, float]:
    """The card's free, used and total MiB by nvidia-smi."""
    row = smi("-i", str(index), "--query-gpu=memory.free,memory.used,memory.total", "--format=csv,noheader,nounits")
    free, used, total = (float(x) for x in row.strip().splitlines()[0].split(","))
    return {"free_mib": free, "used_mib": used, "total_mib": total}


def card_name(index: int) -> tuple[str, str]:
    """(nvidia-smi's name of the card, its short lower-case name for file names: h100, h200, else gpu)."""
    name = smi("-i", str(index), "--query-gpu=name", "--format=csv,noheader").strip()
    m = re.search(r"h\d{3}", name, re.I)
    return name, m[0].lower() if m else "gpu"


@dataclass
class MemorySampler:
    """nvidia-smi's compute processes every `interval` s on a thread: the peak of one engine's session (and of
    every compute process) since `watch`."""

    interval: float = 0.5
    sid: int | None = None
    peak_session_mib: float = 0.0
    peak_all_mib: float = 0.0
    pids: set[int] = field(default_factory=set)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self, sid: int) -> None:
        with self._lock:
            self.sid, self.peak_session_mib, self.peak_all_mib, self.pids, self.samples = sid, 0.0, 0.0, set(), 0

    def report(self) -> dict:
        """The peak so far: the session's when its pids showed in nvidia-smi, else every compute process's."""
        with self._lock:
            matched = bool(self.pids)
            return {
                "peak_process_mib": round(self.peak_session_mib if matched else self.peak_all_mib),
                "pids_matched": matched,
                "gpu_pids": sorted(self.pids),
                "samples": self.samples,
            }

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                apps = compute_apps()
            except (OSError, subprocess.SubprocessError):
                continue
            with self._lock:
                if self.sid is None:
                    continue
                mine, every, pids = engine_memory(apps, session_of, self.sid)
                self.peak_session_mib = max(self.peak_session_mib, mine)
                self.peak_all_mib = max(self.peak_all_mib, every)
                self.pids.update(pids)
                self.samples += 1

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, ready, name: str) -> float:
    """Seconds until `ready(status, body)` holds for GET `url` (it raises RuntimeError for a server that says it
    failed); raises when the process exits or `timeout` passes."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{name} was not ready after {timeout:.0f} s")
        try:
            status, body = http_get(url, 2)
            if ready(status, body):
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)


def freetoken_ready(status: int, body: str) -> bool:
    """FreeToken's /health answers 200 while it loads too: ready is its status "ok"; "error" (a worker that
    died) raises."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    state = doc.get("status") if isinstance(doc, dict) else None
    if state == "error":
        raise RuntimeError(f"FreeToken's /health says error: {str(doc.get('message'))[:500]}")
    return status == 200 and state == "ok"


def stop_engine(proc: subprocess.Popen, grace: float = 30) -> dict:
    """SIGTERM to the engine's first process, then SIGKILL to its whole process group (every process it
    started in its session) once `grace` s pass or it has exited leaving some behind."""
    rc = proc.poll()
    if rc is None:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            rc = f"killed after {grace:.0f} s"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)
    return {"exit_status": rc}


def wait_gpu_released(pids: set[int], baseline_used_mib: float, index: int, timeout: float = 90) -> bool:
    """Whether the card let the engine go within `timeout` s: none of its `pids` left in nvidia-smi's compute
    processes (with no pids to go by: no compute process at all and the card's used memory back within 512 MiB
    of what it was before the engine started)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        apps = compute_apps()
        if pids and not any(pid in pids for pid, _ in apps):
            return True
        if not pids and not apps and gpu_memory(index)["used_mib"] <= baseline_used_mib + 512:
            return True
        time.sleep(1)
    return False


def client_command(base_url: str, model_dir: Path, out: Path, args) -> list[str]:
    """The same bench/serve_openai.py arguments for both engines: text prompts (FreeToken takes no token ids),
    ignore_eos (serve_openai sends it on every request) so each stream makes all of --max-tokens."""
    return [
        sys.executable,
        str(ROOT / "bench/serve_openai.py"),
        "--base-url",
        base_url,
        "--streams",
        args.streams,
        "--max-tokens",
        str(args.max_tokens),
        "--repeats",
        str(args.repeats),
        "--ttft-runs",
        str(args.ttft_runs),
        "--ttft-prompt-len",
        str(args.ttft_prompt_len),
        "--prompt-kind",
        "text",
        "--config",
        str(model_dir),
        "--out",
        str(out),
    ]


def summarize(detail: dict, max_tokens: int, repeats: int) -> dict:
    """An engine's figures from serve_openai's result: the median repeat's stream rate at 1 stream, the aggregate
    at 8, TTFT; and whether every stream made all its tokens (an engine stopping at EOS would look faster)."""
    runs = {r["streams"]: r for r in detail["runs"]}
    full = {n: r["tokens"] == n * repeats * max_tokens for n, r in runs.items()}
    return {
        "single_stream_tok_s": round(runs[1]["median_stream_tok_s"], 2) if 1 in runs else None,
        "streams8_tok_s": round(runs[8]["aggregate_tok_s"], 2) if 8 in runs else None,
        "streams8_median_stream_tok_s": round(runs[8]["median_stream_tok_s"], 2) if 8 in runs else None,
        "ttft_2k_s": round(detail["ttft_s"], 4) if detail.get("ttft_s") is not None else None,
        "ttft_2k_prompt_tokens": detail.get("ttft_prompt_tokens"),
        "all_tokens_generated": all(full.values()) if full else False,
        "tokens": {str(n): r["tokens"] for n, r in runs.items()},
    }


RATIO_KEYS = ("single_stream_tok_s", "streams8_tok_s", "ttft_2k_s", "ready_s", "peak_process_mib")


def ratios(ferry: dict, peer: dict) -> dict:
    """Ferry / FreeToken of each figure both have (tok/s: above 1 is Ferry faster; TTFT, ready, memory: below 1 is
    Ferry less)."""
    out = {}
    for key in RATIO_KEYS:
        a, b = ferry.get(key), peer.get(key)
        out[key] = round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
    return out


def table(result: dict) -> list[str]:
    """The printed summary: one row an engine, then the ratios."""
    cols = [
        ("ready s", "ready_s"),
        ("peak MiB", "peak_process_mib"),
        ("over line", "over_line"),
        ("1-stream tok/s", "single_stream_tok_s"),
        ("8-stream tok/s", "streams8_tok_s"),
        ("TTFT-2k s", "ttft_2k_s"),
    ]

    def cell(v) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    head = f"{'':12}" + "".join(f"{c:>16}" for c, _ in cols)
    rows = [head]
    for name in ("ferry", "freetoken"):
        e = result.get(name) or {}
        rows.append(
            f"{name:12}"
            + (
                "".join(f"{cell(e.get(k)):>16}" for _, k in cols)
                if "error" not in e
                else f"  error: {e['error'][:160]}"
            )
        )
    r = result.get("ratios") or {}
    rows.append(f"{'ferry/peer':12}" + "".join(f"{cell(r.get(k)):>16}" if k in r else f"{'':>16}" for _, k in cols))
    rows.append(
        f"line {result['memory_line_mib']:.0f} MiB by nvidia-smi on {result['card']}; Ferry's weights: "
        f"{result['ferry_weights']}"
    )
    over = [name for name in ("ferry", "freetoken") if (result.get(name) or {}).get("over_line")]
    if over:  # its figures were bought with more memory than the other's: never a silent win
        rows.append(f"OVER THE LINE: {', '.join(over)} (peak above {result['memory_line_mib']:.0f} MiB)")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument(
        "--config", default=str(CONFIG), help="the model's config.json (default: the full-size Qwen3.6-35B-A3B)"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="the checkpoint directory (default: $TMPDIR/peer_ckpt_nvfp4_<config's folder>); one that "
        "make-bench-model finished already is served as it is (a second call on a warm machine)",
    )
    p.add_argument("--memory-line", default="24GiB", help="each engine's whole process stays under this (nvidia-smi)")
    p.add_argument("--freetoken-site", default="/tmp/ft", help="the folder FreeToken's wheels were installed into")
    p.add_argument(
        "--freetoken-allowance",
        default="1.5GiB",
        help="the line's part left outside FreeToken's --memory-ratio: CUDA context, activations, graphs",
    )
    p.add_argument("--retry-margin", default="256MiB", help="lowered further by this on a second start over the line")
    p.add_argument(
        "--ferry-load-format",
        choices=("dummy", "auto"),
        default="dummy",
        help="dummy (default): the checkpoint's recipe made on the card; auto: read the checkpoint",
    )
    p.add_argument("--ferry-args", default="", help="more `ferry serve` flags, space-separated")
    p.add_argument(
        "--freetoken-args", default="", help="more FreeToken flags, space-separated (e.g. --moe-cache-size 512)"
    )
    p.add_argument("--num-layers", type=int, default=None, help="serve a cut: the config's first N decoder layers")
    p.add_argument(
        "--format",
        choices=("nvfp4", "bf16", "mxfp4"),
        default="nvfp4",
        help="the checkpoint's experts: nvfp4 (default, modelopt's layout), bf16 (Qwen3.5/3.6's fused layout, "
        "Qwen3-MoE's per-expert one) or mxfp4 (gpt-oss's, fused as openai publishes it): what FreeToken reads",
    )
    p.add_argument(
        "--ferry-format",
        default=None,
        metavar="gguf-TYPE",
        help="Ferry serves a GGUF file of this type instead (make-bench-model --format gguf-TYPE --weights random, "
        "the same config and cut, read as written), where FreeToken cannot serve the file: it keeps --format's "
        "checkpoint (e.g. gguf-q4_k_m beside FreeToken's nvfp4, whose experts are nearly as many bytes)",
    )
    p.add_argument("--streams", default="1,8", help="the client's stream counts, comma-separated")
    p.add_argument(
        "--label", default=None, help="the result's name: peer_compare_<card>[_<label>].json (default: the cut, if any)"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-runs", type=int, default=3)
    p.add_argument("--ttft-prompt-len", type=int, default=2000)
    p.add_argument("--gpu-index", type=int, default=0, help="the card nvidia-smi reports on")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="the whole run's seconds: FreeToken's second start is skipped where it would not fit",
    )
    p.add_argument("--make-timeout", type=float, default=240)
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--client-timeout", type=float, default=200)
    args = p.parse_args(argv)
    for flag in ("max_tokens", "repeats", "ttft_runs", "ttft_prompt_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least 1")
    try:
        args.line_mib = size_mib(args.memory_line, "--memory-line")
        args.allowance_mib = size_mib(args.freetoken_allowance, "--freetoken-allowance")
        args.margin_mib = size_mib(args.retry_margin, "--retry-margin")
    except ValueError as exc:
        p.error(str(exc))
    if args.allowance_mib >= args.line_mib:
        p.error(f"--freetoken-allowance {args.freetoken_allowance} must be less than --memory-line {args.memory_line}")
    if not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    if not all(x.strip().isdigit() and int(x) > 0 for x in args.streams.split(",")):
        p.error(f"--streams {args.streams!r}: positive stream counts, comma-separated")
    if args.num_layers is not None and args.num_layers < 1:
        p.error(f"--num-layers {args.num_layers}: at least 1")
    if args.ferry_format is not None and args.ferry_format not in GGUF_FORMATS:
        p.error(f"--ferry-format {args.ferry_format!r}: one of {', '.join(sorted(GGUF_FORMATS))}")
    cut = f"_{args.num_layers}layers" if args.num_layers else ""
    if args.label is None:
        formats = args.format if args.ferry_format is None else f"{args.ferry_format}_vs_{args.format}"
        args.label = f"{args.num_layers}layers_{formats}" if args.num_layers else ""
    if args.model_dir is None:
        folder = Path(args.config).resolve().parent.name
        args.model_dir = str(Path(tempfile.gettempdir()) / f"peer_ckpt_{args.format}_{folder}{cut}")
    return args


def finished_checkpoint(model_dir: Path, fmt: str = "nvfp4") -> bool:
    """Whether make-bench-model finished this directory: it writes the index after the shards, and a quantized
    format's quantization_config into config.json after the index."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    written = (model_dir / "model.safetensors.index.json").is_file()
    return written and (fmt == "bf16" or "quantization_config" in config)


def make_checkpoint(args, log: Path) -> tuple[Path, bool]:
    """(the random checkpoint, whether it was written now rather than found finished in --model-dir)."""
    model_dir = Path(args.model_dir)
    if finished_checkpoint(model_dir, args.format):
        return model_dir, False
    cmd = [
        sys.executable,
        "-m",
        "ferry.services.cli",
        "make-bench-model",
        str(model_dir),
        "--config",
        str(args.config),
        "--format",
        args.format,
        "--weights",
        "random",
        "--generate-on",
        "cuda",
        "--expert-layout",
        expert_layout(json.loads(Path(args.config).read_text()), args.format),
    ]
    if args.num_layers:
        cmd += ["--num-layers", str(args.num_layers)]
    with log.open("w") as f:
        subprocess.run(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=left_s(args, args.make_timeout)
        )
    return model_dir, True


def make_ferry_gguf(args, log: Path) -> Path:
    """--ferry-format: the GGUF file of random blocks Ferry serves (its folder; one an earlier run finished, which
    the marker beside it says, is reused)."""
    folder = Path(args.model_dir + f"_{args.ferry_format}")
    done = folder.parent / (folder.name + ".made")  # beside it: the folder must hold the file alone
    if done.is_file():
        return folder
    cmd = [sys.executable, "-m", "ferry.services.cli", "make-bench-model", str(folder), "--config", str(args.config)]
    cmd += ["--format", args.ferry_format, "--weights", "random"]
    if args.num_layers:
        cmd += ["--num-layers", str(args.num_layers)]
    with log.open("w") as f:
        subprocess.run(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=left_s(args, args.make_timeout)
        )
    done.write_text(args.ferry_format + "\n")
    return folder


def run_client(base_url: str, model_dir: Path, out: Path, args) -> dict:
    """serve_openai's result against `base_url`; a failed client raises with the last lines of its log."""
    log = out.parent / (out.stem + ".log")
    with log.open("w") as f:
        done = subprocess.run(
            client_command(base_url, model_dir, out, args),
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=left_s(args, args.client_timeout),
        )
    if done.returncode:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise RuntimeError(f"the client exited with {done.returncode} ({log.name}): {tail}")
    return json.loads(out.read_text())


def left_s(args, limit: float) -> float:
    """`limit`, or less where the run's --budget-s ends sooner (10 s at least)."""
    return max(10.0, min(limit, args.deadline - time.monotonic()))


def measure(name: str, start, ready_url: str, ready, sampler: MemorySampler, model_dir: Path, out: Path, args) -> dict:
    """Start an engine (`start()` -> (Popen, command, base URL)), wait until ready, run the client, stop it and wait
    until the card lets it go; its figures (or its error) with its peak memory either way."""
    baseline = gpu_memory(args.gpu_index)
    t0 = time.monotonic()
    try:
        proc, command, base = start()
    except (OSError, RuntimeError) as exc:
        return {"error": f"could not start: {type(exc).__name__}: {exc}", "over_line": False}
    sampler.watch(proc.pid)  # start_new_session: its session's id is its first process's pid
    entry: dict = {"command": command}
    try:
        ready_s = wait_healthy(proc, base + ready_url, left_s(args, args.ready_timeout), ready, name)
        entry["ready_s"] = round(ready_s, 1)
        print(f"[{name}] ready in {entry['ready_s']} s", flush=True)
        detail = run_client(base + "/v1", model_dir, out / f"openai_{name}.json", args)
        entry.update(summarize(detail, args.max_tokens, args.repeats))
    except Exception as exc:  # noqa: BLE001 - the other engine still runs, and this one is still stopped
        entry["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] FAILED: {entry['error']}", flush=True)
    finally:
        entry["stopped"] = stop_engine(proc)
        memory = sampler.report()
        sampler.watch(-1)  # no session: the stopped engine's samples end here
        entry["gpu_released"] = wait_gpu_released(set(memory["gpu_pids"]), baseline["used_mib"], args.gpu_index)
    entry.update(memory)
    entry["over_line"] = entry["peak_process_mib"] > args.line_mib
    entry["free_mib_at_start"] = baseline["free_mib"]
    entry["seconds"] = round(time.monotonic() - t0, 1)
    print(
        f"[{name}] peak {entry['peak_process_mib']} MiB (line {args.line_mib:.0f}), over_line {entry['over_line']}, "
        f"{entry['seconds']} s",
        flush=True,
    )
    return entry


def start_ferry(model_dir: Path, args, log: Path):
    load = [] if args.ferry_format else ["--load-format", args.ferry_load_format]  # a GGUF file is read
    flags = [*load, "--gpu-memory", args.memory_line, *args.ferry_args.split()]
    served = start_serve(model_dir, flags, log)
    return served.proc, served.command, served.base


def freetoken_port() -> int:
    """A free port whose next is free too: FreeToken listens on P and binds P + 1 for its processes."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports for FreeToken")


def start_freetoken(model_dir: Path, ratio: float, args, log: Path):
    port = freetoken_port()
    cmd = [
        sys.executable,
        "-m",
        "freetoken",
        "--model-path",
        str(model_dir),
        "--memory-ratio",
        str(ratio),
        "--port",
        str(port),
        "--max-running-requests",
        "8",
        *args.freetoken_args.split(),
    ]
    # its wheels' folder alone on the path, offline: a local checkpoint has nothing to fetch from the Hub
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(args.freetoken_site).resolve()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    f = log.open("w")
    # cwd outside the tree: `python -m` puts the cwd first on sys.path, and the tree's packages must not shadow its
    proc = subprocess.Popen(
        cmd,
        cwd=tempfile.gettempdir(),
        stdout=f,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    f.close()  # the child holds its own copy
    command = f"PYTHONPATH={env['PYTHONPATH']} python3 -m freetoken {' '.join(cmd[3:])}"
    return proc, command, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    args.deadline = t0 + args.budget_s
    # a `timeout` around this script sends SIGTERM: exit through the finally blocks, which stop the engines
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        card, short = card_name(args.gpu_index)
    except (OSError, subprocess.SubprocessError) as exc:
        print(
            f"error: nvidia-smi did not answer ({exc}): bench/peer_compare.py measures on the device machine",
            file=sys.stderr,
        )
        return 2
    path = out / (f"peer_compare_{short}_{args.label}.json" if args.label else f"peer_compare_{short}.json")
    result: dict = {
        "card": card,
        "memory_line_mib": args.line_mib,
        "config": str(args.config),
        "num_layers": args.num_layers,
        "format": args.format,
        "ferry_args": args.ferry_args,
        "freetoken_args": args.freetoken_args,
        "client": " ".join(client_command("BASE/v1", Path("DIR"), Path("OUT.json"), args)[1:]),
        "ferry_weights": (
            f"a GGUF file of random {args.ferry_format} blocks of the same config, read (FreeToken serves --format's "
            "checkpoint)"
            if args.ferry_format
            else "dummy (--load-format dummy: the checkpoint's recipe made on the card, not read)"
            if args.ferry_load_format == "dummy"
            else "the checkpoint, read (--load-format auto)"
        ),
    }

    def save() -> None:
        path.write_text(json.dumps(result, indent=1) + "\n")

    planned = json.loads(Path(args.config).read_text())
    if args.format == "nvfp4":
        planned |= {"quantization_config": {"quant_algo": "NVFP4"}}
    elif args.format == "mxfp4":
        planned |= {"quantization_config": {"quant_method": "mxfp4"}}
    layout = expert_layout(planned, args.format)
    problem = freetoken_layout_problem(planned, planned_expert_names(args.config, args.num_layers, layout))
    if problem:  # before minutes of writing a checkpoint the peer cannot read
        result["error"] = f"FreeToken cannot read the checkpoint make-bench-model writes: {problem}"
        save()
        print(result["error"])
        return 3
    try:
        made = time.monotonic()
        model_dir, written = make_checkpoint(args, out / "make_bench_model.log")
        result["model_dir"], result["checkpoint_s"] = str(model_dir), round(time.monotonic() - made, 1)
        result["checkpoint"] = "written in this run" if written else "found finished (an earlier run's)"
        config = json.loads((model_dir / "config.json").read_text())
        weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
        ferry_dir = model_dir if args.ferry_format is None else make_ferry_gguf(args, out / "make_ferry_gguf.log")
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        result["error"] = f"the checkpoint: {type(exc).__name__}: {exc} (see make_bench_model.log)"
        save()
        print(result["error"])
        return 1
    problem = freetoken_layout_problem(config, weight_map)
    if problem:
        result["error"] = f"FreeToken cannot read this checkpoint: {problem}"
        save()
        print(result["error"])
        return 3
    print(
        f"checkpoint {model_dir} {result['checkpoint']}, {result['checkpoint_s']} s; FreeToken's expert names match",
        flush=True,
    )
    if not wait_gpu_released(set(), gpu_memory(args.gpu_index)["used_mib"], args.gpu_index, timeout=60):
        print("warning: a compute process still holds the card before the engines start", flush=True)

    with MemorySampler() as sampler:
        result["ferry"] = {"error": "stopped before it ran"}  # what a cut-short run leaves in the file
        save()
        result["ferry"] = measure(
            "ferry",
            lambda: start_ferry(ferry_dir, args, out / "serve_ferry.log"),
            "/health",
            lambda status, body: status == 200,
            sampler,
            model_dir,
            out,
            args,
        )
        save()
        attempts = []
        try:
            free = gpu_memory(args.gpu_index)["free_mib"]
            ratio = freetoken_memory_ratio(args.line_mib, free, args.allowance_mib)
            while True:
                print(f"[freetoken] --memory-ratio {ratio} of {free:.0f} MiB free", flush=True)
                log = out / f"serve_freetoken_{len(attempts)}.log"
                entry = measure(
                    "freetoken",
                    lambda r=ratio, lg=log: start_freetoken(model_dir, r, args, lg),
                    "/health",
                    freetoken_ready,
                    sampler,
                    model_dir,
                    out,
                    args,
                )
                entry.update(memory_ratio=ratio, free_mib_for_ratio=free)
                attempts.append(entry)
                left = args.budget_s - (time.monotonic() - t0)
                if not entry["over_line"] or len(attempts) > 1:
                    break
                if left < entry["seconds"] + 30:
                    entry["retry_skipped"] = (
                        f"{left:.0f} s of --budget-s left, the first start took {entry['seconds']} s"
                    )
                    break
                print(
                    f"[freetoken] {entry['peak_process_mib'] - args.line_mib:.0f} MiB over the line: once more, lower",
                    flush=True,
                )
                free = gpu_memory(args.gpu_index)["free_mib"]
                try:
                    ratio = lowered_ratio(ratio, free, entry["peak_process_mib"] - args.line_mib, args.margin_mib)
                except ValueError as exc:  # the first attempt stands, over the line, and says why no second ran
                    entry["retry_skipped"] = str(exc)
                    break
        except ValueError as exc:
            attempts.append({"error": str(exc), "over_line": False})
        finally:  # a run cut short (SIGTERM) still writes what it measured
            result["freetoken"] = {**(attempts or [{"error": "stopped before it ran"}])[-1], "attempts": len(attempts)}
            save()
        if len(attempts) > 1:
            result["freetoken_first_attempt"] = attempts[0]
    if "error" not in result["ferry"] and "error" not in result["freetoken"]:
        result["ratios"] = ratios(result["ferry"], result["freetoken"])
    result["seconds"] = round(time.monotonic() - t0, 1)
    save()
    print(f"wrote {path} in {result['seconds']} s")
    print("\n".join(table(result)))
    return 0 if "ratios" in result else 1


if __name__ == "__main__":
    sys.exit(main())
