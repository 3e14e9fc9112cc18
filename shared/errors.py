"""Typed errors. Each maps to one process exit status and one HTTP status, in one place."""

from __future__ import annotations


class FerryError(Exception):
    """Base of every error Ferry raises on purpose: its message is meant for the user."""

    exit_status = 1
    http_status = 500
    error_type = "internal_error"


class ConfigError(FerryError):
    """A flag, a config.json or an environment variable is wrong: the message names which."""

    exit_status = 2
    http_status = 400
    error_type = "invalid_request_error"


class PlanError(FerryError):
    """The memory plan cannot fit the device budget (DESIGN §2 rule 4)."""

    exit_status = 2


class ModelLoadError(FerryError):
    """Weights or tokenizer could not be found or read."""

    exit_status = 2
