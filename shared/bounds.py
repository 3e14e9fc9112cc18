"""Integer ranges every decoder enforces (msgspec constraints), so a number that cannot cross the wire
or fit the arrays it ends up in is refused where it enters, naming its field, instead of failing later
(an OverflowError while encoding, a MemoryError while allocating)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]  # any integer an int64 holds (request fields)
Id = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # request and step ids: int64 arrays carry them
Count32 = Annotated[int, Meta(ge=0, le=INT32_MAX)]  # sizes that index int32 arrays (pages, slots, positions)
Positive32 = Annotated[int, Meta(ge=1, le=INT32_MAX)]
