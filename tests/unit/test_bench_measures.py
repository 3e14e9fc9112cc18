"""What the benchmark scripts compute from what they observe, on CPU: TTFT's text prompt holds
exactly the tokens it claims and a decode figure is the median of its repeats (bench/serve_openai.py),
a profile's copy timeline (bench/profile_prefill.py's device_timeline, which profile_decode.py shares)
finds the copies' busy time, the gaps between them, where the gaps open and what computed inside them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench.profile_decode import is_expert_copy
from bench.profile_prefill import device_timeline, is_host_to_device
from bench.serve_openai import decode_run, text_of_tokens
from ferry.services.bench_model import write_bench_model

ROOT = Path(__file__).resolve().parents[2]

QWEN3 = "tests/data/models/qwen3-30b-a3b/config.json"


def test_the_ttft_text_prompt_encodes_to_exactly_the_asked_number_of_tokens(tmp_path, tiny_models):
    from tokenizers import Tokenizer

    bench = write_bench_model(tmp_path / "m", QWEN3, num_layers=1)  # the 151,936-id tokenizer the suite uses
    for model, high in ((bench, 100_000), (tiny_models["qwen3_moe"], None)):
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        high = high or tok.get_vocab_size()
        rng = np.random.default_rng(1)
        for n in (1, 37, 2000):
            text = text_of_tokens(str(model), n, rng, min(1000, high // 2), high)
            assert len(tok.encode(text, add_special_tokens=False).ids) == n, (model.name, n)


def test_a_byte_level_vocabulary_gets_only_ids_whose_text_stands_alone(tmp_path):
    """Byte tokens of a byte-level BPE decode, alone, to U+FFFD when they hold part of a UTF-8
    character, and that encodes to other ids: only the ids whose text stands alone are drawn, and
    a range with none of them gives None (the caller measures with token ids instead)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(byte_chars, key=lambda c: bytes(c, "utf-8"))  # not the byte order: mixed on purpose
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    singles = tok.decode_batch([[i] for i in range(256)])
    assert sum("\ufffd" in t for t in singles) == 128  # the bytes 0x80-0xff
    for seed in range(6):
        text = text_of_tokens(str(tmp_path), 300, np.random.default_rng(seed), 0, 256)
        assert text is not None and len(tok.encode(text, add_special_tokens=False).ids) == 300
    lone = [i for i, t in enumerate(singles) if "\ufffd" in t]
    assert text_of_tokens(str(tmp_path), 10, np.random.default_rng(0), min(lone), min(lone) + 1) is None


def _event(name: str, start: float, end: float, cuda: bool = True):
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))


def test_the_copy_timeline_finds_busy_time_gaps_where_they_open_and_what_ran_in_them():
    # µs: copies [0, 250) (two touching), [400, 500), [1500, 1600); kernels inside the gaps
    events = [
        _event("cudaMemcpyAsync", -5, -2, cuda=False),
        _event("cudaLaunchKernel", 300, 310, cuda=False),
        _event("Memcpy HtoD (Pinned -> Device)", 0, 100),
        _event("Memcpy HtoD (Pinned -> Device)", 100, 250),
        _event("Memcpy HtoD (Pinned -> Device)", 400, 500),
        _event("Memcpy HtoD (Pinned -> Device)", 1500, 1600),
        _event("Memcpy DtoH (Device -> Pinned)", 1600, 1610),  # neither a copy in nor a kernel
        _event("_gate_up_kernel", 260, 390),
        _event("_prefill_kernel", 600, 1400),
        _event("_rms_norm_kernel", 1450, 1460),
    ]
    t = device_timeline(SimpleNamespace(events=lambda: events), largest=4)
    assert t["copies"] == 4 and t["copy_busy_ms"] == pytest.approx(0.45) and t["copy_span_ms"] == pytest.approx(1.6)
    assert t["copy_gap_ms"] == pytest.approx(1.15) and t["copy_gaps_over_50us"] == 2 and t["copy_gaps_under_20us"] == 0
    assert t["largest_copy_gaps_ms"] == pytest.approx([1.0, 0.15])
    assert t["largest_copy_gaps_at_ms"] == [(0.5, 1.0), (0.25, 0.15)]
    longest, second = t["kernels_in_largest_gaps"]
    assert [n for n, _ in longest] == ["_prefill_kernel", "_rms_norm_kernel"] and longest[0][1] == pytest.approx(0.8)
    assert second == [("_gate_up_kernel", pytest.approx(0.13))]
    assert t["kernel_busy_ms"] == pytest.approx(0.94) and t["host_launches"] == 2
    assert t["host_enqueue_span_ms"] == pytest.approx(0.315)


def test_a_decode_profile_counts_the_copy_kernel_and_copy_engine_copies_as_expert_copies():
    assert is_expert_copy("_copy_experts_kernel") and is_expert_copy("Memcpy HtoD (Pinned -> Device)")
    assert not is_expert_copy("_pair_gate_up_kernel") and not is_expert_copy("Memcpy DtoH (Device -> Pinned)")
    assert is_host_to_device("Memcpy HtoD (Pinned -> Device)") and not is_host_to_device("_copy_experts_kernel")


def test_a_decode_figure_is_its_median_repeat_and_one_slow_repeat_does_not_make_it():
    """Each repeat's streams are timed from their chunks; the figure is the median repeat's, every repeat is
    kept, and the tokens (for the bytes a token) are all the repeats'."""
    rates = iter(
        [
            250.0,
            196.0,
            260.0,  # one stream, three repeats: the second slow
            60.0,
            62.0,
            61.0,
            64.0,
            59.0,
            63.0,
        ]
    )  # two streams, three repeats
    rates_even = iter([30.0, 10.0, 40.0, 20.0])

    def once():  # a repeat's streams start together; each ends when its 127 tokens after the first are out
        tok_s = next(rates)
        return {
            "tokens": 128,
            "tok_s": tok_s,
            "start": 5.0,
            "first_s": 0.1,
            "last_s": 0.1 + 127 / tok_s,
            "max_gap_s": 2 / tok_s,
        }

    one = decode_run(once, 1, 3)
    assert [r["median_stream_tok_s"] for r in one["repeats"]] == [250.0, 196.0, 260.0]
    assert one["median_stream_tok_s"] == 250.0 and one["aggregate_tok_s"] == pytest.approx(250.0)
    assert one["tokens"] == 384 and one["streams"] == 1 and len(one["max_gap_s"]) == 3
    assert one["median_repeat"] == 0
    two = decode_run(once, 2, 3)
    assert [sorted(r["per_stream_tok_s"]) for r in two["repeats"]] == [[60.0, 62.0], [61.0, 64.0], [59.0, 63.0]]
    # the repeats' medians 61, 62.5 and 61: a repeat of 61 is the middle one, and its aggregate is the run's
    assert two["median_stream_tok_s"] == 61.0 and two["median_repeat"] in (0, 2)
    mid = two["repeats"][two["median_repeat"]]
    assert two["aggregate_tok_s"] == mid["aggregate_tok_s"]
    # each stream's tokens after its first over the wall time from the earliest first chunk to the latest last
    assert mid["aggregate_tok_s"] == pytest.approx((256 - 2) / (127 / min(mid["per_stream_tok_s"])))
    assert two["tokens"] == 768 and len(two["per_stream_tok_s"]) == 6
    even = decode_run(
        lambda: {
            "tokens": 11,
            "tok_s": next(rates_even),
            "start": 0.0,
            "first_s": 0.0,
            "last_s": 1.0,
            "max_gap_s": 0.1,
        },
        1,
        4,
    )
    assert even["median_stream_tok_s"] == 20.0  # 10, 20, 30, 40: the lower middle repeat, not their mean
    with pytest.raises(ValueError, match="--repeats 0"):
        decode_run(once, 1, 0)


def test_the_oracle_bench_keeps_the_runs_that_served_when_one_did_not(tmp_path, monkeypatch):
    """bench/speculation_oracle.py: a run whose server stops before it is ready (or dies serving) is recorded with its
    error and log, the runs beside it and speculation off keep their figures in the JSON, and the exit code says
    one failed."""
    import json
    import sys

    from bench import speculation_oracle

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    served = []

    def fake_serve(tag, model_dir, flags, env, prompts, out, args):
        served.append((tag, env.get("FERRY_BENCH_PINNED_DRAFTS")))
        if tag == "spec_oracle_0.8":
            raise RuntimeError("ferry serve exited with 1 before it was ready")
        rate = {"spec_off": 100.0}.get(tag, 150.0)
        return {
            "serve": tag,
            "median_e2e_tok_s": rate,
            "median_stream_tok_s": rate,
            "acceptance": None,
            "mean_k": None,
            "decode_step_ms": 1.0,
            "chain_position_ms": 0.5,
            "verify_step_ms": 2.0,
            "verify_wall_ms": 3.0,
            "steps": 10.0,
            "steps_ahead": 9.0,
            "texts": ["a"],
        }

    monkeypatch.setattr(speculation_oracle, "serve_and_measure", fake_serve)
    monkeypatch.setattr(speculation_oracle, "commit", lambda: "test")
    argv = ["spec-oracle", "--out", str(tmp_path / "out"), "--model", str(model), "--alphas", "0.8"]
    monkeypatch.setattr(sys, "argv", [*argv, "--pinned-drafts", "2"])
    assert speculation_oracle.main() == 1
    assert served == [("spec_off", None), ("spec_oracle_0.8", None), ("spec_oracle_0.8_pinned2", "2")]
    result = json.loads((tmp_path / "out" / "spec_oracle_m.json").read_text())
    assert result["off"]["median_e2e_tok_s"] == 100.0
    failed, pinned = result["oracle"]
    assert failed["error"].startswith("ferry serve exited") and failed["log"] == "serve_spec_oracle_0.8.log"
    assert pinned["pinned_drafts"] == 2 and pinned["vs_off"] == 1.5 and pinned["same_text_as_off"]


def test_profile_decode_profiles_verify_steps_as_the_scheduler_sends_them(tmp_path, monkeypatch):
    """bench/profile_decode.py --draft-tokens: each profiled step carries every row's token and d drafts, a hybrid's
    rows holding their states in snapshots and asking the MTP head for d drafts; a row advances by what the verify
    kept (computed_after_verify: a hybrid's refused drafts leave it where it was)."""
    from bench.profile_decode import profile_streams
    from ferry.services.make_tiny_model import make_tiny_model
    from tests.unit.test_speculative_decoding import boot

    executor, plan = boot(
        make_tiny_model(tmp_path / "m", "qwen3_5_moe", seed=0, mtp=True), "--speculative-method", "mtp"
    )
    steps, execute = [], executor.execute

    def recording(batch):
        out = execute(batch)
        if batch.draft_lens is not None:
            steps.append((batch, out))
        return out

    monkeypatch.setattr(executor, "execute", recording)
    run = profile_streams(executor, plan, 2, 2, 3, np.random.default_rng(0), first_req_id=1, drafts=3)
    assert run["draft_tokens"] == 3 and len(steps) == 6  # two warm-up, two timed, two profiled
    for batch, out in steps:
        assert batch.query_lens.tolist() == [4, 4] and batch.draft_lens.tolist() == [3, 3]
        assert batch.hold_state.tolist() == [0, 1] and batch.mtp_drafts.tolist() == [3, 3]
        assert out.mtp_drafts.shape == (2, 3) and ((0 <= out.accepted_drafts) & (out.accepted_drafts <= 3)).all()
    for (before, out), (after, _) in zip(steps, steps[1:]):
        moved = after.context_lens - before.context_lens
        assert (moved == np.where(out.accepted_drafts == 3, 4, 0)).all()
