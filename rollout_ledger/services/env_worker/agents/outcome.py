"""What an agent run is and what came of it, as plain data both ways over the agent-process socket: the run
(``AgentRun``), how it ended (``RunEnd``, ``RunOutcome``) and the checked result (``AgentResult``). Imported by
whatever runs agents (``run`` for functions, ``command`` for harness processes) and by nothing heavier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

REASON_CHARS = 1900
"""Room for the traceback in ``EpisodeFailed.reason`` (the event keeps 2,000 characters)."""


def jsonable(value: dict[str, Any]) -> dict[str, Any]:
    """Free-form agent output as plain JSON values (numpy scalars, sets, objects become JSON or strings)."""
    if not value:
        return {}
    out = orjson.loads(orjson.dumps(value, default=str, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS))
    return out if isinstance(out, dict) else {"info": out}


@dataclass(frozen=True)
class AgentResult:
    """What an agent returned, checked."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    answer: Any = None


def agent_result(value: Any) -> AgentResult:
    """The reward, info and answer of an agent's return value; ``ValueError`` saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        raise ValueError(f"the agent returned {type(value).__name__}; expected a number (the reward) or a dict "
                         "with 'reward' (and optionally 'info', 'answer')")
    if isinstance(value, dict):
        reward = value.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"the agent's result has no numeric 'reward' (got {reward!r})")
        info = value.get("info") or {}
        if not isinstance(info, dict):
            raise ValueError(f"the agent's 'info' must be a dict, got {type(info).__name__}")
        result = AgentResult(float(reward), jsonable(info), jsonable({"a": value.get("answer")})["a"])
    else:
        result = AgentResult(float(value), {}, None)
    if not math.isfinite(result.reward):
        raise ValueError(f"the agent's reward is not finite ({result.reward})")
    return result


class RunEnd(StrEnum):
    """How a call of an agent function ended (the episode's outcome also depends on its session)."""

    RETURNED = "returned"
    """It returned a valid result (``RunOutcome.result``)."""
    INVALID = "invalid"
    """It returned something that is not a reward (``message`` says what)."""
    RAISED = "raised"
    """It raised (``message``: the exception and its traceback; ``error``: the one-line summary)."""
    TIMEOUT = "timeout"
    """It ran past its deadline and was cancelled."""
    LOST = "lost"
    """Its agent process died or stopped answering before it ended (``message`` says how)."""


@dataclass(frozen=True)
class AgentRun:
    """One call of an agent function: all an agent process needs (the session itself stays in the worker)."""

    agent: str
    """The agent's name (an entry of ``ROLLOUT_AGENTS``)."""
    task: dict[str, Any]
    base_url: str
    """The OpenAI ``base_url`` of the episode's session."""
    api_key: str
    """The session's secret."""
    timeout_s: float
    """Deadline of the call; 0: none."""

    def wire(self) -> dict[str, Any]:
        return {"agent": self.agent, "task": self.task, "base_url": self.base_url, "api_key": self.api_key,
                "timeout_s": self.timeout_s}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> AgentRun:
        return cls(agent=d["agent"], task=d["task"], base_url=d["base_url"], api_key=d["api_key"],
                   timeout_s=float(d["timeout_s"]))


@dataclass(frozen=True)
class RunOutcome:
    """What came of one ``AgentRun``."""

    end: RunEnd
    result: AgentResult | None = None
    message: str = ""
    error: str = ""

    def wire(self) -> dict[str, Any]:
        r = self.result
        return {"end": self.end.value, "message": self.message, "error": self.error,
                "result": None if r is None else {"reward": r.reward, "info": r.info, "answer": r.answer}}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RunOutcome:
        r = d.get("result")
        result = None if r is None else AgentResult(float(r["reward"]), r.get("info") or {}, r.get("answer"))
        return cls(RunEnd(d["end"]), result, str(d.get("message") or ""), str(d.get("error") or ""))
