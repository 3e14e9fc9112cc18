"""Experts partitioned across ranks (expert_parallel.py, issue 26): two and three gloo ranks on CPU, each
offloading its own experts, give the all-resident store's output on the same routing, every rank the
same; and the store's checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


# a world size's cases run one after another in the same rank processes (expert_parallel_rank.py): 6 experts a
# layer split evenly between 2 ranks, 7 unevenly
@pytest.mark.parametrize("world, experts", [(2, [6, 7]), (3, [8])], ids=["2-ranks-even-and-uneven", "3-ranks"])
def test_ranks_offloading_their_own_experts_sum_to_the_all_resident_output(world, experts, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    script = str(Path(__file__).with_name("expert_parallel_rank.py"))
    rendezvous = tmp_path / "rendezvous"
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), str(world), str(rendezvous), ",".join(map(str, experts))],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    lines = []  # per rank: its JSON line of each case, in order
    for p in procs:
        out, err = p.communicate(timeout=120 * len(experts))
        assert p.returncode == 0, err[-3000:]
        lines.append([json.loads(line) for line in out.strip().splitlines() if line.startswith("{")])
    for case, count in enumerate(experts):
        results = [rank_lines[case] for rank_lines in lines]
        assert [r["experts"] for r in results] == [count] * world
        assert [r["rank"] for r in results] == list(range(world))
        assert all(r["max_diff"] < 1e-5 for r in results), results  # float32: a single store's sum up to its order
        assert len({r["digest"] for r in results}) == 1  # every rank goes on with the same hidden states
        assert all(r["misses"] > 0 for r in results)  # each rank fetched its own misses


def test_a_local_store_of_the_wrong_size_or_a_rank_outside_the_group_is_refused():
    from ferry.services.worker.offload.stores.expert_parallel import ExpertParallelExperts, owned_count

    class Store:
        num_experts = 3

    assert [owned_count(7, r, 2) for r in (0, 1)] == [4, 3]
    with pytest.raises(ValueError, match="owns 4 of 7 experts a layer; its store has 3"):
        ExpertParallelExperts(Store(), 0, 2, 7)
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        ExpertParallelExperts(Store(), 2, 2, 6)
