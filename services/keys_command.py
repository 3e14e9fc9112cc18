"""`ferry keys DIR`: the CURVE key pairs of the tcp layout (shared/wire_keys.py), one per role.

Give DIR to every process as --wire-keys DIR (FERRY_WIRE_KEYS), or mount its files into compose as
secrets (compose.yaml): each service needs its own ROLE.key_secret and scheduler.key; the scheduler
also needs api.key and worker.key. Existing keys are never overwritten."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ferry.shared.errors import ConfigError

# The keys written with the image, as the host user, straight into the directory compose reads them from
DOCKER_KEYS_COMMAND = (
    'mkdir -p keys && docker run --rm -u "$(id -u):$(id -g)" -v "$PWD/keys:/keys" ferry:0.1.0 keys /keys'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write the keys into (created with mode 0700)")


def run(args: argparse.Namespace) -> int:
    from ferry.shared.wire_keys import generate

    try:
        written = generate(Path(args.dir))
    except PermissionError as exc:
        raise ConfigError(_not_writable(args.dir, exc)) from exc
    for path in written:
        print(path)
    return 0


def _not_writable(directory: str, exc: PermissionError) -> str:
    """Most often the image's user (uid 10001) writing into a directory mounted from the host, which
    is the host user's: run the container as that user instead, so the keys are theirs too."""
    return (
        f"cannot write the keys to {directory}: {exc.strerror} ({exc.filename}); this process runs as uid "
        f"{os.getuid()}. In the image (uid 10001), run it as your own user: "
        f"{DOCKER_KEYS_COMMAND} (mkdir first: a directory Docker makes for the mount is root's)"
    )
