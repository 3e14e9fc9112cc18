"""The decode hand-off's moves through mapped pinned memory (kernels/host_share_rows.py) against their torch
twins under the Triton interpreter, in a child process (interpreted_triton.py): the staged pair block and
input rows byte for byte, and the fold's rows bit for bit (one float32 add a first row, after the zeroing)."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.host_share_rows import (
    fold_host_sum,
    fold_host_sum_reference,
    stage_for_host,
    stage_for_host_reference,
)

# (T rows staged of a buffer of max_tokens, H, dtype, block bytes): one row, several, a width past one block, and
# a block and rows past what the grid moves in one pass (8 programs x 1,024 words): each program strides on
STAGE_CASES = [
    (1, 4, 256, torch.bfloat16, 176),
    (3, 8, 2048, torch.bfloat16, 1312),
    (5, 5, 1000, torch.float32, 96),
    (5, 8, 4096, torch.bfloat16, 40000),
]
# (T, k, H, rows dtype): the decode path's float32 rows, and bf16 rows rounded once by the add
FOLD_CASES = [
    (1, 8, 256, torch.float32),
    (4, 8, 2048, torch.float32),
    (3, 2, 1500, torch.float32),
    (2, 4, 1100, torch.bfloat16),
]


def _stage_inputs(i, t, max_tokens, hidden, dtype, nbytes):
    g = torch.Generator().manual_seed(i)
    block = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.int32).to(torch.uint8)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    return block, torch.zeros(nbytes, dtype=torch.uint8), x, torch.full((max_tokens, hidden), 7.0, dtype=dtype)


@pytest.fixture(scope="module")
def stage_runs():
    calls = [(_stage_inputs(i, *case), {}) for i, case in enumerate(STAGE_CASES)]
    return list(
        zip([c[0] for c in calls], run_interpreted("ferry.kernels.host_share_rows", "stage_for_host_triton", calls))
    )


@pytest.mark.parametrize("index", range(len(STAGE_CASES)))
def test_staging_writes_the_block_and_the_rows_and_nothing_past_them(stage_runs, index):
    (block, block_host, x, x_host), (got_block, got_x) = stage_runs[index]
    want_block, want_x = stage_for_host_reference(block, block_host.clone(), x, x_host.clone())
    assert torch.equal(got_block, want_block) and torch.equal(got_block, block)
    assert torch.equal(
        got_x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
        want_x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
    )
    assert (got_x[x.shape[0] :] == 7.0).all()  # rows past the step's are left as they were


def _fold_inputs(i, t, k, hidden, dtype):
    g = torch.Generator().manual_seed(100 + i)
    rows = torch.randn(t, k, hidden, generator=g).to(dtype)
    flags = (torch.rand(t * k + 3, generator=g) < 0.4).to(torch.int8)
    flags[0] = 1  # a host pair in a token's first row: zeroed, then the sum added
    flags[k] = 0
    host_sum = torch.randn(t + 2, hidden, generator=g)
    return rows, flags, host_sum


@pytest.fixture(scope="module")
def fold_runs():
    calls = [(_fold_inputs(i, *case), {}) for i, case in enumerate(FOLD_CASES)]
    return list(
        zip([c[0] for c in calls], run_interpreted("ferry.kernels.host_share_rows", "fold_host_sum_triton", calls))
    )


@pytest.mark.parametrize("index", range(len(FOLD_CASES)))
def test_the_fold_zeroes_the_host_pairs_and_adds_the_sum_to_first_rows_as_its_twin(fold_runs, index):
    (rows, flags, host_sum), got = fold_runs[index]
    want = fold_host_sum_reference(rows.clone(), flags, host_sum)
    if rows.dtype == torch.bfloat16:  # the interpreter rounds float32 -> bf16 toward zero, the GPU and torch
        want_trunc = rows.clone().float()  # to nearest: compare with the twin's float32 result truncated
        fold_host_sum_reference(want_trunc, flags, host_sum)
        trunc = (want_trunc.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        first = torch.equal(got[:, 0], trunc[:, 0]) or torch.equal(got[:, 0], want[:, 0])
        assert first and torch.equal(got[:, 1:], want[:, 1:])
    else:
        assert torch.equal(got, want)
    t, k = rows.shape[:2]
    flagged = flags[: t * k].view(t, k).bool()
    assert (got[:, 1:][flagged[:, 1:]] == 0).all() and torch.equal(
        got[:, 1:][~flagged[:, 1:]], rows[:, 1:][~flagged[:, 1:]]
    )


def test_mismatched_buffers_are_refused_with_their_shapes():
    block, block_host, x, x_host = _stage_inputs(0, 3, 2, 64, torch.bfloat16, 96)
    with pytest.raises(ValueError, match="buffers of"):
        stage_for_host(block, block_host, x, x_host)  # 3 rows into a buffer of 2
    with pytest.raises(ValueError, match="torch.bfloat16 into torch.uint8 and torch.float32"):
        stage_for_host(block, block_host, x[:2], x_host.float())
    rows, flags, host_sum = _fold_inputs(0, 2, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="contiguous: False"):
        fold_host_sum(rows.transpose(0, 1), flags, host_sum)
    with pytest.raises(ValueError, match="float32"):
        fold_host_sum(rows, flags, host_sum.double())
    with pytest.raises(ValueError, match="int8, not torch.int32"):
        fold_host_sum(rows, flags.to(torch.int32), host_sum)
    odd = torch.zeros(1, 63, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a row of 63 x 2 bytes"):
        stage_for_host(block, block_host, odd, torch.zeros(2, 63, dtype=torch.bfloat16))


def test_on_cpu_the_dispatch_takes_the_twins():
    rows, flags, host_sum = _fold_inputs(1, 3, 4, 64, torch.float32)
    got = rows.clone()
    fold_host_sum(got, flags, host_sum)
    assert torch.equal(got, fold_host_sum_reference(rows.clone(), flags, host_sum))
    block, block_host, x, x_host = _stage_inputs(1, 2, 4, 64, torch.float32, 32)
    stage_for_host(block, block_host, x, x_host)
    assert torch.equal(block_host, block) and torch.equal(x_host[:2], x)
