"""GPT-2's byte -> printable character table, in which byte-level BPE vocabularies are written
(Qwen's among them): the tiny tokenizers are built with it, and the api reads tokens' exact bytes
back through its inverse. No torch, no tokenizers: plain Python."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """{byte: the character that stands for it}: printable latin-1 bytes map to themselves, the
    other 68 to code points from 256 on, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The inverse: {character: the byte it stands for}."""
    return {c: b for b, c in bytes_to_unicode().items()}
