"""Server-sent events as the session endpoint's dialects write them."""

from __future__ import annotations

import json
from typing import Any


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event (``event: ...`` when named, ``data: ...`` and a blank line)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


DONE = sse("[DONE]")
"""The end of an OpenAI chat-completions stream."""
