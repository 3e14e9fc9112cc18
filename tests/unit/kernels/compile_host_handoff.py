"""The decode layer's hand-off to the host (kernels/expert_host_handoff.py) compiled for Hopper without a
GPU (hopper_compile.py; run by test_host_handoff_compile.py), with the router's weights in both dtypes."""

from __future__ import annotations

from hopper_compile import print_results

from ferry.kernels.expert_host_handoff import _hand_to_host_kernel


def signatures(dtype: str) -> list:
    sig = {"ids_ptr": "*i64", "weights_ptr": f"*{dtype}", "n_rows_ptr": "*i32", "miss_slots_ptr": "*i32",
           "list_ptr": "*i32", "count_ptr": "*i32", "slot_of_ptr": "*i32", "layer_of_slot_ptr": "*i32",
           "expert_of_slot_ptr": "*i32", "expert_flags_ptr": "*i8", "host_pairs_ptr": "*i8",
           "pair_token_ptr": "*i64", "pair_expert_ptr": "*i64", "pair_weight_ptr": "*fp32", "meta_ptr": "*i64",
           "totals_ptr": "*i64", "costs_ptr": "*i64", "T": "i32", "K": "i32", "E": "i32", "layer": "i32"}  # fmt: skip
    # the served models: 128 experts (Qwen3-30B-A3B) and 512 (Qwen3-Next, Qwen3.5/3.6's largest)
    return [(f"hand_to_host[{dtype}, E={e}]", _hand_to_host_kernel, sig, {"BLOCK_E": e, "BLOCK_P": 256})
            for e in (128, 512)]  # fmt: skip


if __name__ == "__main__":
    print_results(signatures)
