"""The one place where errors become HTTP responses, plus API-key checking.

Error bodies take the shape of the API the route belongs to: Anthropic's
{"type": "error", "error": {"type", "message"}} under /v1/messages, OpenAI's
{"error": {"message", "type", "param", "code"}} everywhere else (`param`: the field an error concerns,
when it concerns one). Every error response is counted by route and status
(`ferry_refused_requests_total`); a request on /v1/* that no generation counted (refused before it
ran, or the client left first) is counted in `ferry_requests_total` here, so that counter holds every
request, however it ended."""

from __future__ import annotations

import asyncio
import hmac

import structlog
from aiohttp import web

from ferry.services.api import anthropic_responses
from ferry.services.api.metrics import ApiMetrics, counted_by_generations
from ferry.services.api.responses import error_body
from ferry.shared.errors import FerryError, ServiceUnavailable, Unauthorized

log = structlog.get_logger("api.http")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}
ANTHROPIC_PREFIX = "/v1/messages"
# ferry_requests_total's route label of the generation routes (Generation's own); other paths: route_label
_REQUEST_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


def error_response(
    status: int,
    error_type: str,
    message: str,
    request: web.Request | None = None,
    headers: dict | None = None,
    param: str | None = None,
) -> web.Response:
    if request is not None and request.path.startswith(ANTHROPIC_PREFIX):  # Anthropic's errors name no field
        return web.json_response(anthropic_responses.error_body(status, message), status=status, headers=headers)
    return web.json_response(error_body(status, error_type, message, param), status=status, headers=headers)


def route_label(request: web.Request) -> str:
    """The matched route's path (a wrong method on a known path: that path; any other: "unmatched"),
    so the label set stays bounded whatever paths clients try."""
    match = request.match_info
    resource = getattr(match.route, "resource", None)
    if resource is not None:
        return resource.canonical
    if isinstance(getattr(match, "http_exception", None), web.HTTPMethodNotAllowed):
        return request.path
    return "unmatched"


def _count_request(metrics: ApiMetrics, request: web.Request, outcome: str) -> None:
    """ferry_requests_total for a request on /v1/* that its generations did not count (none ran)."""
    if request.path.startswith("/v1/") and not counted_by_generations(request):
        metrics.requests.labels(_REQUEST_ROUTES.get(request.path, route_label(request)), outcome).inc()


def error_responses(metrics: ApiMetrics):
    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            response = await handler(request)
        except FerryError as exc:
            if isinstance(exc, ServiceUnavailable):  # not ready, draining, a full queue: the server works as meant
                log.warning("request_refused", path=request.path, error=str(exc), error_type=type(exc).__name__)
            elif exc.http_status >= 500:
                log.error("request_failed", path=request.path, error=str(exc), error_type=type(exc).__name__)
            # a 503 says when to come back: a refusal while the server is not ready or is draining
            headers = {"Retry-After": str(getattr(exc, "retry_after", 1))} if exc.http_status == 503 else None
            response = error_response(exc.http_status, exc.error_type, str(exc), request, headers, exc.param)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = error_response(
                exc.status, _TYPE_BY_STATUS.get(exc.status, "invalid_request_error"), exc.text or exc.reason, request
            )
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            # the client went away (mid-body, or before the answer): nothing failed here, and nobody is
            # left to answer; aiohttp cancels the handler of a lost connection, or the read raises first
            log.info("client_disconnected", path=request.path)
            _count_request(metrics, request, "disconnected")
            if isinstance(exc, asyncio.CancelledError):
                raise
            response = error_response(400, "invalid_request_error", "the client closed the connection", request)
            response.force_close()
            return response
        except Exception:  # noqa: BLE001 - a bug must still answer with an error object, and be logged in full
            log.exception("unhandled_error", path=request.path)
            response = error_response(500, "internal_error", "internal server error (logged by the api)", request)
        if response.status >= 400:
            metrics.refused.labels(route_label(request), str(response.status)).inc()
            # refused: a 4xx, or a 503 before it ran (a generation that ran counted itself); failed: a bug
            _count_request(metrics, request, "refused" if response.status < 500 or response.status == 503 else "failed")
        return response

    return middleware


def bearer_token(authorization: str) -> str:
    """The credentials of `Authorization: Bearer TOKEN` ('' for any other scheme); the scheme's case
    does not matter (RFC 9110, 11.1), nor the spaces around the token."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def api_key_check(api_key: str | None):
    """The key on /v1/*, as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
    (Anthropic's); /health and /metrics stay open for probes and scrapers."""
    key = (api_key or "").encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if api_key is not None and request.path.startswith("/v1/"):
            by_bearer = hmac.compare_digest(bearer_token(request.headers.get("Authorization", "")).encode(), key)
            by_header = hmac.compare_digest(request.headers.get("x-api-key", "").encode(), key)
            if not (by_bearer or by_header):
                raise Unauthorized(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                )
        return await handler(request)

    return check
