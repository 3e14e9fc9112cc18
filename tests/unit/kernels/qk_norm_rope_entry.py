"""Child-process entry for test_kernel_qk_norm_rope.py (run by interpreted_triton.run_interpreted):
the kernel writes the KV caches in place, so they are returned alongside q to cross back."""

from ferry.kernels.qk_norm_rope import qk_norm_rope_kv_triton


def run_and_return_caches(*args, **kwargs):
    q = qk_norm_rope_kv_triton(*args, **kwargs)
    return q, args[11], args[12]


def run_and_return_caches_and_scales(*args, **kwargs):
    """As above, for an fp8 pool: the scales are written in place too."""
    q = qk_norm_rope_kv_triton(*args, **kwargs)
    return q, args[11], args[12], kwargs["k_scale"], kwargs["v_scale"]
