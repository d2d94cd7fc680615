"""The env's own LLM calls of one attempt, journaled: live, each reply is kept and stored with the step (or reset)
that asked for it; in a replay, each call is answered from the recorded replies instead of a new generation.

An env with a simulated user (``tau2:*``) is deterministic given the policy's actions and its user's replies. The
replies of a step are stored in that step's info (``info["env_llm"]``, and those of the reset in turn 0's
``info["env_llm_reset"]``), so a resumed attempt replays the env with the same user: the user's replies come from
the record, not from a new generation that would say something else.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rollout_ledger.services.envs.base import EnvLLM, Message

STEP_KEY = "env_llm"
"""``StepCompleted.info`` key: the env LLM's replies during that step, in order."""
RESET_KEY = "env_llm_reset"
"""Turn 0's ``StepCompleted.info`` key: the env LLM's replies during the reset (e.g. a simulated user's opening)."""


class ScriptExhausted(RuntimeError):
    """In a replay the env asked its LLM more often than the recorded attempt did."""


class JournaledLLM:
    """An ``EnvLLM`` that keeps the replies of the live one, or answers from a script (see the module docstring)."""

    def __init__(self, llm: EnvLLM) -> None:
        self.llm = llm
        self._replies: list[str] = []
        self._script: deque[str] | None = None

    async def chat(self, messages: list[Message], *, pool: str = "", max_tokens: int = 256,
                   temperature: float = 1.0, stop: list[str] | None = None) -> str:
        if self._script is not None:
            if not self._script:
                raise ScriptExhausted("the env asked its LLM for more replies than the recorded attempt got")
            return self._script.popleft()
        text = await self.llm.chat(messages, pool=pool, max_tokens=max_tokens, temperature=temperature, stop=stop)
        self._replies.append(text)
        return text

    def take(self) -> list[str]:
        """The live replies since the last ``take``."""
        replies, self._replies = self._replies, []
        return replies

    def play(self, replies: Any) -> None:
        """Answer the next calls with ``replies`` (a recorded list), until ``live``."""
        self._script = deque(str(r) for r in replies) if isinstance(replies, list) else deque()

    def left(self) -> int:
        """Recorded replies the replay has not used (a replay that leaves some diverged)."""
        return len(self._script) if self._script is not None else 0

    def live(self) -> None:
        self._script = None
        self._replies = []
