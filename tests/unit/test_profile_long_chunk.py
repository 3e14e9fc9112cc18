"""bench/profile_long_chunk.py's reading of a profiled chunk: overlap, gaps and what waited, on a trace
whose answer is worked out by hand."""

from __future__ import annotations

import pytest

from bench.profile_long_chunk import device_events, family, load_events, save_events, summarize_events, summarize_trace


def _kernel(name: str, ts: float, dur: float, stream: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


# µs: the copy stream (20) copies [0, 100], [210, 310] and [400, 410]; the compute stream (7) runs the attention
# over [50, 150] and the experts' gate/up over [200, 250], and the host launched over [0, 30]
TRACE = {
    "traceEvents": [
        _kernel("_unpack_experts_kernel", 0, 100, 20),
        _kernel("void pytorch_flash::flash_fwd_kernel<...>", 50, 100, 7),
        _kernel("_gate_up_kernel", 200, 50, 7),
        _kernel("_unpack_experts_kernel", 210, 100, 20),
        _kernel("_unpack_experts_kernel", 400, 10, 20),
        _kernel("Memset (Device)", 390, 5, 7, cat="gpu_memset"),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 30},
        {"ph": "i", "cat": "kernel", "name": "an instant event is no span", "ts": 5},
    ]
}


def test_the_chunk_is_read_as_worked_out_by_hand():
    got = summarize_trace(TRACE)
    assert got["device_span_ms"] == pytest.approx(0.41)
    assert got["copies_busy_ms"] == pytest.approx(0.21) and got["compute_busy_ms"] == pytest.approx(0.15)
    # the copies computed beside [50, 100] and [210, 250]: 90 of their 210 µs
    assert got["copies_hidden_by_compute_ms"] == pytest.approx(0.09)
    assert got["copy_overlap"] == pytest.approx(0.429)
    # the one compute gap, [150, 200], ended with the experts' kernel: it waited
    assert got["compute_gaps_by_waiting_family"] == {"expert_gemm": [pytest.approx(0.05), 1]}
    assert got["largest_compute_gaps"] == [(0.05, 0.15, 0.0)]
    # the copies stood still over [100, 210] and [310, 400]: 50 µs of it during the attention, 10 during gate/up
    assert got["copies_idle_ms"] == pytest.approx(0.2)
    assert got["copies_idle_during_family_ms"] == {"flash_attention": 0.05, "expert_gemm": 0.01}
    assert got["streams"]["20"]["families_ms"] == {"unpack_copies": pytest.approx(0.21)}
    assert got["top_kernels"][0] == ["_unpack_experts_kernel", pytest.approx(0.21), 3]
    assert (got["host_launches"], got["host_enqueue_span_ms"]) == (1, pytest.approx(0.03))
    assert got["host_in_launch_calls_ms"] == pytest.approx(0.03) == got["host_longest_launch_call_ms"]


def test_saved_events_summarise_the_same(tmp_path):
    device, launches = device_events(TRACE)
    path = tmp_path / "device_events_at_0.json.gz"
    save_events(path, device, launches)
    assert summarize_events(*load_events(path)) == summarize_trace(TRACE)


def test_families_by_kernel_name():
    assert family("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4>>") == "flash_attention"
    assert family("_prefill_kernel") == "paged_attention"
    assert family("_gather_dequantize_kernel") == "flash_attention"
    assert family("_unpack_experts_kernel") == "unpack_copies"
    assert family("_down_kernel") == "expert_gemm"
    assert family("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "gated_deltanet"
    assert family("_conv_prefill_kernel") == family("_conv_state_kernel") == "gated_deltanet"
    assert family("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "cublas_gemm"
    assert summarize_trace({"traceEvents": []}) == {"device_events": 0}
