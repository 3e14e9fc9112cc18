"""Rogue and raw ZeroMQ peers for the trust-boundary tests: they speak the wire's framing (or try to)
without being a real api or worker. Loopback and ipc addresses only."""

from __future__ import annotations

import time

import zmq

from ferry.shared.messages import SchedulerToApi
from ferry.shared.wire import Codec


def peer(
    kind: int, addr: str, identity: bytes | None = None, keys: tuple[bytes, bytes, bytes] | None = None
) -> zmq.Socket:
    """A socket of `kind` connected to `addr`; `keys`: (public, secret, server public) for CURVE."""
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = keys
    s.connect(addr)
    return s


def send(sock: zmq.Socket, msg) -> bool:
    """False when the message could not even be queued (no connection got through)."""
    try:
        sock.send_multipart(Codec(None).encode(msg), copy=False, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def replies(sock: zmq.Socket, seconds: float) -> list:
    """Every SchedulerToApi message that arrives within `seconds` (undecodable ones as None)."""
    codec, out, deadline = Codec(SchedulerToApi), [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            frames = sock.recv_multipart()
            try:
                out.append(codec.decode(frames))
            except Exception:  # noqa: BLE001
                out.append(None)
    return out
