"""The scheduler's OpenAPI schema as the API behaves: this deployment's request limits, and request bodies stated as
tightly as the body guard (api/guard.py) enforces them.

Pydantic writes ``{"type": "string"}`` and ``{"type": "object"}`` for what the guard then narrows: no NUL
characters, strings up to ``ROLLOUT_MAX_STRING_CHARS``, integers in the signed 64-bit range, and free-form values
(tasks, metadata) made of those. The schema says so, so that a client (or schemathesis) that follows it only gets
a 422 for what it calls invalid. What JSON Schema cannot state is declared as responses: 413 for sizes (the body,
a task's or the metadata's encoding, tasks x group_size), 400 for values that conflict with each other or with the
deployment (an unregistered env, ``episodes_per_version`` against ``group_size``), and a nesting depth of
``ROLLOUT_MAX_JSON_DEPTH`` in the description.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from rollout_ledger.services.scheduler.api.guard import INT64_MAX, INT64_MIN
from rollout_ledger.services.scheduler.settings import SchedulerSettings

REQUEST_MODELS = (
    "BatchCreate", "SamplingRequest", "ToolCallConstraint", "ContextRequest", "PolicyVersionCreate")
"""Components that describe request bodies (tightened); response models are left as pydantic writes them."""
NO_NUL = "^[^\\x00]*$"
"""Pattern of every request string: the guard refuses NUL (Postgres text and JSONB cannot hold it)."""
JSON_VALUE = "JsonValue"


def _json_value(max_chars: int) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
    return {
        "description": "Any JSON value the scheduler stores: strings without NUL up to ROLLOUT_MAX_STRING_CHARS, "
                       "finite numbers, integers in the signed 64-bit range, nested at most ROLLOUT_MAX_JSON_DEPTH "
                       "deep.",
        "anyOf": [
            {"type": "string", "maxLength": max_chars, "pattern": NO_NUL},
            {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {"type": "array", "items": ref},
            {"type": "object", "additionalProperties": ref,
             "propertyNames": {"maxLength": max_chars, "pattern": NO_NUL}},
        ],
    }


def _tighten(node: Any, max_chars: int) -> None:
    """Narrow one request schema in place (recursing through properties, items and anyOf)."""
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "string" and "enum" not in node:
        node.setdefault("pattern", NO_NUL)
        node["maxLength"] = min(int(node.get("maxLength", max_chars)), max_chars)
    elif kind == "integer":
        node.setdefault("minimum", INT64_MIN)
        node.setdefault("maximum", INT64_MAX)
    elif kind == "object" and (extra := node.get("additionalProperties")) is not False:
        # an open object or a map: its keys are request strings too; its values are JSON values, or a schema of
        # their own (an open model, e.g. a contract model that ignores unknown fields, says nothing of them)
        node["propertyNames"] = {"maxLength": max_chars, "pattern": NO_NUL}
        if extra is True or extra is None:
            node["additionalProperties"] = {"$ref": f"#/components/schemas/{JSON_VALUE}"}
        elif isinstance(extra, dict):
            _tighten(extra, max_chars)
    for key in ("properties",):
        for child in (node.get(key) or {}).values():
            _tighten(child, max_chars)
    if isinstance(node.get("items"), dict):
        _tighten(node["items"], max_chars)
    for child in node.get("anyOf", ()):
        _tighten(child, max_chars)


def limits_of(settings: SchedulerSettings) -> dict[str, int]:
    return {
        "max_body_bytes": settings.max_body_bytes, "max_json_depth": settings.max_json_depth,
        "max_string_chars": settings.max_string_chars, "max_metadata_bytes": settings.max_metadata_bytes,
        "max_task_bytes": settings.max_task_bytes, "max_batch_episodes": settings.max_batch_episodes,
    }


def behaving_schema(app: FastAPI, settings: SchedulerSettings) -> Callable[[], dict[str, Any]]:
    """``app.openapi`` replaced: FastAPI's schema, tightened and with the limits (``info.x-limits``)."""
    plain = app.openapi
    limits = limits_of(settings)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = plain()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in REQUEST_MODELS:
            _tighten(components.get(name), settings.max_string_chars)
        components[JSON_VALUE] = _json_value(settings.max_string_chars)
        schema["info"]["x-limits"] = limits
        schema["info"]["description"] = (
            "Every /v1 route needs a bearer token: ROLLOUT_API_TOKEN (scopes read and write) or "
            "ROLLOUT_API_READ_TOKEN (read); a missing or unknown one is a 401, a read token on a POST a 403. "
            "Request limits of this deployment: " + ", ".join(f"{k} {v}" for k, v in limits.items()) + ". "
            "A body over max_body_bytes (refused before it is parsed), metadata over max_metadata_bytes, a task over "
            "max_task_bytes or tasks x group_size over max_batch_episodes is a 413. What the request schemas state "
            "is a 422 naming the field when violated, also where pydantic alone would coerce: numbers must be JSON "
            "numbers, strings hold no NUL, integers fit in 64 bits, NaN and Infinity are not numbers; and nesting "
            "deeper than max_json_depth. An env no env worker registered, or episodes_per_version that does not "
            "fit group_size and a staleness bound, is a 400.")
        app.openapi_schema = schema
        return schema

    return openapi
