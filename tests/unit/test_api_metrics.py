"""The api's /metrics text: vLLM's names for the common series carry Ferry's values, preemptions are a
counter, and refusals are counted by status."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ferry.services.api.metrics import ApiMetrics
from ferry.shared.messages import SchedulerStatus


def samples(m: ApiMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_vllm_aliases_carry_ferrys_values():
    m = ApiMetrics("tiny")
    m.prompt_tokens.inc(30)
    m.generation_tokens.inc(7)
    m.cached_tokens.inc(16)
    m.ttft.observe(0.02)
    for outcome in ("stop", "stop", "length", "disconnected", "InvalidRequest"):
        m.requests.labels("chat", outcome).inc()
    m.refresh_from(
        SchedulerStatus(
            boot_id="b",
            ready=True,
            reason="",
            running=3,
            waiting=2,
            kv_pages_total=100,
            kv_pages_available=25,
            preemptions=4,
        ),
        True,
    )
    got = samples(m)
    tiny = (("model_name", "tiny"),)
    assert got[("vllm:num_requests_running", tiny)] == 3 and got[("vllm:num_requests_waiting", tiny)] == 2
    assert got[("vllm:kv_cache_usage_perc", tiny)] == got[("vllm:gpu_cache_usage_perc", tiny)] == 0.75
    assert got[("vllm:prompt_tokens_total", tiny)] == got[("ferry_prompt_tokens_total", ())] == 30
    assert got[("vllm:generation_tokens_total", tiny)] == 7
    assert got[("vllm:prefix_cache_queries_total", tiny)] == 30 and got[("vllm:prefix_cache_hits_total", tiny)] == 16
    assert got[("vllm:time_to_first_token_seconds_count", tiny)] == 1
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.025"), ("model_name", "tiny")))] == 1
    assert got[("ferry_preemptions_total", ())] == got[("vllm:num_preemptions_total", tiny)] == 4
    reasons = {dict(k[1])["finished_reason"]: v for k, v in got.items() if k[0] == "vllm:request_success_total"}
    assert reasons == {"stop": 2, "length": 1, "abort": 1}  # errors are not successes


def test_preemptions_are_a_counter_and_refusals_are_labelled():
    m = ApiMetrics("tiny")
    m.refused.labels("/v1/messages", "401").inc()
    text = m.exposition().decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["ferry_preemptions"] == types["vllm:num_preemptions"] == "counter"
    assert 'ferry_refused_requests_total{route="/v1/messages",status="401"} 1.0' in text


def test_prefix_hits_and_snapshot_evictions_are_counters_from_the_schedulers_status():
    m = ApiMetrics("tiny")
    m.refresh_from(
        SchedulerStatus(boot_id="b", ready=True, reason="", prefix_hits=5, snapshot_evictions=2, state_snapshots=7),
        True,
    )
    got = samples(m)
    assert got[("ferry_prefix_cache_hits_total", ())] == 5 and got[("ferry_state_snapshot_evictions_total", ())] == 2
    assert got[("ferry_state_snapshots", ())] == 7
    types = {f.name: f.type for f in text_string_to_metric_families(m.exposition().decode())}
    assert types["ferry_prefix_cache_hits"] == types["ferry_state_snapshot_evictions"] == "counter"


def test_ferry_requests_says_it_counts_each_choice():
    """A request with n=3 counts 3 in ferry_requests_total (one generation a choice): its help says so."""
    families = {f.name: f for f in text_string_to_metric_families(ApiMetrics("tiny").exposition().decode())}
    assert "n choices (or n prompts) counts n" in families["ferry_requests"].documentation


def test_speculative_counts_come_from_the_schedulers_status_under_vllms_names_too():
    m = ApiMetrics("tiny")
    m.refresh_from(
        SchedulerStatus(boot_id="b", ready=True, reason="", draft_rows=3, drafted_tokens=11, accepted_drafts=7),
        True,
    )
    got = samples(m)
    tiny = (("model_name", "tiny"),)
    assert got[("ferry_speculative_draft_rows_total", ())] == got[("vllm:spec_decode_num_drafts_total", tiny)] == 3
    assert got[("ferry_speculative_drafted_tokens_total", ())] == 11
    assert got[("vllm:spec_decode_num_draft_tokens_total", tiny)] == 11
    assert got[("ferry_speculative_accepted_tokens_total", ())] == 7
    assert got[("vllm:spec_decode_num_accepted_tokens_total", tiny)] == 7


def test_the_draft_length_controllers_counts_come_from_the_schedulers_status():
    m = ApiMetrics("tiny")
    m.refresh_from(
        SchedulerStatus(
            boot_id="b",
            ready=True,
            reason="",
            draft_decisions=10,
            chosen_drafts=25,
            draft_misses_added=300,
            draft_decode_step_s=0.004,
            draft_chain_position_s=0.0005,
            draft_verify_step_s=0.009,
            draft_verify_wall_s=0.012,
        ),
        True,
    )
    got = samples(m)
    assert got[("ferry_speculative_decode_step_seconds", ())] == 0.004  # the step costs it prices with
    assert got[("ferry_speculative_chain_position_seconds", ())] == 0.0005
    assert got[("ferry_speculative_verify_step_seconds", ())] == 0.009
    assert got[("ferry_speculative_verify_wall_seconds", ())] == 0.012
    assert got[("ferry_speculative_k_decisions_total", ())] == 10
    assert got[("ferry_speculative_k_chosen_total", ())] == 25
    assert got[("ferry_speculative_estimated_misses_added_total", ())] == 300
