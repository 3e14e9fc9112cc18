"""The type of every TCP port flag: a number in 1..65535. A number outside is no port: bind() refuses it,
or a conversion on the way wraps it and the server listens elsewhere (`--port 99999` listened on a random
port), so it is refused where it is parsed, argparse naming the flag."""

from __future__ import annotations

import argparse

MAX_PORT = 65535


def port_number(text: str) -> int:
    """argparse type: a port in 1..65535 (0, "any free port", is no port a user can reach)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"expected a port number in 1..{MAX_PORT}, got {text!r}")
    return port
