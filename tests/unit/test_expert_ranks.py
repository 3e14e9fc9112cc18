"""The expert-parallel worker's checks that need no second process (services/worker/expert_ranks.py): every
rank must plan the same pools, the ranks need a device each, and a rank whose boot failed leaves the group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ferry.services.worker import expert_ranks as R
from ferry.shared.errors import ConfigError


def plan(pages: int, prefill: int = 256):
    return SimpleNamespace(
        kv=SimpleNamespace(pages=pages, page_size=16),
        linear_state=SimpleNamespace(slots=4),
        linear_state_snapshots=SimpleNamespace(snapshots=8),
        max_running_requests=4,
        max_prefill_tokens=prefill,
        max_model_len=256,
    )


def gathered(*plans):
    def all_gather_object(out, mine, group=None):
        out[:] = [R.plan_figures(p) for p in plans]

    return all_gather_object


def test_ranks_that_planned_the_same_pools_pass(monkeypatch):
    monkeypatch.setattr(R.dist, "all_gather_object", gathered(plan(64), plan(64)))
    R.check_same_plans(R.RankGroup(0, 2, None, []), plan(64))


def test_ranks_that_planned_different_pools_fail_naming_what_differs_and_the_flags(monkeypatch):
    monkeypatch.setattr(R.dist, "all_gather_object", gathered(plan(64), plan(60, prefill=128)))
    with pytest.raises(ConfigError, match=r"planned different pools \(kv pages, max prefill tokens: .*--num-pages"):
        R.check_same_plans(R.RankGroup(1, 2, None, []), plan(60, prefill=128))


def test_a_single_gpu_named_for_several_ranks_is_refused():
    with pytest.raises(ConfigError, match="--device cuda:1 with --expert-parallel-size 2"):
        R.check_rank_devices("cuda:1", 2)
    R.check_rank_devices("cpu", 4)  # CPU ranks share the host


def test_a_rank_whose_boot_failed_leaves_its_group(tmp_path):
    """leave_group ends a live group (a one-rank gloo group here) and is a no-op without one."""
    import torch

    R.init_group(0, 1, str(tmp_path / "rendezvous"), torch.device("cpu"))
    assert R.dist.is_initialized()
    R.leave_group()
    assert not R.dist.is_initialized()
    R.leave_group()  # nothing to leave: no error
