"""The Gated DeltaNet prefill's conv kernels (kernels/causal_conv1d.py) compiled on a real GPU against their
torch twin, which runs torch's CUDA conv here (skipped without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_kernel_causal_conv1d import PREFILL_CASES, _prefill_case  # noqa: E402

from ferry.kernels.causal_conv1d import causal_conv1d_varlen  # noqa: E402
from ferry.kernels.causal_conv1d_reference import causal_conv1d_varlen_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# the served hybrids' conv (Qwen3.5/3.6-35B-A3B: 8,192 channels, kernel 4) over a prefill step's requests:
# a whole 8,192-token chunk, a prompt's tail, decode rows and requests shorter than the state
SERVED = [([8192], 4), ([300, 1, 2, 4000, 33], 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,kernel", PREFILL_CASES + SERVED)
def test_prefill_conv_matches_its_twin_on_cuda(query_lens, kernel, dtype):
    channels = 8192 if (query_lens, kernel) in SERVED else 136
    x, states, slots, start, weight = _prefill_case(len(query_lens), query_lens, channels, kernel, dtype, dtype)
    states, slots, start, weight = (t.cuda() for t in (states, slots, start, weight))
    wide = torch.zeros(x.shape[0], channels + 7, dtype=dtype, device="cuda")  # .cuda() of a view is contiguous:
    wide[:, 3 : 3 + channels] = x.cuda()  # rows strided as in_proj's q/k/v are (row stride != channels)
    x = wide[:, 3 : 3 + channels]
    want_states = states.clone()
    want = causal_conv1d_varlen_reference(x, want_states, slots.tolist(), query_lens, weight)
    got = causal_conv1d_varlen(x, states, slots.tolist(), query_lens, weight, slots_on_device=slots, query_start=start)
    # float32: summation order only; bf16: one rounding of the sum apart at most
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(states, want_states, equal_nan=True, rtol=0, atol=0)
