"""The scheduler API's error answers: the 422 that names each field and problem, the 503 that never leaks database
or bus internals, and the error responses every route declares in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from fastapi import Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollout_ledger.services.scheduler.schemas import ErrorPublic, ValidationErrorPublic
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)


def describe_validation_errors(errors: Any) -> tuple[list[dict[str, Any]], str]:
    """Per error: its location, the dotted field (without body/query/path) and the reason; and one summary line."""
    detail: list[dict[str, Any]] = []
    parts: list[str] = []
    for err in errors:
        loc = [p if isinstance(p, int) else str(p) for p in err.get("loc", ())]
        named = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
        field = ".".join(str(p) for p in named) or "body"
        msg = str(err.get("msg", ""))
        detail.append({"loc": loc, "field": field, "msg": msg, "type": str(err.get("type", ""))})
        parts.append(f"{field}: {msg}")
    return detail, "; ".join(parts[:10])


def validation_response(errors: Any) -> JSONResponse:
    """422 naming each field and the reason (never echoing the input, which may be a huge task list)."""
    detail, message = describe_validation_errors(errors)
    return JSONResponse({"detail": detail, "message": message}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def field_error(field: str, msg: str) -> RequestValidationError:
    """A 422 about one body field, raised by a route (the same shape as pydantic's)."""
    return RequestValidationError([{"loc": ("body", field), "msg": msg, "type": "value_error"}])


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    return validation_response(exc.errors() if isinstance(exc, RequestValidationError) else [])


async def on_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503: NATS or Postgres failed; the request may be retried (POSTs with a batch_id are idempotent). The cause
    is logged, never returned: it may hold SQL, hosts or values."""
    log.warning("request.dependency_failed", path=request.url.path, error=str(exc), error_type=type(exc).__name__)
    which = "the event bus" if "Bus" in type(exc).__name__ else "the database"
    return JSONResponse({"detail": f"{which} is unavailable (retry later)"},
                        status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorPublic, "description": description}


UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: _error("NATS or Postgres is unavailable, or the scheduler is starting or stopping (retry)"),
}
READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error("Missing or unknown bearer token"),
    422: {"model": ValidationErrorPublic, "description": "A path parameter is invalid (the message names it)"},
    **UNAVAILABLE,
}
"""Error answers of every GET route."""
WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error("Missing or unknown bearer token"),
    403: _error("The token has only the read scope"),
    413: _error("The body is over ROLLOUT_MAX_BODY_BYTES (or a part of it over its own limit)"),
    422: {"model": ValidationErrorPublic,
          "description": "A field is invalid: wrong type, out of range, too long, too deep, NaN, an integer beyond "
                         "64 bits, a NUL or a lone surrogate in a string (the message names the field)"},
    **UNAVAILABLE,
}
"""Error answers of every POST route."""
