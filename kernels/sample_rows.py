"""The last step of sampling, one pass over the vocabulary: per row, the drawn token and its
log-probability. Twin: `sample_rows_reference` (plain torch, every device without Triton).

A row's logits arrive with penalties, logit_bias, the grammar's mask and (for rows that filter)
top-k / top-p / min-p's -inf already applied. Then, with s = logits * inv_temperature:
  token   = argmax(s - log q)    (q the row's Exp(1) noise; greedy rows have none: argmax s)
  logprob = s[token] - logsumexp(s)
A NaN in s (a NaN logit, or an infinite one times a 0 inverse temperature) counts as -inf: never drawn, and a row
with nothing else draws token 0, so the token is always an id of the vocabulary, which the next step (or the MTP head
in a decode graph, on padding rows too) embeds: an id past it would stop the device on an index assert.
The first is the exponential race argmax(p / q) with p = softmax(s), in log space: p / q and
s - log q order the tokens alike, so no softmax is made. Done in torch that is a softmax, a
division, an argmax, a log-softmax and gathers, each a kernel over S x V floats; over a 248k
vocabulary one row's softmax alone took 53 us (a single block reduces the row). Here
each row is split into blocks that reduce in parallel (`_row_blocks_kernel`: a block's max, its sum
of exponentials, its best race entry), and a second kernel folds a row's blocks. Ties go to the
lowest token id, as torch.argmax does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton

BLOCK_V = 4096
# An exact 0 draw would make log(q) -inf and let a masked (-inf) token tie the race: a draw is taken
# as at least the smallest normal float32 (here, so the sampler needs no clamp kernel of its own).
TINY = 1.1754943508222875e-38
_TINY = tl.constexpr(TINY)  # what a Triton kernel may read of a module global


@triton.jit(do_not_specialize=["V", "blocks"])
def _row_blocks_kernel(
    logits_ptr, inv_t_ptr, noise_ptr, noise_row_ptr, part_ptr, V, blocks, stride_l, stride_q, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    inv_t = tl.load(inv_t_ptr + row)
    s = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=float("-inf")) * inv_t
    s = tl.where(s == s, s, float("-inf"))  # NaN: never drawn (the module docstring)
    m = tl.max(s, axis=0)
    # a block with every entry -inf (masked away) contributes nothing; keep its sum 0, not NaN
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.where(ok, tl.exp(s - m_safe), 0.0), axis=0)
    noise_row = tl.load(noise_row_ptr + row).to(tl.int64)
    race = s
    if noise_row >= 0:
        q = tl.load(noise_ptr + noise_row * stride_q + offs, mask=ok, other=1.0)
        race = s - tl.log(tl.maximum(q, _TINY))
    race = tl.where(ok, race, float("-inf"))
    best = tl.max(race, axis=0)
    # the lowest offset that reaches the best (an all -inf block picks its first entry)
    idx = tl.min(tl.where(race == best, offs, V + BLOCK), axis=0)
    out = part_ptr + (row * blocks + blk) * 4
    tl.store(out, m)
    tl.store(out + 1, total)
    tl.store(out + 2, best)
    tl.store(out + 3, idx.to(tl.float32))  # a token id below 2**24 is exact in float32


@triton.jit(do_not_specialize=["blocks"])
def _fold_rows_kernel(logits_ptr, inv_t_ptr, part_ptr, token_ptr, logprob_ptr, blocks, stride_l, BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    ok = b < blocks
    base = part_ptr + (row * blocks + b) * 4
    m = tl.load(base, mask=ok, other=float("-inf"))
    total = tl.load(base + 1, mask=ok, other=0.0)
    best = tl.load(base + 2, mask=ok, other=float("-inf"))
    idx = tl.load(base + 3, mask=ok, other=3.0e38)
    big_m = tl.max(m, axis=0)
    lse = big_m + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, total * tl.exp(m - big_m)), axis=0))
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, idx, 3.0e38), axis=0).to(tl.int64)
    s = tl.load(logits_ptr + row * stride_l + token) * tl.load(inv_t_ptr + row)
    tl.store(token_ptr + row, token)
    tl.store(logprob_ptr + row, s - lse)


def sample_rows_reference(
    logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor | None, noise_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float32 [S, V]; inv_temperature float32 [S]; noise float32 [N, V] (Exp(1) draws, each taken
    as at least TINY) or None;
    noise_rows int64 [S]: the row of `noise` each row races with, -1 for greedy. Returns (token ids
    int64 [S], their log-probabilities float32 [S])."""
    s = logits * inv_temperature[:, None]
    s = torch.where(s.isnan(), float("-inf"), s)  # never drawn (the module docstring)
    race = s
    if noise is not None:
        drawn = noise_rows >= 0
        log_q = torch.zeros_like(s)
        log_q[drawn] = noise[noise_rows[drawn]].clamp_min(TINY).log()
        race = s - log_q
    tokens = race.argmax(dim=-1)
    logprobs = torch.log_softmax(s, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def sample_rows(
    logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor | None, noise_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows_reference`'s contract, in two Triton kernels on CUDA."""
    if not use_triton(logits):
        return sample_rows_reference(logits, inv_temperature, noise, noise_rows)
    return sample_rows_triton(logits, inv_temperature, noise, noise_rows)


def sample_rows_triton(
    logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor | None, noise_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("logits must be float32 with unit-stride rows")
    if vocab >= 1 << 24:
        raise ValueError(f"a vocabulary of {vocab} tokens: ids past 2**24 do not survive the float32 partials")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    blocks = triton.cdiv(vocab, BLOCK_V)
    parts = torch.empty(rows, blocks, 4, dtype=torch.float32, device=logits.device)
    q = noise if noise is not None else logits  # never read: every row is greedy
    _row_blocks_kernel[(rows, blocks)](
        logits, inv_temperature, q, noise_rows, parts, vocab, blocks, logits.stride(0), q.stride(0), BLOCK=BLOCK_V
    )
    _fold_rows_kernel[(rows,)](
        logits,
        inv_temperature,
        parts,
        tokens,
        logprobs,
        blocks,
        logits.stride(0),
        BLOCKS=triton.next_power_of_2(blocks),
    )
    return tokens, logprobs
