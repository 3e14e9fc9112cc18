"""Typed errors. Each maps to one process exit status and one HTTP status, in one place."""

from __future__ import annotations


class FerryError(Exception):
    """Base of every error Ferry raises on purpose: its message is meant for the user."""

    exit_status = 1
    http_status = 500
    error_type = "internal_error"

    def __init__(self, *args: object, param: str | None = None):
        super().__init__(*args)
        self.param = param  # the request field it concerns ("temperature", "messages[2].content"), if one


class ConfigError(FerryError):
    """A flag, a config.json or an environment variable is wrong: the message names which."""

    exit_status = 2
    http_status = 400
    error_type = "invalid_request_error"


class PlanError(FerryError):
    """The memory plan cannot fit the device budget (docs/ARCHITECTURE.md §2 rule 4)."""

    exit_status = 2


class ModelLoadError(FerryError):
    """Weights or tokenizer could not be found or read."""

    exit_status = 2


class InvalidRequest(FerryError):
    """A request the server can never serve as written (bad JSON, bad field, too long): HTTP 400."""

    http_status = 400
    error_type = "invalid_request_error"


class Unauthorized(FerryError):
    http_status = 401
    error_type = "authentication_error"


class NotFound(FerryError):
    http_status = 404
    error_type = "not_found_error"


class ServiceUnavailable(FerryError):
    """A peer process is down or not ready (worker lost, scheduler unreachable): HTTP 503."""

    http_status = 503
    error_type = "service_unavailable"


class EngineError(FerryError):
    """A step failed inside the worker: HTTP 500."""

    http_status = 500
    error_type = "internal_error"


# Errors that travel between processes by class name (messages.Failed.error_type).
_BY_NAME = {cls.__name__: cls for cls in (FerryError, ConfigError, InvalidRequest, ServiceUnavailable, EngineError)}


def error_from_wire(name: str, message: str, param: str | None = None) -> FerryError:
    return _BY_NAME.get(name, FerryError)(message, param=param)
