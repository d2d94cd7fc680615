"""An agent function that hands its episode's session to the test instead of calling the policy itself: the
honest way to point an outside client (the ``llm-comply`` conformance suite) at a real session endpoint.

``hold_session`` writes its client's ``base_url`` and ``api_key`` (the session's secret) to ``task["handoff"]``,
keeps the session open until the file ``task["release"]`` exists, and returns reward 1. Every call the outside
client makes meanwhile is a turn of the episode, recorded like any agent's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI


async def hold_session(task: dict[str, Any], client: AsyncOpenAI) -> dict[str, Any]:
    """Hand the session over (``task["handoff"]``) and hold it open until ``task["release"]`` exists."""
    handoff = Path(task["handoff"])
    partial = handoff.with_suffix(".partial")
    partial.write_text(json.dumps({"base_url": str(client.base_url).rstrip("/"), "api_key": client.api_key}))
    partial.rename(handoff)  # the test never reads half a file
    release = Path(task["release"])
    while not await asyncio.to_thread(release.exists):  # noqa: ASYNC110 (the test signals from another process)
        await asyncio.sleep(0.05)
    return {"reward": 1.0, "answer": "held"}
