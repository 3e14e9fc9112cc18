"""The model argument of `ferry serve`, `plan` and `generate`: positional, as vLLM takes it
(`ferry serve /models/Qwen3-30B-A3B`), or `--model` (also FERRY_MODEL). Both name one thing, so
giving two different models on one command line is an error; a positional model wins over
FERRY_MODEL, as every flag does over its variable."""

from __future__ import annotations

import argparse

from ferry.shared.errors import ConfigError


class _ModelAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if values is None or (option_string is None and values == parser.get_default(self.dest)):
            return  # the optional positional, absent: argparse hands it the default, which must not win over --model
        current = getattr(namespace, self.dest, None)
        if current is not None and current != parser.get_default(self.dest) and current != values:
            parser.error(f"two models given ({current!r} and {values!r}): give it once, positionally or with --model")
        setattr(namespace, self.dest, values)


def add_model_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "model", nargs="?", metavar="MODEL", action=_ModelAction, default=None, help=f"{help_text} (or --model)"
    )
    parser.add_argument("--model", action=_ModelAction, default=None, help=help_text)


def require_model(args: argparse.Namespace, command: str) -> str:
    """The model, or an error (exit status 2) that shows both ways to give it."""
    model = getattr(args, "model", None)
    if not model:
        raise ConfigError(f"no model given: `ferry {command} MODEL` or `ferry {command} --model MODEL`")
    return model
