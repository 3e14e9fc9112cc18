"""msgspec over ZeroMQ: one typed codec per socket, large numpy arrays as extra zero-copy frames.

A message is frame 0 (msgpack of the tagged struct) followed by one frame per large numpy array in
it. In frame 0 a large array is written as [frame_index, dtype, shape], and decoding maps it back
onto the received buffer without a copy. An array under INLINE_ARRAY_BYTES is written into frame 0
itself as [dtype, shape, bytes] (msgpack bin). Each frame of a message costs latency on both sides,
and copying a few KiB costs less: a decode step's RunStep, ten small arrays, went from one process
to the next in 0.27 ms as eleven frames and in 0.20 ms as one (bench/wire_hop.py times a hop).
A frame's array is a view of the received frame, an inline one owns a copy of its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np
import zmq
import zmq.asyncio

T = TypeVar("T")

ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats: what the contract's arrays hold
# The largest message a receiving socket takes: a peer that sends more is disconnected by ZeroMQ before
# the message is read into memory (the largest real one, a step's page table, is a few MiB).
MAX_MESSAGE_BYTES = 256 * 2**20
INLINE_ARRAY_BYTES = 64 * 2**10  # smaller arrays ride inside frame 0


class Codec(Generic[T]):
    """Encodes any message, decodes exactly the union `decode_type` (anything else is a WireError).
    A send-only socket (PUSH) passes decode_type=None."""

    def __init__(self, decode_type: Any):
        self._arrays: list[np.ndarray] = []
        self._frames: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = None if decode_type is None else msgspec.msgpack.Decoder(decode_type, dec_hook=self._dec_hook)

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            if arr.nbytes < INLINE_ARRAY_BYTES:
                return [arr.dtype.str, list(arr.shape), arr.tobytes()]
            self._arrays.append(arr)
            return [len(self._arrays), arr.dtype.str, list(arr.shape)]
        raise NotImplementedError(f"cannot send a {type(obj).__name__} over the wire")

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        if typ is np.ndarray:
            if not isinstance(obj, list) or len(obj) != 3:
                raise ValueError(f"an array must be [frame, dtype, shape] or [dtype, shape, bytes], got {obj!r:.80}")
            if isinstance(obj[0], str):  # inline: [dtype, shape, bytes]
                dtype, shape, data = obj
                if not isinstance(data, bytes):
                    raise ValueError("an inline array's data must be bytes")
                # a buffer of its own, writable like an array mapped onto a received frame
                return np.frombuffer(bytearray(data), dtype=_array_dtype(dtype)).reshape(_array_shape(shape))
            index, dtype, shape = obj
            if not isinstance(index, int) or not 1 <= index < len(self._frames):
                raise ValueError(f"an array refers to frame {index!r} of {len(self._frames)}")
            return np.frombuffer(self._frames[index], dtype=_array_dtype(dtype)).reshape(_array_shape(shape))
        raise NotImplementedError(f"cannot decode a {typ!r}")

    def encode(self, msg: Any) -> list[Any]:
        self._arrays = []
        try:
            head = self._encoder.encode(msg)
            return [head, *(memoryview(a).cast("B") if a.size else b"" for a in self._arrays)]
        finally:
            self._arrays = []

    def decode(self, frames: list[Any]) -> T:
        if self._decoder is None:
            raise WireError("this socket only sends")
        self._frames = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        except (msgspec.DecodeError, ValueError, IndexError, TypeError, OverflowError, RecursionError) as exc:
            raise WireError(f"undecodable message: {exc}") from exc
        finally:
            self._frames = []


def _array_dtype(dtype: Any) -> np.dtype:
    if not isinstance(dtype, str):
        raise ValueError(f"an array's dtype must be a string, got {dtype!r:.40}")
    kind = np.dtype(dtype)
    if kind.kind not in ARRAY_KINDS or kind.hasobject or kind.itemsize == 0:
        raise ValueError(f"arrays of dtype {kind} do not cross the wire")
    return kind


def _array_shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"an array's shape must be a list of sizes, got {shape!r:.80}")
    return shape


class WireError(Exception):
    """A peer sent something that is not a message of this socket's union (a bug or a version skew)."""


class PeerWireError(WireError):
    """A WireError on a ROUTER: which peer sent it, and the message's first frame (to answer it)."""

    def __init__(self, message: str, peer: bytes, head: bytes):
        super().__init__(message)
        self.peer, self.head = peer, head


Secure = Callable[[zmq.Socket], None]  # sets a socket's CURVE options before it binds or connects (wire_keys.py)


def _configure(sock: zmq.Socket, secure: Secure | None, receives: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # never block process exit on undeliverable messages
    # a send-only socket reads nothing, so nothing a peer sends it may be large
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES if receives else 1024)
    if secure is not None:
        secure(sock)


class PeerSocket(Generic[T]):
    """A synchronous PUSH, PULL or DEALER socket carrying one union in, anything out."""

    def __init__(
        self,
        ctx: zmq.Context,
        kind: int,
        addr: str,
        decode_type: Any,
        *,
        bind: bool,
        identity: bytes | None = None,
        secure: Secure | None = None,
    ):
        self.sock = ctx.socket(kind)
        _configure(self.sock, secure, decode_type is not None)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self.codec: Codec[T] = Codec(decode_type)

    def send(self, msg: Any, *, block: bool = True) -> bool:
        """False when the message could not be queued without blocking (no peer, or peer too slow)."""
        try:
            self.sock.send_multipart(self.codec.encode(msg), copy=False, flags=0 if block else zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv(self, *, block: bool = True) -> T | None:
        try:
            frames = self.sock.recv_multipart(copy=False, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self.codec.decode(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


class RouterSocket(Generic[T]):
    """The scheduler's ROUTER: messages are addressed by the peer's identity."""

    def __init__(self, ctx: zmq.Context, addr: str, decode_type: Any, secure: Secure | None = None):
        self.sock = ctx.socket(zmq.ROUTER)
        _configure(self.sock, secure, decode_type is not None)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to a gone peer raises instead of vanishing
        # No send limit: dropping a Finished for a slow (but live) replica would hang its client; a dead
        # replica is noticed by its missing heartbeats and its queue goes with it.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(addr)
        self.codec: Codec[T] = Codec(decode_type)

    def send(self, identity: bytes, msg: Any) -> bool:
        """False when that peer is not connected (any more) or cannot take more now."""
        try:
            self.sock.send_multipart([identity, *self.codec.encode(msg)], copy=False, flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def recv(self) -> tuple[bytes, T] | None:
        """(peer, message), or None when nothing is waiting. A message that does not decode raises
        PeerWireError, which names the peer."""
        try:
            frames = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return frames[0].bytes, self.codec.decode(frames[1:])
        except WireError as exc:
            raise PeerWireError(str(exc), frames[0].bytes, frames[1].bytes if len(frames) > 1 else b"") from exc

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncDealer(Generic[T]):
    """An api replica's DEALER to the scheduler, for asyncio code."""

    def __init__(
        self, ctx: zmq.asyncio.Context, addr: str, decode_type: Any, identity: bytes, secure: Secure | None = None
    ):
        self.sock = ctx.socket(zmq.DEALER)
        _configure(self.sock, secure, decode_type is not None)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        # Queue only on a live connection: with the scheduler gone a send fails at once (zmq.Again)
        # instead of piling up messages for whichever scheduler starts next.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # the scheduler's side has no limit either (see RouterSocket)
        self.sock.connect(addr)
        self.codec: Codec[T] = Codec(decode_type)

    async def send(self, msg: Any) -> bool:
        """False when the scheduler is not connected (or not keeping up); nothing is queued then."""
        try:
            await self.sock.send_multipart(self.codec.encode(msg), copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    async def recv(self) -> T:
        frames = await self.sock.recv_multipart(copy=False)
        return self.codec.decode(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
