"""Speculative decoding's shared rules: the flags' values, which requests may speculate, and how far a
verified row's computation stands once its drafts are judged. No torch.

A drafting row (shared/step.py, `StepBatch.draft_lens`) carries the request's last token and d draft tokens
after it; the worker scores all d + 1 positions in one forward, accepts a prefix of a drafts and adds one
token of its own (the target's choice where the first draft failed, or the bonus after all d), so the row
produces a + 1 tokens (`StepOutput.accepted_drafts`). Both sides then agree, by `computed_after_verify`, on
the positions whose K/V (and linear state) stand for the request's real tokens.

With `ngram` the scheduler drafts (it holds every request's tokens); with `mtp` the worker drafts with the model's
multi-token-prediction layer after each step (services/worker/mtp_drafts.py) and sends the drafts back with the
step's answer (StepOutput.mtp_drafts), which the scheduler gives the request's next row. The worker verifies (it
holds the logits). A request
speculates only where its sampling is exact under the verify rule and nothing reads each token on the host
as it is drawn (`speculates`); the others decode one token a step, as without speculation.
"""

from __future__ import annotations

from ferry.shared.sampling import SamplingParams

SPECULATIVE_METHODS = ("off", "ngram", "mtp")
SPECULATIVE_METHOD_HELP = (
    "speculative decoding: 'ngram' drafts each decoding request's next tokens from an earlier occurrence of its "
    "last few tokens in its prompt and output (prompt lookup); 'mtp' drafts them with the model's own "
    "multi-token-prediction layer (Qwen3.5/3.6, Qwen3-Next, GLM-4.5/4.6/4.7: its weights and its K/V are planned "
    "beside the target's); both verify the drafts in one forward, keeping the output's distribution exactly "
    "(greedy: the same tokens); requests with penalties, a grammar, logprobs or a seed decode without it; steps "
    "with drafts are not scheduled ahead (on CUDA they replay graphs where a step's rows are one length); how "
    "many drafts a row carries is chosen per step from the request's acceptance and the verify's cost (default "
    "off). FERRY_BENCH_ORACLE_DRAFTS / FERRY_BENCH_RECORD_SEQUENCES are benchmark-only "
    "(bench/speculation_oracle.py) and refused without FERRY_BENCH_ONLY=1"
)
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 16  # a verify row is a short prefill chunk; past this a miss wastes more than a hit saves
SPECULATIVE_TOKENS_HELP = (
    f"drafts a decoding row carries at most (default {DEFAULT_SPECULATIVE_TOKENS}, at most {MAX_SPECULATIVE_TOKENS})"
)
SPECULATIVE_DRAFT_VOCAB_HELP = (
    "with --speculative-method mtp: the MTP head drafts among the first N token ids only, reading N rows of the LM "
    "head a chain position instead of the whole vocabulary (a 248k-token head is most of a position's bytes); "
    "byte-level BPE and SentencePiece vocabularies number their tokens roughly by frequency, so the first 32,768 "
    "hold most of what is generated (FR-Spec's draft vocabulary, SGLang's --speculative-token-map). A draft the "
    "target would not choose is only refused: the output is the same; a token past N is never drafted. Default 0: "
    "the whole vocabulary"
)
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


# the most tokens a row takes in the decode kernels' short-query path (kernels/paged_attention.py's SHORT_QUERY_TOKENS,
# kernels/gated_delta_rule.py's RECURRENT_MAX_TOKENS), where the worker's verify graphs replay it
SHORT_ROW_TOKENS = 17


def verify_row_tokens(speculative_tokens: int) -> int:
    """The most tokens a drafting row carries, its own and its drafts: the longest verify graph's rows
    (services/worker/verify_graphs.py's `verify_shapes`). A hybrid's row after a refusal computes again the drafts
    it kept (`computed_after_verify`), so refusals in a row lengthen its rows; one longer than this would run
    eagerly, at several times a replay's cost, so it gets fewer drafts."""
    return min(2 * speculative_tokens, SHORT_ROW_TOKENS)


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


def draft_vocab_problems(draft_vocab: int, method: str, vocab_size: int) -> list[str]:
    """What is wrong with --speculative-draft-vocab N for this method and vocabulary, each message naming the flag."""
    if not draft_vocab:
        return []
    if draft_vocab < 0:
        return [
            f"--speculative-draft-vocab must be 0 (the whole vocabulary) or a number of token ids, got {draft_vocab}"
        ]
    problems = []
    if method != "mtp":
        problems.append("--speculative-draft-vocab sizes the MTP head's drafts: give --speculative-method mtp")
    if vocab_size and draft_vocab > vocab_size:
        problems.append(
            f"--speculative-draft-vocab {draft_vocab} is more than the model's {vocab_size} token ids: give at most "
            f"{vocab_size}, or 0 for all of them"
        )
    return problems


def speculation_problems(method: str, tokens: int) -> list[str]:
    """What is wrong with --speculative-method / --speculative-tokens, each message naming the flag."""
    problems = []
    if method not in SPECULATIVE_METHODS:
        problems.append(f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
        problems.append(f"--speculative-tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {tokens}")
    return problems
