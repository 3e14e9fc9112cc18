"""Speculative decoding's shared rules: the flags' values, which requests may speculate, and how far a
verified row's computation stands once its drafts are judged. No torch.

A drafting row (shared/step.py, `StepBatch.draft_lens`) carries the request's last token and d draft tokens
after it; the worker scores all d + 1 positions in one forward, accepts a prefix of a drafts and adds one
token of its own (the target's choice where the first draft failed, or the bonus after all d), so the row
produces a + 1 tokens (`StepOutput.accepted_drafts`). Both sides then agree, by `computed_after_verify`, on
the positions whose K/V (and linear state) stand for the request's real tokens.

The scheduler drafts (it holds every request's tokens), the worker verifies (it holds the logits). A request
speculates only where its sampling is exact under the verify rule and nothing reads each token on the host
as it is drawn (`speculates`); the others decode one token a step, as without speculation.
"""

from __future__ import annotations

from ferry.shared.sampling import SamplingParams

SPECULATIVE_METHODS = ("off", "ngram")
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 16  # a verify row is a short prefill chunk; past this a miss wastes more than a hit saves
# n-gram sizes prompt lookup matches, longest first (vLLM's prompt_lookup_min/max): one token alone matches
# too often to be worth a verify row's extra positions, past four a match is rarely longer.
NGRAM_MIN = 2
NGRAM_MAX = 4


def speculates(p: SamplingParams) -> bool:
    """Whether a request with these parameters may be given drafts. Not one whose drawing reads its own
    output on the worker's host (penalties, a grammar: each draft would have to be recorded before the next
    position's logits are processed), nor one that asks for logprobs (one entry a sampled token), nor a
    seeded one (its tokens must be the same as without speculation, noise draw for noise draw)."""
    return not p.reads_its_output and p.logprobs is None and p.seed is None


def computed_after_verify(context: int, query_len: int, drafts: int, accepted: int, hybrid: bool) -> int:
    """Tokens whose K/V (and, for a hybrid model, linear state) stand for the request's sequence after a
    drafting row of `query_len` tokens from position `context`, its last `drafts` of them drafts, of which the
    first `accepted` were kept. The positions up to the last accepted draft hold real tokens; the token the
    verify added is not computed yet. A hybrid's linear state cannot drop positions: unless every draft was
    kept the worker puts back the state the row started from (executor), so nothing of the row counts as
    computed and the kept tokens are computed again with the next row."""
    if hybrid and accepted < drafts:
        return context
    return context + query_len - drafts + accepted


def speculation_problems(method: str, tokens: int) -> list[str]:
    """What is wrong with --speculative-method / --speculative-tokens, each message naming the flag."""
    problems = []
    if method == "mtp":  # the MTP head loads and computes (services/worker/models/mtp_head.py); no step drafts yet
        problems.append(
            "--speculative-method mtp is not wired into decoding yet (the MTP layer loads but drafts nothing); "
            f"use one of {', '.join(SPECULATIVE_METHODS)}"
        )
    elif method not in SPECULATIVE_METHODS:
        problems.append(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
        problems.append(f"--speculative-tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {tokens}")
    return problems
