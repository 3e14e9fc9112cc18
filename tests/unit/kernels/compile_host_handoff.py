"""The decode layer's hand-off to the host (kernels/expert_host_handoff.py), with the router's weights in
both dtypes, and the expert cache's lookup whose outputs it rewrites (kernels/expert_cache_lookup.py, in
its three modes, the prefetch with and without the host's share, and two policies), compiled for Hopper without a GPU
(hopper_compile.py; run by test_host_handoff_compile.py)."""

from __future__ import annotations

from hopper_compile import print_results

from ferry.kernels.expert_cache_lookup import _expert_cache_kernel
from ferry.kernels.expert_host_handoff import _hand_to_host_kernel


def signatures(dtype: str) -> list:
    sig = {
        "ids_ptr": "*i64",
        "weights_ptr": f"*{dtype}",
        "n_rows_ptr": "*i32",
        "miss_slots_ptr": "*i32",
        "list_ptr": "*i32",
        "count_ptr": "*i32",
        "in_flight_ptr": "*i32",
        "slot_of_ptr": "*i32",
        "layer_of_slot_ptr": "*i32",
        "expert_of_slot_ptr": "*i32",
        "expert_flags_ptr": "*i8",
        "evicted_ptr": "*i32",
        "evicted_stamp_ptr": "*i64",
        "stamp_ptr": "*i64",
        "counters_ptr": "*i64",
        "host_pairs_ptr": "*i8",
        "pair_token_ptr": "*i64",
        "pair_expert_ptr": "*i64",
        "pair_weight_ptr": "*fp32",
        "meta_ptr": "*i64",
        "totals_ptr": "*i64",
        "costs_ptr": "*i64",
        "T": "i32",
        "K": "i32",
        "E": "i32",
        "layer": "i32",
    }
    # the served models: 128 experts (Qwen3-30B-A3B) and 512 (Qwen3-Next, Qwen3.5/3.6's largest)
    out = [
        (f"hand_to_host[{dtype}, E={e}]", _hand_to_host_kernel, sig, {"BLOCK_E": e, "BLOCK_P": 256}) for e in (128, 512)
    ]
    if dtype == "bf16":  # the lookup has no dtype: once
        out.extend(lookup_signatures())
    return out


def lookup_signatures() -> list:
    i32 = (
        "slot_of_ptr",
        "layer_of_slot_ptr",
        "expert_of_slot_ptr",
        "assign_ptr",
        "hit_slots_ptr",
        "miss_slots_ptr",
        "list_ptr",
        "count_ptr",
        "guard_hits_ptr",
        "guard_misses_ptr",
        "evicted_ptr",
        "n_rows_ptr",
    )
    sig = {
        "ids_ptr": "*i64",
        **{n: "*i32" for n in i32},
        "requests_ptr": "*fp32",
        "stamp_ptr": "*i64",
        "prefetched_ptr": "*i8",
        "clock_ptr": "*i64",
        "counters_ptr": "*i64",
        "flags_ptr": "*i8",
        "protect_ptr": "*i8",
        "evicted_stamp_ptr": "*i64",
        "host_costs_ptr": "*i64",
        **{n: "i32" for n in ("T", "K", "layer", "E", "S", "half_life", "num_layers", "evict_below")},
    }
    out = []
    for mode, host in ((0, False), (1, False), (1, True), (2, False)):  # a prefetch with or without the host's share
        for policy in (0, 1):
            # the launcher's shape for up to 16K slots (expert_cache_lookup.launch)
            consts = {
                "MODE": mode,
                "POLICY": policy,
                "HAS_GUARD": mode == 1,
                "HAS_HOST": host,
                "BLOCK_E": 128,
                "NUM_TILES": 4,
                "TILE": 4096,
                "BLOCK_P": 256,
            }
            out.append(
                (
                    f"expert_cache_lookup[mode={mode}, policy={policy}, host={host}]",
                    _expert_cache_kernel,
                    sig,
                    consts,
                    {"num_warps": 16},
                )
            )
    return out


if __name__ == "__main__":
    print_results(signatures)
