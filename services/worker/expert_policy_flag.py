"""`--expert-policy`, shared by `ferry worker`, `ferry serve` and `ferry generate`. Torch-free, so
commands that only forward flags (serve) can define it without importing the worker."""

from __future__ import annotations

import argparse

EXPERT_POLICIES = ("lfu", "lru")  # the names offload/build.py's POLICIES maps to classes
DEFAULT_EXPERT_POLICY = "lfu"

EXPERT_POLICY_HELP = (
    "replacement policy of the GPU expert cache when experts are offloaded (default lfu): decode visits "
    "the layers in a cycle, so once a step routes to more experts than there are slots, LRU evicts exactly "
    "the experts the next layers need and its hit rate collapses, where LFU keeps the often-routed ones"
)


def add_expert_policy_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-policy", choices=EXPERT_POLICIES, default=DEFAULT_EXPERT_POLICY,
                        help=EXPERT_POLICY_HELP)  # fmt: skip
