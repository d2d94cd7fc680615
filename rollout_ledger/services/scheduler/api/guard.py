"""The request-body guard of the scheduler API: size, JSON shape and values a hostile client may send.

It runs before routing and before FastAPI parses anything. A body larger than ``ROLLOUT_MAX_BODY_BYTES`` is
answered 413 from its Content-Length, or as soon as the streamed bytes pass the limit, without being parsed.
A body within the limit is parsed once here and walked: every value that Postgres, the canonical JSON of the
planner (orjson) or a work item cannot carry is a 422 naming where it is and what is wrong with it, so nothing
further down the request ever meets it:

- not JSON or not UTF-8; ``NaN``/``Infinity`` (and numbers that overflow to them, ``1e400``);
- integers outside the signed 64-bit range;
- nesting deeper than ``ROLLOUT_MAX_JSON_DEPTH``;
- strings or object keys with NUL characters or lone UTF-16 surrogates, or longer than ``ROLLOUT_MAX_STRING_CHARS``.

The body then goes on to the app unchanged.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import status
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_ledger.services.scheduler.api.error_responses import validation_response
from rollout_ledger.services.scheduler.settings import SchedulerSettings

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_BAD_CHARS = re.compile("[\x00\ud800-\udfff]")


class BodyTooLarge(Exception):
    """The body passed ``ROLLOUT_MAX_BODY_BYTES``."""


@dataclass(frozen=True)
class BodyProblem:
    """One thing wrong in a body: where (``loc``, as FastAPI's validation errors say it) and what."""

    loc: tuple[str | int, ...]
    msg: str
    type: str

    def error(self) -> dict[str, Any]:
        return {"loc": ("body", *self.loc), "msg": self.msg, "type": self.type}


class _NonFinite:
    """What ``NaN``, ``Infinity`` and ``-Infinity`` parse to, so the walk can say where they were."""

    def __init__(self, text: str) -> None:
        self.text = text


def _string_problem(value: str, max_chars: int, what: str) -> tuple[str, str] | None:
    if len(value) > max_chars:
        return f"{what} has {len(value)} characters; the limit is {max_chars} (ROLLOUT_MAX_STRING_CHARS)", \
            "string_too_long"
    bad = _BAD_CHARS.search(value)
    if bad is not None:
        if bad.group() == "\x00":
            return f"{what} contains a NUL character (U+0000) at index {bad.start()}", "string_nul"
        return (f"{what} contains a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at index {bad.start()}: "
                "not a Unicode character"), "string_surrogate"
    return None


def problems(value: Any, max_depth: int, max_chars: int) -> Iterator[BodyProblem]:
    """Every problem of a parsed body, outermost first (iterative: a deep body cannot exhaust the stack)."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(value, (), 0)]
    while stack:
        item, loc, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= max_depth:
                yield BodyProblem(loc, f"nested deeper than {max_depth} arrays/objects (ROLLOUT_MAX_JSON_DEPTH)",
                                  "too_deep")
                continue
            if isinstance(item, dict):
                children: list[tuple[Any, tuple[str | int, ...]]] = []
                for key, child in item.items():
                    bad_key = _string_problem(key, max_chars, "an object key")
                    if bad_key is not None:
                        yield BodyProblem(loc, bad_key[0], bad_key[1])
                        continue
                    children.append((child, (*loc, key)))
            else:
                children = [(child, (*loc, i)) for i, child in enumerate(item)]
            stack.extend((child, child_loc, depth + 1) for child, child_loc in reversed(children))
        elif isinstance(item, _NonFinite):
            yield BodyProblem(loc, f"{item.text} is not a JSON number (only finite numbers are)", "number_not_finite")
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                yield BodyProblem(loc, f"integer with {len(str(abs(item)))} digits is outside the signed 64-bit "
                                       "range", "int_out_of_range")
        elif isinstance(item, float):
            if not math.isfinite(item):
                yield BodyProblem(loc, "number overflows to infinity (outside the double range)",
                                  "number_not_finite")
        elif isinstance(item, str):
            bad = _string_problem(item, max_chars, "string")
            if bad is not None:
                yield BodyProblem(loc, bad[0], bad[1])


def check_body(raw: bytes, max_depth: int, max_chars: int, limit: int = 10) -> list[BodyProblem]:
    """Up to ``limit`` problems of a request body (empty: it may go on to the app)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [BodyProblem((), f"body is not UTF-8 (byte {exc.start})", "body_not_utf8")]
    try:
        value = json.loads(text, parse_constant=_NonFinite)
    except json.JSONDecodeError as exc:
        return [BodyProblem((), f"body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                            "json_invalid")]
    except RecursionError:
        return [BodyProblem((), f"nested deeper than {max_depth} arrays/objects (ROLLOUT_MAX_JSON_DEPTH)",
                            "too_deep")]
    found: list[BodyProblem] = []
    for problem in problems(value, max_depth, max_chars):
        found.append(problem)
        if len(found) >= limit:
            break
    return found


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyGuard:
    """ASGI middleware: 413 for a body over the limit (unread), 422 for one that ``check_body`` refuses."""

    def __init__(self, app: ASGIApp, settings: SchedulerSettings) -> None:
        self.app = app
        self.settings = settings

    def _too_large(self, size: str) -> JSONResponse:
        return JSONResponse(
            {"detail": f"request body is {size}; the limit is {self.settings.max_body_bytes} bytes "
                       "(ROLLOUT_MAX_BODY_BYTES): split the batch"},
            status_code=status.HTTP_413_CONTENT_TOO_LARGE,
        )

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.settings.max_body_bytes:
            await self._too_large(f"{declared} bytes (Content-Length)")(scope, receive, send)
            return
        try:
            raw = await self._read(receive)
        except BodyTooLarge:
            await self._too_large(f"over {self.settings.max_body_bytes} bytes")(scope, receive, send)
            return
        if raw.strip():
            found = check_body(raw, self.settings.max_json_depth, self.settings.max_string_chars)
            if found:
                await validation_response([p.error() for p in found])(scope, receive, send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
