"""What the benchmark scripts compute from what they observe, on CPU: TTFT's text prompt holds
exactly the tokens it claims and a decode figure is the median of its repeats (bench/serve_openai.py),
a profile's copy timeline (bench/profile_prefill.py's device_timeline, which profile_decode.py shares)
finds the copies' busy time, the gaps between them, where the gaps open and what computed inside them,
and the host share's benches take only the settings they can measure (host_split_sweep.py,
host_price_tokens.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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


def test_the_cpu_expert_benchmark_computes_the_experts_of_the_model():
    """bench/cpu_expert_bw.py times what the expert store computes: gate/up, SiLU-and-mul, down."""
    from bench.cpu_expert_bw import expert_ffn
    from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference

    g = torch.Generator().manual_seed(0)
    w13, w2, x = torch.randn(3, 16, 8, generator=g), torch.randn(3, 8, 8, generator=g), torch.randn(2, 8, generator=g)
    want = grouped_expert_forward_reference(x, torch.tensor([[1], [1]]), torch.ones(2, 1), w13, w2)
    assert torch.allclose(expert_ffn(x, w13[1], w2[1]), want, atol=1e-5)


def test_the_contention_benchmark_times_both_builds_under_a_hog(tmp_path):
    """bench/host_pool_contention.py times this tree's kernel (at two spins of its idle threads) and a second
    build (here the same library loaded again) in alternated blocks, with and without a busy process, and
    leaves no process behind."""
    from ferry.services.worker.offload.host_compute import host_expert_kernel as K

    if K.library()[0] is None:
        pytest.skip(f"host kernel not built: {K.library()[1]}")
    out = tmp_path / "contention.json"
    cmd = [
        sys.executable,
        "bench/host_pool_contention.py",
        "--config",
        "tests/data/models/qwen3-30b-a3b",
        "--threads",
        "2",
        "--hog",
        "none,2/1",
        "--hog-cpus",
        "0",
        "--rounds",
        "2",
        "--block",
        "14",
        "--bank-experts",
        "4",
        "--experts",
        "2",
        "--gap-us",
        "50",
        "--compare-library",
        K.library_path(),
        "--spin-us",
        "50,0",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    variants = ["tree", "tree_spin0us", "compared"]  # the tree's kernel a spin each, then the other build
    assert [(r["variant"], r["hog"]) for r in rows] == [(v, hog) for hog in ("none", "2/1") for v in variants]
    assert all(r["calls"] == 2 * 4 and 0 < r["median_us"] <= r["p99_us"] <= r["max_us"] for r in rows)


def test_the_cpu_expert_benchmark_alternates_prefetch_distances_and_says_each():
    """`--prefetch` gives one row a distance of the c backend, each timed on calls of its own, and the
    rows' kernel left at the last; the torch backend has no rows to prefetch in and is refused."""
    from bench.cpu_expert_bw import format_banks, host_experts_bandwidth
    from ferry.services.worker.offload.host_compute import host_expert_kernel as K

    banks = format_banks("bf16", 64, 32, 4, huge_pages=False)
    with pytest.raises(ValueError, match="c backend"):
        host_experts_bandwidth(banks, 1, 1, 2, "torch", prefetches=[0, 1024])
    if K.library()[0] is None:
        pytest.skip(f"host kernel not built: {K.library()[1]}")
    rows = host_experts_bandwidth(banks, 1, 2, 3, "c", prefetches=[0, 1024, 4096])
    assert [r["prefetch"] for r in rows] == [0, 1024, 4096]
    assert all(r["expert_us"] > 0 and r["bank_GBps"] > 0 and r["isa"] for r in rows)
    (only,) = host_experts_bandwidth(banks, 1, 1, 2, "c")
    assert only["prefetch"] == K.DEFAULT_PREFETCH_BYTES


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_the_polled_hand_off_probe_answers_each_round_once(tmp_path):
    """bench/host_handoff_latency.py's host thread (host_poll_probe.c), driven from here as the GPU's
    stream memory operations would drive it: each round's number written to `go` is answered in `done`,
    `go` cleared, and the rounds counted; the thread stops when asked."""
    from bench.host_handoff_latency import Poller, build_probe, round_trip_on_host

    poller = Poller(build_probe(tmp_path), pin=False)
    try:
        for value in range(1, 201):
            round_trip_on_host(poller, value)
        assert int(poller.flags[Poller.GO : Poller.GO + 4].view(torch.int32)[0]) == 0
    finally:
        poller.close()
    assert poller.rounds() == 200


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


def test_the_split_sweeps_settings_are_scales_offsets_or_off_and_a_bad_one_names_the_flag():
    """bench/host_split_sweep.py's settings: `off` prices the host out (the hand-off still runs), a scale
    multiplies the host's one-token price, `+N` adds N µs to the hand-off's price; nothing else passes."""
    from bench.host_split_sweep import SETTLE_STEPS, parse_settings, prices_for, stream_tokens

    got = parse_settings("off,1.0,1.5,1.0+150,0.8+20.5")
    assert got == [
        ("off", None, 0.0),
        ("1.0", 1.0, 0.0),
        ("1.5", 1.5, 0.0),
        ("1.0+150", 1.0, 150.0),
        ("0.8+20.5", 0.8, 20.5),
    ]
    base = (113_000, 80_000, 14_000, 31_000)
    assert prices_for(base, None, 0.0, 10**9) == (113_000, 10**9, 14_000, 31_000)
    assert prices_for(base, 1.5, 0.0, 10**9) == (113_000, 120_000, 14_000, 31_000)
    assert prices_for(base, 1.0, 150.0, 10**9) == (113_000, 80_000, 14_000, 181_000)
    for bad in ("off+10", "1.0,1.0", "fast", "0", "-1", "1.0+x", ""):
        with pytest.raises(ValueError, match="--settings"):
            parse_settings(bad)
    # the stream's pages cover every step it takes: 100 warm, then 2 rounds of 8 settings of 3 settle + 150 timed
    steps = 100 + 2 * 8 * (SETTLE_STEPS + 150)
    assert stream_tokens(100, 2, 8, 150) >= 64 + steps + 1


def test_the_host_price_bench_draws_its_lines_without_a_load_and_says_which_flag_is_wrong():
    """bench/host_price_tokens.py --link-load: `none` first (its lines are drawn through those times), then the
    loads beside it; a load needs CUDA, and a bad list names the flag instead of timing anything."""
    cases = (
        ("packed,none", "none, then any of packed, plain, ce"),
        ("none,none", "each once"),
        ("none,xx", "none, then"),
    )
    for bad, says in cases:
        done = subprocess.run(
            [sys.executable, "bench/host_price_tokens.py", "--link-load", bad],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and f"--link-load {bad}" in done.stderr and says in done.stderr, done.stderr
