"""The one-pass sampling kernels (kernels/sample_rows.py) against their torch twin under the Triton
interpreter (a child process), and the twin against the race it stands for (argmax of p / q)."""

import torch
from interpreted_triton import run_interpreted

from ferry.kernels.sample_rows import BLOCK_V, sample_rows_reference


def _case(seed: int, rows: int, vocab: int, greedy: list[bool], masked: bool = False, zeros: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    if masked:  # a filtered row: most of its tokens -inf, whole blocks of them included
        logits[0, : vocab - 3] = float("-inf")
    inv_t = torch.tensor([1.0 if gr else 1 / 0.7 for gr in greedy])
    drawn = [i for i, gr in enumerate(greedy) if not gr]
    noise = torch.empty(len(drawn), vocab).exponential_(generator=g) if drawn else None
    if zeros:  # exact 0 draws, on masked tokens too: taken as the smallest normal float, never a tie at -inf
        noise[:, :5] = 0.0
    noise_rows = torch.full((rows,), -1, dtype=torch.int64)
    for j, i in enumerate(drawn):
        noise_rows[i] = j
    return logits, inv_t, noise, noise_rows


CASES = [
    _case(0, 3, 2 * BLOCK_V + 17, [True, False, False]),  # a partial last block
    _case(1, 2, BLOCK_V, [False, False], masked=True),
    _case(2, 1, 100, [True]),
    _case(3, 4, 3 * BLOCK_V, [False, True, False, True], masked=True),
    _case(4, 2, 300, [False, False], masked=True, zeros=True),
]


def test_kernels_equal_the_twin():
    results = run_interpreted("ferry.kernels.sample_rows", "sample_rows_triton", [(case, {}) for case in CASES])
    for case, (tokens, logprobs) in zip(CASES, results):
        ref_tokens, ref_logprobs = sample_rows_reference(*case)
        assert torch.equal(tokens, ref_tokens)
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-5), (logprobs, ref_logprobs)
        assert torch.isfinite(logprobs).all()  # never a masked token


def test_twin_is_the_exponential_race_and_ties_go_to_the_lowest_id():
    logits, inv_t, noise, noise_rows = _case(5, 3, 500, [False, False, True])
    tokens, logprobs = sample_rows_reference(logits, inv_t, noise, noise_rows)
    probs = torch.softmax(logits[:2] * inv_t[:2, None], -1)
    assert torch.equal(tokens[:2], (probs / noise).argmax(-1))
    assert int(tokens[2]) == int(logits[2].argmax())
    assert torch.allclose(logprobs, torch.log_softmax(logits * inv_t[:, None], -1).gather(1, tokens[:, None])[:, 0])
    tied = torch.zeros(1, 50)
    tied[0, [7, 30]] = 1.0
    (tok,), _ = run_interpreted(
        "ferry.kernels.sample_rows", "sample_rows_triton", [((tied, torch.ones(1), None, torch.tensor([-1])), {})]
    )[0]
    assert int(tok) == 7 == int(sample_rows_reference(tied, torch.ones(1), None, torch.tensor([-1]))[0])


def test_a_nan_is_never_drawn_and_a_row_of_nothing_else_draws_token_0():
    """A row of NaN logits (a broken model's, or a decode graph's padding row whose state overflowed), an infinite
    logit times a 0 inverse temperature, and a NaN among finite logits: the token is an id of the vocabulary, the NaN
    never the one drawn, the kernels as their twin. An id past the vocabulary made the MTP head's embedding of a
    padding row's sample stop the device on an index assert."""
    vocab = 2 * BLOCK_V + 17
    g = torch.Generator().manual_seed(6)
    some_nan = torch.randn(2, vocab, generator=g)
    some_nan[:, [3, BLOCK_V + 1]] = float("nan")
    some_nan[:, BLOCK_V + 1] = float("nan")
    noise = torch.empty(1, vocab).exponential_(generator=g)
    cases = [
        (torch.full((1, vocab), float("nan")), torch.ones(1), None, torch.tensor([-1])),
        (torch.full((2, vocab), float("inf")), torch.zeros(2), noise, torch.tensor([-1, 0])),
        (some_nan, torch.ones(2), noise, torch.tensor([-1, 0])),
    ]
    results = run_interpreted("ferry.kernels.sample_rows", "sample_rows_triton", [(case, {}) for case in cases])
    for case, (tokens, _) in zip(cases, results):
        ref_tokens, _ = sample_rows_reference(*case)
        assert torch.equal(tokens, ref_tokens)
        assert ((tokens >= 0) & (tokens < vocab)).all()
    assert results[0][0].tolist() == [0] and results[1][0].tolist() == [0, 0]
    drawn = results[2][0]
    assert not some_nan.gather(1, drawn[:, None]).isnan().any()
    assert int(drawn[0]) == int(torch.where(some_nan[0].isnan(), float("-inf"), some_nan[0]).argmax())
