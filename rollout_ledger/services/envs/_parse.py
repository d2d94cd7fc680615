"""Helpers the built-in environments share: reading task fields and the last integer of an answer."""

from __future__ import annotations

import re
from typing import Any

from rollout_ledger.services.envs.base import TaskError

_INT = re.compile(r"-?\d+")


def last_int(text: str) -> int | None:
    """The last integer written in ``text`` (``None`` when there is none)."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def task_int(task: dict[str, Any], key: str) -> int:
    """``task[key]`` as an int; ``TaskError`` when missing or not an integer."""
    value = task.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TaskError(f"task field {key!r} must be an integer, got {value!r}")
    return value
