"""The ``arithmetic`` environment: one question, verifiable reward on the last integer of the answer."""

from __future__ import annotations

import random
from typing import Any

from rollout_ledger.services.envs._parse import last_int, task_int
from rollout_ledger.services.envs.base import REPLAY, Env, EnvSpec, Message, StepResult, TaskError

OPS = ("+", "-", "*")


def solve(a: int, b: int, op: str) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise TaskError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def make_problem(task: dict[str, Any]) -> tuple[int, int, str]:
    """``(a, b, op)`` from ``{"seed": n}`` (procedural) or an explicit ``{"a", "b", "op"}``."""
    if "seed" in task:
        rng = random.Random(task_int(task, "seed"))
        return rng.randint(0, 99), rng.randint(0, 99), rng.choice(OPS)
    op = task.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise TaskError(f"task field 'op' must be one of {', '.join(OPS)}, got {op!r}")
    return task_int(task, "a"), task_int(task, "b"), op


class ArithmeticEnv(Env):
    """Asks ``a op b``; reward 1.0 when the last integer of the answer is the result."""

    resume = REPLAY
    """Deterministic given the task and the actions: a resumed attempt replays the recorded ones."""

    def __init__(self) -> None:
        self._expected: int | None = None

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        a, b, op = make_problem(task)
        self._expected = solve(a, b, op)
        return [{"role": "user", "content": f"What is {a} {op} {b}? Answer with a single integer."}]

    async def step(self, action: str) -> StepResult:
        if self._expected is None:
            raise RuntimeError("step() before reset()")
        parsed = last_int(action)
        reward = 1.0 if parsed == self._expected else 0.0
        return StepResult(observation=[], reward=reward, terminated=True,
                          info={"expected": self._expected, "parsed": parsed})


SPEC = EnvSpec(
    name="arithmetic",
    factory=ArithmeticEnv,
    description="Single-turn integer arithmetic (+, -, *); reward 1.0 when the last integer in the answer is right.",
    multi_turn=False,
    example_task={"seed": 7},
)
