"""`ferry` command line: one subcommand per process or tool. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ferry.shared.env_flags import apply_env_defaults
from ferry.shared.errors import FerryError

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS = {
    "plan": ("ferry.plan.plan_command", "print the worker's memory plan for a model and a device budget"),
    "generate": (
        "ferry.services.generate_command",
        "generate from one prompt offline, through the worker's boot and executor",
    ),
    "make-tiny-model": (
        "ferry.services.make_tiny_model",
        "write the tiny random-weight demo checkpoint (also the tests' model)",
    ),
    "make-bench-model": (
        "ferry.services.bench_model",
        "write a model directory of a real config's shapes (tokenizer included) for --load-format dummy",
    ),
    "serve": (
        "ferry.services.serve_command",
        "run api, scheduler and worker on this host (an OpenAI- and Anthropic-compatible server)",
    ),
    "api": ("ferry.services.api.command", "run one api replica: the OpenAI- and Anthropic-compatible HTTP server"),
    "scheduler": ("ferry.services.scheduler.command", "run the scheduler"),
    "worker": ("ferry.services.worker.command", "run the worker: loads the model and executes steps"),
    "worker-rank": (
        "ferry.services.worker.rank_command",
        "rank r > 0 of an expert-parallel worker (started by `ferry worker --expert-parallel-size N`)",
    ),
    "keys": ("ferry.services.keys_command", "write the CURVE keys that authenticate the ZeroMQ wire in the tcp layout"),
}


class _VersionAction(argparse.Action):
    """`ferry --version`: the installed package's version, read only when asked (the metadata
    lookup walks sys.path, which every other command can do without)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("ferry")
        except PackageNotFoundError:  # run from the tree without an install (PYTHONPATH=.)
            text = "(not installed: no package metadata)"
        print(f"ferry {text}")  # on stdout, as argparse's own version action prints
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's module is imported (and its flags registered), so
    `ferry api` and `ferry scheduler` never import what the worker's commands import (torch)."""
    parser = argparse.ArgumentParser(prog="ferry", description="Serve MoE models from GPUs too small to hold them.")
    parser.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
            apply_env_defaults(p)
    return parser


def _chosen_command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(_chosen_command(argv))
    except FerryError as exc:  # a bad FERRY_* variable
        print(f"ferry: error: {exc}", file=sys.stderr)
        return exc.exit_status
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        status = module.run(args)
        sys.stdout.flush()  # here, so that a reader gone away (`| head`) is caught below, not at exit
        return status
    except FerryError as exc:
        print(f"ferry {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed it (`ferry plan ... | head`): stop quietly, as a C tool killed by SIGPIPE
    would, with its status (128 + 13). stdout goes to /dev/null first, or the interpreter's own flush
    at exit would print a second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
