"""Every flag of a command can also come from a FERRY_<FLAG> variable (compose configures services that way).

A flag on the command line wins over the variable; the variable wins over the built-in default.
"""

from __future__ import annotations

import argparse
import os

from ferry.shared.errors import ConfigError

PREFIX = "FERRY_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(dest: str) -> str:
    return PREFIX + dest.upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    for action in parser._actions:  # argparse exposes no public iterator over its actions
        if not action.option_strings or action.dest in ("help", argparse.SUPPRESS):
            continue
        name = env_name(action.dest)
        if name not in environ:
            continue
        raw = environ[name]
        if action.nargs == 0:  # store_true / store_false
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                raise ConfigError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
            value = (low in _TRUE) == isinstance(action, argparse._StoreTrueAction)
            parser.set_defaults(**{action.dest: value})
        else:
            parser.set_defaults(**{action.dest: raw})  # argparse runs a string default through the flag's type
        action.required = False
