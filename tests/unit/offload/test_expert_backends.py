"""The expert backend objects (services/worker/offload/host_compute/expert_backends.py): the plan's choice becomes one
object in one place, boot runs that object's attach and reads no backend name itself, and each kind's own
steps (cpu's every-miss costs, auto's keep-or-drop and guard, hybrid's refined prices) are those it owns."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from ferry.plan.expert_backend import EXPERT_BACKENDS, ExpertBackendPlan, plan_expert_backend
from ferry.services.worker.offload.host_compute import expert_backends as B
from ferry.services.worker.offload.host_compute.prefill_share import HostCost
from ferry.services.worker.offload.host_compute.share_guard import ShareGuard

BOOT = Path(__file__).resolve().parents[3] / "services" / "worker" / "boot.py"
MEASURED = (100_000, 300_000, 2_000, 30_000)
COST = HostCost(pcie_s=100e-6, host_s_at_1=300e-6, host_s_per_token=2e-6, overhead_s=30e-6)


@pytest.mark.parametrize(
    "requested, threads, offloaded, cores, kind",
    [
        (None, None, True, 16, B.AutoBackend),  # auto with threads to spare: hybrid, decode share under the guard
        ("auto", 6, True, 2, B.AutoBackend),  # auto with threads given: still auto's rules
        ("auto", None, True, 7, B.GpuBackend),  # auto on too few cores: the GPU alone
        ("hybrid", None, True, 16, B.HybridBackend),
        ("cpu", None, True, 16, B.CpuBackend),
        ("gpu", None, True, 16, B.GpuBackend),
        ("cpu", None, False, 16, B.GpuBackend),  # every expert has a slot: nothing for the host
    ],
)
def test_each_plan_decision_is_one_backend_object(requested, threads, offloaded, cores, kind):
    choice = plan_expert_backend(requested, threads, offloaded, cores)
    backend = B.expert_backend_for(choice)
    assert type(backend) is kind and backend.choice is choice


def test_a_backend_the_plan_does_not_know_is_refused():
    with pytest.raises(ValueError, match="'tpu'"):
        B.expert_backend_for(ExpertBackendPlan("tpu", 4, "test", "tpu"))


def _boot_args(model_dir, *extra: str):
    from ferry.services.worker.flags import add_worker_flags, boot_config_from_args

    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    return boot_config_from_args(
        parser.parse_args(
            [
                "--model",
                str(model_dir),
                "--device",
                "cpu",
                "--max-running-requests",
                "4",
                "--max-prefill-tokens",
                "64",
                "--gpu-memory",
                "64MiB",
                "--moe-cache-size",
                "8",
                *extra,
            ]
        )
    )


@pytest.mark.parametrize("flag, kind", [("cpu", B.CpuBackend), ("gpu", B.GpuBackend)])
def test_boot_runs_the_attach_of_the_plans_backend_once(tiny_models, monkeypatch, flag, kind):
    from ferry.services.worker.boot import boot_worker

    ran = []

    def recorder(self, store, spec, plan, dtype, device):
        ran.append((type(self), store, plan))

    monkeypatch.setattr(B.GpuBackend, "attach", recorder)
    monkeypatch.setattr(B.HybridBackend, "attach", recorder)  # auto's and cpu's too
    executor, plan = boot_worker(_boot_args(tiny_models["qwen3_moe"], "--expert-backend", flag))
    assert ran == [(kind, executor.store, plan)]


def _names_compared(tree: ast.AST) -> list[str]:
    """Each comparison against a backend's name (a literal of EXPERT_BACKENDS) or the plan's backend fields."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            literal = isinstance(operand, ast.Constant) and operand.value in EXPERT_BACKENDS
            field = any(isinstance(n, ast.Attribute) and n.attr == "expert_backend" for n in ast.walk(operand))
            if literal or field:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_boot_compares_no_backend_name():
    """The backend's names are read in expert_backend_for alone: boot calls the object it gives."""
    assert _names_compared(ast.parse(BOOT.read_text())) == []
    assert _names_compared(ast.parse('if plan.expert_backend.backend != "gpu": pass'))  # the rule sees one


def test_cpu_hands_the_host_every_miss_refines_nothing_and_stops_the_prefetch():
    backend = B.expert_backend_for(plan_expert_backend("cpu", None, True, 16))
    share = SimpleNamespace(costs_ns=(0, 0, 0, 0), refines=True, on_refined=None, guard=None)
    store = SimpleNamespace(prefetch_enabled=True, host_share=SimpleNamespace(follow_host_price=print))
    backend.price_decode_share(share, MEASURED, store)
    assert share.costs_ns == (1, 0, 0, 0) and not share.refines and share.on_refined is None and share.guard is None
    assert not store.prefetch_enabled
    assert backend.prefill_costs(COST) == HostCost(1.0, 0.0, 0.0, 0.0)
    assert backend.link_traffic(store, "cuda") is None  # nothing crosses beside the hand-off


def test_hybrid_prices_by_what_was_measured_and_the_prefill_follows_the_refined_price():
    backend = B.expert_backend_for(plan_expert_backend("hybrid", None, True, 16))
    share = SimpleNamespace(costs_ns=(0, 0, 0, 0), refines=False, on_refined=None, guard=None)
    prefill = SimpleNamespace(follow_host_price=lambda s: None)
    store = SimpleNamespace(prefetch_enabled=True, host_share=prefill)
    backend.price_decode_share(share, MEASURED, store)
    assert share.costs_ns == MEASURED and share.refines and share.on_refined is prefill.follow_host_price
    assert share.guard is None and store.prefetch_enabled
    assert backend.prefill_costs(COST) is COST
    share.min_tokens = 1
    assert backend.keeps_decode_share(share, None, fields={}) and share.min_tokens == 1  # asked for: every launch


def test_auto_keeps_the_decode_share_only_where_the_host_takes_some_and_then_guards_it():
    backend = B.expert_backend_for(plan_expert_backend(None, None, True, 16))
    stopped = []
    share = SimpleNamespace(
        costs_ns=(0, 0, 0, 0),
        refines=False,
        on_refined=None,
        guard=None,
        handoff="poll",
        use_node=lambda: stopped.append(True),
    )
    share.min_tokens, share.max_tokens, share.top_k = 1, 8, 8
    fields = {"handoff": "poll", "typical_misses": 6}
    assert backend.keeps_decode_share(share, 2, fields=fields) and not stopped
    assert share.min_tokens == 2  # launches of one token hold no hand-off
    assert not backend.keeps_decode_share(share, None, fields=fields) and stopped
    store = SimpleNamespace(prefetch_enabled=True, host_share=None)
    backend.price_decode_share(share, MEASURED, store)
    assert isinstance(share.guard, ShareGuard) and share.costs_ns == MEASURED and share.refines
    assert store.prefetch_enabled


def test_the_share_covers_the_launches_where_the_host_takes_some_of_a_layers_misses():
    """Boot's prices as two H100 hosts logged them: the hybrid Qwen3.6 cut in Q4_K_M at 640 of 2,048 slots (a link
    copy 40.4 us an expert, the host 96 us, a hand-off 149.5 us) gives the host none of a one-token layer's ~6
    misses, so auto used to drop the share; its 8-token layers miss ~40, of which the host takes ~10. gpt-oss-120b's
    cut (248.1 us a copy, 294.9 us on the host, 149 us a hand-off; 512 of 1,536 slots, top-4) shares from one token."""
    qwen = B.host_takes_by_tokens((40_400, 96_000, 26_000, 149_500), 8, 256, 1 - 640 / 2048, 8)
    assert qwen[1] == 0 and qwen[2] > 0 and 8 <= qwen[8] <= 12, qwen
    assert [t for t, takes in qwen.items() if takes] == list(range(2, 9))  # more tokens, more misses: never fewer
    gptoss = B.host_takes_by_tokens((248_100, 294_900, 26_000, 149_000), 4, 128, 1 - 512 / 1536, 16)
    assert gptoss[1] == 1 and gptoss[16] > gptoss[1], gptoss
    assert B.layer_misses(1, 8, 256, 0.5) == (4, 4)  # one token: its k picks are k distinct experts
    assert B.layer_misses(8, 8, 256, 1.0) == (57, 64)  # 64 picks of 256: ~57 distinct


def test_the_guard_samples_only_the_steps_the_share_covers():
    """A step of fewer tokens than the share's min_tokens ran without it: it is no sample of the share on or off."""
    from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare

    seen = []
    guard = SimpleNamespace(decisions=[], step=lambda now, tokens: seen.append(tokens) or False)
    share = SimpleNamespace(guard=guard, min_tokens=2)
    share.covers = lambda tokens: HostDecodeShare.covers(share, tokens)
    for tokens in (1, 2, 8, None, 1):
        HostDecodeShare.observe_step(share, 0.0, tokens)
    assert seen == [None, 2, 8, None, None]
