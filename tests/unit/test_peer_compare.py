"""bench/peer_compare.py's pure parts, on CPU with no process started: its flags, FreeToken's memory ratio from the
line, the check that FreeToken can read the checkpoint's expert names, nvidia-smi's rows summed per engine,
FreeToken's readiness, the figures taken from the client's result, the ratios and the printed table; and
serve_openai's text prompts (FreeToken takes no token ids)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from bench import peer_compare as pc
from bench.serve_openai import prompt_texts
from ferry.services.bench_model import write_bench_model

QWEN36 = "tests/data/models/qwen3.6-35b-a3b/config.json"
NVFP4 = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "quantization_config": {"quant_algo": "NVFP4"}}


def test_the_flags_take_sizes_with_units_and_a_bad_one_names_its_flag(capsys):
    args = pc.parse_args(["--memory-line", "24GiB", "--freetoken-allowance", "1536MiB"])
    assert (args.line_mib, args.allowance_mib, args.margin_mib) == (24576, 1536, 256)
    assert (args.max_tokens, args.repeats, args.ttft_runs, args.ttft_prompt_len) == (128, 3, 3, 2000)
    for argv, said in (
        (["--memory-line", "24"], "--memory-line '24'"),
        (["--freetoken-allowance", "-1GiB"], "--freetoken-allowance"),
        (["--memory-line", "1GiB", "--freetoken-allowance", "2GiB"], "must be less than --memory-line"),
        (["--repeats", "0"], "--repeats 0: at least 1"),
        (["--config", "no/such/config.json"], "--config no/such/config.json"),
        (["--streams", "1,x"], "--streams '1,x'"),
        (["--num-layers", "0"], "--num-layers 0"),
    ):
        with pytest.raises(SystemExit):
            pc.parse_args(argv)
        assert said in capsys.readouterr().err


def test_freetokens_ratio_keeps_its_caches_to_the_line_less_the_allowance():
    # an 80 GB card with 79,000 MiB free: (24,576 - 1,536) / 79,000, rounded down
    ratio = pc.freetoken_memory_ratio(24576, 79000, 1536)
    assert ratio == 0.2916 and ratio * 79000 <= 24576 - 1536
    assert pc.freetoken_memory_ratio(24576, 24576, 0) == 1.0
    with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
        pc.freetoken_memory_ratio(24576, 20000, 1536)  # less free than the line: the ratio would pass 1
    with pytest.raises(ValueError, match="0 MiB free"):
        pc.freetoken_memory_ratio(24576, 0, 1536)


def test_a_second_start_lowers_the_ratio_by_the_excess_and_the_margin():
    lowered = pc.lowered_ratio(0.2916, 79000, excess_mib=600, margin_mib=256)
    assert lowered == 0.2807 and (0.2916 - lowered) * 79000 >= 600 + 256 - 8  # rounded down to 1e-4 of 79,000
    with pytest.raises(ValueError, match="no lower ratio"):
        pc.lowered_ratio(0.01, 79000, excess_mib=2000, margin_mib=256)


def test_freetoken_reads_only_the_published_expert_names_and_the_check_says_which_it_misses():
    published = {
        f"model.language_model.layers.0.mlp.experts.1.{p}.{k}": "a.safetensors"
        for p in ("gate_proj", "up_proj", "down_proj")
        for k in ("weight", "weight_scale", "weight_scale_2", "input_scale")
    }
    assert pc.freetoken_layout_problem(NVFP4, published | {"model.layers.0.mlp.gate.weight": "a"}) is None
    ferry = {"model.layers.0.mlp.experts.1.gate_proj.weight": "a", **published}
    problem = pc.freetoken_layout_problem(NVFP4, ferry)
    assert "1 of 13 expert tensors" in problem and "'model.layers.0.mlp.experts.1.gate_proj.weight'" in problem
    assert "no per-expert tensors" in pc.freetoken_layout_problem(
        NVFP4, {"model.layers.0.mlp.experts.gate_up_proj": "a"}
    )
    # another format: nothing is claimed
    assert pc.freetoken_layout_problem({**NVFP4, "quantization_config": {"quant_method": "fp8"}}, ferry) is None


def test_bf16_experts_are_checked_against_the_layout_freetoken_reads_for_the_family():
    qwen35 = {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    qwen3 = {"architectures": ["Qwen3MoeForCausalLM"]}
    per_expert = {"model.layers.0.mlp.experts.1.gate_proj.weight": "a"}
    fused = {f"model.language_model.layers.0.mlp.experts.{t}": "a" for t in ("gate_up_proj", "down_proj")}
    assert pc.freetoken_layout_problem(qwen35, fused) is None
    assert "--expert-layout fused" in pc.freetoken_layout_problem(qwen35, per_expert)
    assert "not under model.language_model." in pc.freetoken_layout_problem(
        qwen35, {"model.layers.0.mlp.experts.down_proj": "a"}
    )
    assert pc.freetoken_layout_problem(qwen3, per_expert) is None
    assert "only per expert" in pc.freetoken_layout_problem(qwen3, {"model.layers.0.mlp.experts.down_proj": "a"})
    assert pc.expert_layout(qwen35, "bf16") == "fused" and pc.expert_layout(qwen35, "nvfp4") == "per-expert"
    assert pc.expert_layout(qwen3, "bf16") == "per-expert"


def test_the_cuts_planned_names_are_checked_in_the_layout_make_bench_model_writes():
    fused = pc.planned_expert_names(QWEN36, num_layers=8, layout="fused")
    assert len(fused) == 8 * 2 and "model.language_model.layers.7.mlp.experts.gate_up_proj" in fused
    assert pc.freetoken_layout_problem({"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, fused) is None
    qwen3 = "tests/data/models/qwen3-30b-a3b/config.json"
    names = pc.planned_expert_names(qwen3, num_layers=12)
    assert len(names) == 12 * 128 * 3 and "model.layers.11.mlp.experts.127.down_proj.weight" in names
    assert pc.freetoken_layout_problem({"architectures": ["Qwen3MoeForCausalLM"]}, names) is None
    args = pc.parse_args(["--config", qwen3, "--num-layers", "12", "--format", "bf16", "--streams", "1"])
    assert args.label == "12layers_bf16" and args.model_dir.endswith("peer_ckpt_bf16_qwen3-30b-a3b_12layers")
    cmd = pc.client_command("http://127.0.0.1:9/v1", pc.Path("/m"), pc.Path("/o.json"), args)
    assert dict(zip(cmd[2::2], cmd[3::2]))["--streams"] == "1"


def test_the_names_make_bench_model_writes_for_the_35b_are_checked_before_it_writes_them_and_freetoken_reads_them():
    names = pc.planned_expert_names(QWEN36)
    assert len(names) == 40 * 256 * 3 and "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in names
    config = json.loads(open(QWEN36).read()) | {"quantization_config": {"quant_algo": "NVFP4"}}
    assert pc.freetoken_layout_problem(config, names) is None


def test_gpt_oss_is_checked_as_freetoken_reads_it_fused_mxfp4(tmp_path):
    """FreeToken 0.1.2 reads gpt-oss only as openai publishes it (mxfp4, six fused tensors a MoE layer): the
    planned names of the 12-layer gpt-oss-120b cut pass, per-expert or bf16 ones do not, and what make-bench-model
    writes fused for a tiny gpt-oss is what the check planned."""
    from ferry.services.bench_model import write_bench_model, write_random_weights
    from ferry.services.make_tiny_model import make_tiny_model

    gpt_oss = "tests/data/models/gpt-oss-120b/config.json"
    config = json.loads(open(gpt_oss).read()) | {"quantization_config": {"quant_method": "mxfp4"}}
    assert pc.expert_layout(config, "mxfp4") == "fused"
    names = pc.planned_expert_names(gpt_oss, num_layers=12, layout="fused")
    assert len(names) == 12 * 6 and "model.layers.11.mlp.experts.down_proj_scales" in names
    assert pc.freetoken_layout_problem(config, names) is None
    assert "six fused" in pc.freetoken_layout_problem(config, dict(list(names.items())[1:]))
    per_expert = pc.planned_expert_names(gpt_oss, num_layers=12)
    assert "--expert-layout fused" in pc.freetoken_layout_problem(config, per_expert)
    bf16 = {k: v for k, v in config.items() if k != "quantization_config"}
    assert "only with mxfp4" in pc.freetoken_layout_problem(bf16, names)
    tiny = make_tiny_model(tmp_path / "tiny", "gpt_oss", seed=0)
    out = write_bench_model(tmp_path / "w", tiny / "config.json")
    write_random_weights(out, dtype="float32", fmt="mxfp4", expert_layout="fused")
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n in written if ".mlp.experts." in n} == set(
        pc.planned_expert_names(tiny / "config.json", None, "fused")
    )
    assert pc.freetoken_layout_problem(json.loads((out / "config.json").read_text()), written) is None


def test_glm_is_checked_as_freetoken_reads_it_nvfp4_with_its_dense_mlps_and_shared_experts_quantized(tmp_path):
    """FreeToken 0.1.2 reads GLM-4 MoE only in NVFP4, routed experts per expert and the dense layers' MLPs and the
    shared experts quantized too: the 12-layer GLM-4.5-Air cut's planned names pass, bf16 does not, a config that
    leaves the dense MLP or a shared expert bf16 does not, and what make-bench-model writes for a tiny GLM passes."""
    from ferry.services.bench_model import write_bench_model, write_random_weights
    from ferry.services.make_tiny_model import make_tiny_model

    glm = "tests/data/models/glm-4.5-air/config.json"
    config = json.loads(open(glm).read()) | {"quantization_config": {"quant_algo": "NVFP4"}}
    names = pc.planned_expert_names(glm, num_layers=12)
    assert len(names) == 11 * 128 * 3 and "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert pc.freetoken_layout_problem(config, names) is None
    bf16 = {k: v for k, v in config.items() if k != "quantization_config"}
    assert "only in NVFP4" in pc.freetoken_layout_problem(bf16, names)
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.up_proj"):
        kept = config | {"quantization_config": {"quant_algo": "NVFP4", "exclude_modules": [module]}}
        assert module in pc.freetoken_layout_problem(kept, names)
    fused = {"model.layers.1.mlp.experts.gate_up_proj": "", "model.layers.1.mlp.experts.down_proj": ""}
    assert "has none" in pc.freetoken_layout_problem(config, fused)
    misnamed = {n.replace("model.layers.", "model.language_model.layers."): "" for n in names}
    assert "model.language_model.layers." in pc.freetoken_layout_problem(config, misnamed)
    tiny = make_tiny_model(tmp_path / "tiny", "glm4_moe", seed=0)
    out = write_bench_model(tmp_path / "w", tiny / "config.json")
    write_random_weights(out, dtype="float32", fmt="nvfp4")
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.gate_proj.weight_scale" in written
    assert "model.layers.1.mlp.shared_experts.down_proj.weight_scale_2" in written
    assert "model.layers.1.mlp.gate.weight_scale" not in written  # the router stays bf16
    assert pc.freetoken_layout_problem(json.loads((out / "config.json").read_text()), written) is None


def test_nvidia_smis_rows_are_summed_over_the_engines_session_alone():
    apps = pc.parse_compute_apps("101, 20000\n102, 1500\n7, [N/A]\n\n300, 900\nNo running processes found\n")
    assert apps == [(101, 20000.0), (102, 1500.0), (300, 900.0)]
    sessions = {101: 100, 102: 100, 300: 299}
    assert pc.engine_memory(apps, sessions.get, 100) == (21500.0, 22400.0, [101, 102])
    assert pc.engine_memory(apps, lambda pid: None, 100) == (0, 22400.0, [])  # another pid namespace


def test_the_sampler_reports_its_sessions_peak_and_falls_back_to_every_process_without_pids():
    sampler = pc.MemorySampler()
    sampler.watch(100)
    with sampler._lock:  # what two samples leave (run() does this under nvidia-smi)
        sampler.peak_session_mib, sampler.peak_all_mib, sampler.pids, sampler.samples = 21500.0, 22400.0, {101}, 2
    assert sampler.report() == {"peak_process_mib": 21500, "pids_matched": True, "gpu_pids": [101], "samples": 2}
    sampler.watch(200)
    with sampler._lock:
        sampler.peak_all_mib, sampler.samples = 23000.0, 1
    assert sampler.report() == {"peak_process_mib": 23000, "pids_matched": False, "gpu_pids": [], "samples": 1}


def test_freetoken_is_ready_at_status_ok_not_at_a_200_while_it_loads_and_its_error_stops_the_wait():
    assert not pc.freetoken_ready(200, json.dumps({"status": "loading", "phase": "weights"}))
    assert pc.freetoken_ready(200, json.dumps({"status": "ok", "model": "m"}))
    assert not pc.freetoken_ready(503, "not json")
    with pytest.raises(RuntimeError, match="worker died"):
        pc.freetoken_ready(200, json.dumps({"status": "error", "message": "worker died"}))


def _detail(tokens1: int, tokens8: int) -> dict:
    return {
        "ttft_s": 0.41234,
        "ttft_prompt_tokens": [2000, 2000, 2000],
        "runs": [
            {"streams": 1, "median_stream_tok_s": 101.234, "aggregate_tok_s": 100.0, "tokens": tokens1},
            {"streams": 8, "median_stream_tok_s": 60.0, "aggregate_tok_s": 470.55, "tokens": tokens8},
        ],
    }


def test_an_engines_figures_come_from_the_clients_median_repeats_and_say_whether_every_token_came():
    got = pc.summarize(_detail(3 * 128, 3 * 8 * 128), max_tokens=128, repeats=3)
    assert got["single_stream_tok_s"] == 101.23 and got["streams8_tok_s"] == 470.55 and got["ttft_2k_s"] == 0.4123
    assert got["all_tokens_generated"] and got["tokens"] == {"1": 384, "8": 3072}
    assert not pc.summarize(_detail(3 * 128, 3 * 8 * 128 - 5), max_tokens=128, repeats=3)["all_tokens_generated"]


def test_the_ratios_are_ferry_over_freetoken_and_the_table_prints_both_engines_and_them():
    ferry = {
        "ready_s": 40.0,
        "peak_process_mib": 23000,
        "over_line": False,
        "single_stream_tok_s": 120.0,
        "streams8_tok_s": 600.0,
        "ttft_2k_s": 0.5,
    }
    peer = {
        "ready_s": 80.0,
        "peak_process_mib": 25000,
        "over_line": True,
        "single_stream_tok_s": 60.0,
        "streams8_tok_s": None,
        "ttft_2k_s": 1.0,
    }
    r = pc.ratios(ferry, peer)
    assert r == {
        "single_stream_tok_s": 2.0,
        "streams8_tok_s": None,
        "ttft_2k_s": 0.5,
        "ready_s": 0.5,
        "peak_process_mib": 0.92,
    }
    result = {
        "card": "NVIDIA H100 80GB HBM3",
        "memory_line_mib": 24576.0,
        "ferry_weights": "dummy",
        "ferry": ferry,
        "freetoken": peer,
        "ratios": r,
    }
    lines = pc.table(result)
    assert lines[1].split() == ["ferry", "40.000", "23000", "False", "120.000", "600.000", "0.500"]
    assert lines[2].split() == ["freetoken", "80.000", "25000", "True", "60.000", "-", "1.000"]
    assert lines[3].split() == ["ferry/peer", "0.500", "0.920", "2.000", "-", "0.500"]  # over_line has no ratio
    assert "line 24576 MiB" in lines[4] and "H100" in lines[4]
    assert lines[5] == "OVER THE LINE: freetoken (peak above 24576 MiB)" and len(lines) == 6
    assert len(pc.table({**result, "freetoken": {**peer, "over_line": False}})) == 5
    failed = pc.table({**result, "freetoken": {"error": "RuntimeError: FreeToken exited with 1"}, "ratios": None})
    assert "error: RuntimeError: FreeToken exited with 1" in failed[2]


def test_both_engines_get_the_same_client_arguments_with_text_prompts():
    args = pc.parse_args(["--max-tokens", "64", "--repeats", "2"])
    cmd = pc.client_command("http://127.0.0.1:9/v1", pc.Path("/m"), pc.Path("/o.json"), args)
    flags = dict(zip(cmd[2::2], cmd[3::2]))
    assert flags["--streams"] == "1,8" and flags["--max-tokens"] == "64" and flags["--repeats"] == "2"
    assert flags["--prompt-kind"] == "text" and flags["--config"] == "/m" and flags["--ttft-prompt-len"] == "2000"


def test_text_prompts_hold_exactly_their_tokens_and_several_threads_can_draw_them(tmp_path):
    from tokenizers import Tokenizer

    model = write_bench_model(tmp_path / "m", QWEN36, num_layers=1)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    draw = prompt_texts(str(model), 248320)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(draw(32))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 8
    assert all(len(tok.encode(t, add_special_tokens=False).ids) == 32 for t in got)
    assert len(tok.encode(draw(2000), add_special_tokens=False).ids) == 2000


def test_a_checkpoint_is_reused_only_once_make_bench_model_finished_it(tmp_path):
    assert not pc.finished_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"]}))
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert not pc.finished_checkpoint(tmp_path)  # killed after the index, before the quantization config
    assert pc.finished_checkpoint(tmp_path, "bf16")  # no quantization config to wait for
    (tmp_path / "config.json").write_text(json.dumps(NVFP4))
    assert pc.finished_checkpoint(tmp_path)
    args = pc.parse_args([])
    assert args.model_dir.endswith("peer_ckpt_nvfp4_qwen3.6-35b-a3b")


def test_ferry_may_serve_a_gguf_of_the_same_cut_where_freetoken_serves_none(tmp_path, monkeypatch):
    """--ferry-format gguf-TYPE: Ferry reads a GGUF file of random blocks of the same config and cut (no
    --load-format dummy: the file is its weights), FreeToken keeps --format's checkpoint; the command that makes
    the file, its reuse once finished, the label, and a type make-bench-model does not write refused by name."""
    args = pc.parse_args(
        ["--config", QWEN36, "--num-layers", "8", "--format", "nvfp4", "--ferry-format", "gguf-q4_k_m"]
        + ["--model-dir", str(tmp_path / "ckpt")]
    )
    assert args.label == "8layers_gguf-q4_k_m_vs_nvfp4"
    args.deadline = pc.time.monotonic() + args.budget_s  # as main() sets it
    with pytest.raises(SystemExit):
        pc.parse_args(["--config", QWEN36, "--ferry-format", "gguf-q4_k_q"])
    ran = []
    monkeypatch.setattr(pc.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    folder = pc.make_ferry_gguf(args, tmp_path / "make.log")
    assert folder == tmp_path / "ckpt_gguf-q4_k_m" and len(ran) == 1
    cmd = ran[0]
    assert cmd[cmd.index("--format") + 1] == "gguf-q4_k_m" and "--weights" in cmd and cmd[-2:] == ["--num-layers", "8"]
    assert pc.make_ferry_gguf(args, tmp_path / "make.log") == folder and len(ran) == 1  # finished: reused
    served = []
    monkeypatch.setattr(
        pc,
        "start_serve",
        lambda model, flags, log: served.append(flags) or SimpleNamespace(proc=None, command="", base=""),
    )
    pc.start_ferry(folder, args, tmp_path / "serve.log")
    assert "--load-format" not in served[0] and served[0][:2] == ["--gpu-memory", "24GiB"]
