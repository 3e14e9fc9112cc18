"""Child-process entry for test_kernel_paged_attention.py's fp8 gather test (run by
interpreted_triton.run_interpreted): the kernel writes the buffer in place, so it is returned beside the rows."""

from ferry.kernels.kv_gather_triton import gather_dequantize_kv_triton


def gather_and_return_buffer(cache, scales, pages, length, dtype, into):
    return gather_dequantize_kv_triton(cache, scales, pages, length, dtype, into), into
