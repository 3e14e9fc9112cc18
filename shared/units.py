"""Byte quantities as users write them ("24GiB", "512MB", "1e9") and as we print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")

GiB = 2**30
MiB = 2**20


def parse_bytes(text: str, require_unit: bool = False) -> int:
    """Parse "24GiB", "24 GB", "1.5G" (binary, like llama.cpp) or a plain integer into bytes.

    With `require_unit` a bare number is refused: for a device or host budget "24" (24 bytes) or
    "0.9" (a fraction, which is --memory-ratio's job) is a mistake, never what was meant."""
    match = _PATTERN.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte size; write e.g. 24GiB, 512MiB, 20GB or a number of bytes")
    if require_unit and not match.group(2):
        raise ValueError(f"{text!r} has no unit; write the size with one, e.g. 24GiB, 512MiB or 20GB (24B for bytes)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 0:
        raise ValueError(f"byte size {text!r} is negative")
    return int(value)


def format_bytes(n: int) -> str:
    """Human form with binary units and enough digits to tell plans apart."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def ceil_div(n, d):
    """n / d rounded up, for ints and numpy integer arrays alike (floor division of the negation)."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    return ceil_div(n, multiple) * multiple
