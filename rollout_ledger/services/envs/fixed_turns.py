"""The ``fixed-turns`` environment: exactly T turns whatever the answers (benchmarks and crash tests)."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_ledger.services.envs._parse import task_int
from rollout_ledger.services.envs.base import REPLAY, Env, EnvSpec, Message, StepResult, TaskError


class InjectedEnvFault(RuntimeError):
    """Raised on purpose by ``fixed-turns`` at the turn named by the task's ``fail_at``."""


class FixedTurnsEnv(Env):
    """Task ``{"turns": T}``; optional ``"fail_at": k`` (step k raises) and ``"step_delay_s"`` (slow env)."""

    resume = REPLAY
    """Deterministic given the task and the actions: a resumed attempt replays the recorded ones."""

    def __init__(self) -> None:
        self._turns = 0
        self._done = 0
        self._fail_at: int | None = None
        self._delay_s = 0.0

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self._turns = task_int(task, "turns")
        if self._turns < 1:
            raise TaskError(f"turns must be >= 1, got {self._turns}")
        self._fail_at = task_int(task, "fail_at") if "fail_at" in task else None
        delay = task.get("step_delay_s", 0.0)
        if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
            raise TaskError(f"step_delay_s must be a non-negative number, got {delay!r}")
        self._delay_s = float(delay)
        topic = task.get("topic")
        if topic is not None and (not isinstance(topic, str) or not topic.strip()):
            raise TaskError(f"topic must be a non-empty string, got {topic!r}")
        ask = f"Write a few sentences about {topic}." if topic else "Say anything."
        return [{"role": "user", "content": f"This conversation lasts {self._turns} turns. {ask}"}]

    async def step(self, action: str) -> StepResult:
        self._done += 1
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        if self._fail_at is not None and self._done == self._fail_at:
            raise InjectedEnvFault(f"fixed-turns fault injected at turn {self._done}")
        last = self._done >= self._turns
        text = f"Turn {self._done} of {self._turns} done. Continue."
        return StepResult([{"role": "user", "content": text}], reward=1.0 if last else 0.0, terminated=last,
                          info={"turn": self._done})


SPEC = EnvSpec(
    name="fixed-turns",
    factory=FixedTurnsEnv,
    description=("Exactly T turns, each answered 'Turn k of T done. Continue.'; optional 'topic' to write about "
                 "(benchmarks, crash tests)."),
    multi_turn=True,
    example_task={"turns": 3},
)
