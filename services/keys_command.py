"""`ferry keys DIR`: the CURVE key pairs of the tcp layout (shared/wire_keys.py), one per role.

Give DIR to every process as --wire-keys DIR (FERRY_WIRE_KEYS), or mount its files into compose as
secrets (compose.yaml): each service needs its own ROLE.key_secret and scheduler.key; the scheduler
also needs api.key and worker.key. Existing keys are never overwritten."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write the keys into (created with mode 0700)")


def run(args: argparse.Namespace) -> int:
    from ferry.shared.wire_keys import generate

    for path in generate(Path(args.dir)):
        print(path)
    return 0
