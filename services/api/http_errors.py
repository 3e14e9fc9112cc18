"""The one place where errors become HTTP responses (OpenAI error objects), plus API-key checking."""

from __future__ import annotations

import hmac

import structlog
from aiohttp import web

from ferry.shared.errors import FerryError, Unauthorized
from ferry.services.api.responses import error_body

log = structlog.get_logger("api.http")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "invalid_request_error"}  # fmt: skip


def error_response(status: int, error_type: str, message: str) -> web.Response:
    return web.json_response(error_body(status, error_type, message), status=status)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except FerryError as exc:
        if exc.http_status >= 500:
            log.error("request_failed", path=request.path, error=str(exc), error_type=type(exc).__name__)
        return error_response(exc.http_status, exc.error_type, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, _TYPE_BY_STATUS.get(exc.status, "invalid_request_error"), exc.text or exc.reason)
    except Exception:  # noqa: BLE001 - a bug must still answer with an error object, and be logged in full
        log.exception("unhandled_error", path=request.path)
        return error_response(500, "internal_error", "internal server error (logged by the api)")


def api_key_check(api_key: str | None):
    """Bearer-token check on /v1/*; /health and /metrics stay open for probes and scrapers."""

    @web.middleware
    async def check(request: web.Request, handler):
        if api_key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise Unauthorized("missing or wrong API key: send the header 'Authorization: Bearer <key>'")
        return await handler(request)

    return check
