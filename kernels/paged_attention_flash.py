"""A prefill's long queries through FlashAttention (torch's SDPA flash backend), their K/V gathered from the pages.

Measured by bench/prefill_attention.py at the served hybrids' shape (16 query
heads, 2 kv heads, head_dim 256), an 8,192-token chunk ran 275-310 TFLOPS through SDPA's FlashAttention
backend against 193-208 for the paged Triton kernel (kernels/paged_attention_triton.py), at every context
from 0 to 254k keys: at 254k, 111.8 ms against 179.0 a layer, ten layers a chunk, 32 chunks for a 262k
prompt. FlashAttention reads keys from one dense tensor, so each long request's K/V are gathered from its
pages first: one layer's K/V at max_model_len, which the plan prices with the activation workspace
(services/worker/workspace_profile.py adds it to the profiled peak; plan/costs.py to the estimate).

Short queries (decode rows, a few tokens of a mixed step) stay on the paged kernel, whose blocks list
only their requests: gathering a context for a handful of queries would cost more than it saves.
The causal mask is FlashAttention's bottom-right alignment (`causal_lower_right`): query i of a
request with c cached tokens sees keys 0..c+i, as the reference twin and the paged kernel do.
The backend is forced (not SDPA's choice), so a shape it cannot take fails loudly instead of
falling back to the math backend, whose [L, S] score matrix a long context cannot afford;
`flash_available` keeps such shapes on the paged kernel before any call."""

from __future__ import annotations

import torch

from ferry.kernels.paged_attention_reference import gather_request_kv

# a request with at least this many new tokens in a prefill step takes FlashAttention: a quarter of a
# 512-token minimum prefill chunk, far above a mixed step's decode rows (1 token) and small tails
FLASH_MIN_QUERY_TOKENS = 128
_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """FlashAttention takes this step's queries: CUDA sm80+, half precision (the cache's too, or fp8, which
    the gather dequantizes to q's dtype), head_dim a multiple of 8 up to 256."""
    kv_heads = k_cache.shape[2]
    if not q.is_cuda or q.dtype not in _FLASH_DTYPES or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256 or q.shape[1] % kv_heads:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def flash_requests(query_lens: list[int], min_tokens: int = FLASH_MIN_QUERY_TOKENS) -> list[int]:
    """The requests of a step whose new tokens go through FlashAttention."""
    return [r for r, n in enumerate(query_lens) if n >= min_tokens]


def flash_params(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The SDPA parameters FlashAttention is asked about for a lower-right causal call: those
    `torch.nn.attention.bias.CausalBias` asks with (no mask, is_causal False, grouped-query heads), since
    that is the check SDPA itself makes before it runs flash with its lower-right mask."""
    from torch.backends.cuda import SDPAParams

    return SDPAParams(query, key, value, None, 0.0, False, True)


def flash_prefill_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    first_row: int,
    query_len: int,
    context_len: int,
    scale: float,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Request rows out[first_row : first_row + query_len] (q's layout [T, heads, head_dim]): its new
    tokens attend to its `context_len` cached keys and causally to each other, read through `pages`
    (its page-table row; the new tokens' K/V are written there already). The K/V are gathered into
    `buffers` ([pages, page_size, kv_heads, head_dim] each, pools.KvTensorPool.gather_buffers) where
    they hold them, else into fresh tensors; an fp8 pool's (with `k_scale`/`v_scale`) are dequantized to q's
    dtype as they are gathered (kernels/kv_gather_triton.py), so the buffers are the same bytes as for a pool
    of the model dtype. False, with nothing written, where FlashAttention refuses these tensors (the
    caller's paged kernel takes them)."""
    from torch.backends.cuda import can_use_flash_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    total = context_len + query_len
    rows = slice(first_row, first_row + query_len)
    # [1, heads, L, D] views of [L, heads, D] rows: FlashAttention runs on the [B, L, H, D] layout, so no copy
    query = q[rows].unsqueeze(0).transpose(1, 2)
    if k_scale is None:
        key = gather_request_kv(k_cache, pages, total, buffers[0] if buffers else None)
        value = gather_request_kv(v_cache, pages, total, buffers[1] if buffers else None)
    else:
        from ferry.kernels.kv_gather_triton import gather_dequantize_kv_triton

        key = gather_dequantize_kv_triton(k_cache, k_scale, pages, total, q.dtype, buffers[0] if buffers else None)
        value = gather_dequantize_kv_triton(v_cache, v_scale, pages, total, q.dtype, buffers[1] if buffers else None)
    key, value = key.unsqueeze(0).transpose(1, 2), value.unsqueeze(0).transpose(1, 2)
    # asked before the call, as the causal bias asks it: where flash refuses, SDPA's causal-bias path would
    # build the [L, S] mask. Not is_causal=True: flash refuses that flag whenever L != S (top-left causal is
    # not lower-right), which turned every chunk after a prompt's first to the paged kernel
    if not can_use_flash_attention(flash_params(query, key, value)):
        return False
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        result = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(query_len, total), scale=scale, enable_gqa=True
        )
    out[rows] = result[0].transpose(0, 1)
    return True
