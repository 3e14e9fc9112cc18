"""Request bodies decoded (schema.decode_body: nesting counted, then msgspec) off the event loop when large.

msgspec holds the GIL while it decodes (it builds Python objects): a 2.6 MB body of schemas takes 0.06
to 0.17 s. On the event loop eight of them in a row stall every other request and stream for a second
or more. A body over LARGE_BODY_BYTES decodes on a thread of its own instead: the event loop runs
between one decode and the next (the thread hands the GIL over when msgspec returns), so an unrelated
request waits for one decode at a time, not for all of them. Counting the nesting (numpy) mostly runs
with the GIL released. A second thread would only contend for the GIL, and a process would send the
objects back pickled, which costs about as much as decoding them. Smaller bodies decode on the loop,
where that takes less than a hop to a thread. At most MAX_LARGE_BODIES wait or decode at once (each
at most --max-body-size); more get a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from ferry.services.api import schema
from ferry.shared.errors import ServiceUnavailable

LARGE_BODY_BYTES = 256 * 1024
MAX_LARGE_BODIES = 16


class DecoderBusy(ServiceUnavailable):
    retry_after = 1


class BodyDecoder:
    def __init__(self) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-decoder")
        self.large = 0  # large bodies waiting or decoding: released when the thread is done with one
        self._lock = threading.Lock()

    async def decode(self, body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
        """schema.decode_body(body, kind): on the loop for a small body, on the decoder's thread for a large one."""
        if len(body) <= LARGE_BODY_BYTES:
            return schema.decode_body(body, kind)
        with self._lock:
            if self.large >= MAX_LARGE_BODIES:
                raise DecoderBusy(f"{self.large} large request bodies are waiting to be decoded; retry shortly")
            self.large += 1
        future = self.thread.submit(schema.decode_body, body, kind)
        future.add_done_callback(self._release)
        try:
            return await asyncio.wrap_future(future)
        finally:
            future.cancel()  # not started yet (the client left): never decoded

    def _release(self, _future: Future) -> None:
        with self._lock:
            self.large -= 1
