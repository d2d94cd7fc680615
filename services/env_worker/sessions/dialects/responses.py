"""(being written)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rollout_ledger.services.env_worker.sessions.dialects.chat import error_body as error_body
from rollout_ledger.services.env_worker.sessions.turns import ApiError, TurnRequest, TurnResult


def parse(body: Any, memory: dict[str, Any]) -> tuple[TurnRequest, Any]:
    raise ApiError(501, "not yet served")


def response(result: TurnResult, req: Any, memory: dict[str, Any]) -> dict[str, Any]:
    raise ApiError(501, "not yet served")


def stream(result: TurnResult, req: Any, memory: dict[str, Any]) -> Iterator[bytes]:
    raise ApiError(501, "not yet served")


def retrieve(memory: dict[str, Any], response_id: str) -> dict[str, Any]:
    raise ApiError(501, "not yet served")


def delete(memory: dict[str, Any], response_id: str) -> dict[str, Any]:
    raise ApiError(501, "not yet served")
