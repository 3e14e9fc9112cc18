"""The responses an api replica keeps for `previous_response_id` and GET /v1/responses/{id}: each
response object with the conversation it ends (the input items of every turn before it, and its own
output), in memory, for the replica's lifetime.

Bounded so no client can grow it without limit: at most `max_count` responses and `max_bytes` bytes
(their JSON encoding, which is what is kept), the least recently used dropped first; a response
larger than `max_bytes` on its own is not kept. A follow-up naming a dropped (or never kept) response
is a 404 naming previous_response_id. Each replica has its own store: with several api replicas a
follow-up must reach the replica that answered (README).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from ferry.services.api.responses_schema import InputItem

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 1024 * 1024


@dataclass
class Stored:
    response: dict
    conversation: list[InputItem]


class ResponseStore:
    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[InputItem]) -> bool:
        """Keep `response` (by its id) with its conversation; False when it alone is over max_bytes."""
        entry = (msgspec.json.encode(response), msgspec.json.encode(conversation))
        size = len(entry[0]) + len(entry[1])
        self.pop(response["id"])
        if size > self.max_bytes:
            return False
        while self._entries and (len(self._entries) >= self.max_count or self.bytes + size > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response["id"]] = entry
        self.bytes += size
        return True

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return Stored(msgspec.json.decode(entry[0]), msgspec.json.decode(entry[1], type=list[InputItem]))

    def pop(self, response_id: str) -> bool:
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        response, conversation = self._entries.pop(response_id)
        self.bytes -= len(response) + len(conversation)
