"""The ``guess-number`` environment: multi-turn; the env answers "higher" or "lower" until the guess hits."""

from __future__ import annotations

import random
from typing import Any

from rollout_ledger.services.envs._parse import last_int, task_int
from rollout_ledger.services.envs.base import REPLAY, Env, EnvSpec, Message, StepResult, TaskError


class GuessNumberEnv(Env):
    """Guess a hidden integer in ``[low, high]``; reward 1.0 on the hit."""

    resume = REPLAY
    """Deterministic given the task and the actions: a resumed attempt replays the recorded ones."""

    def __init__(self) -> None:
        self._target: int | None = None
        self._guesses = 0

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if "seed" in task:
            rng = random.Random(task_int(task, "seed"))
            low, high = 1, 100
            target = rng.randint(low, high)
        else:
            target, low, high = task_int(task, "target"), task_int(task, "low"), task_int(task, "high")
            if not low <= target <= high:
                raise TaskError(f"target {target} is not within [{low}, {high}]")
        self._target = target
        prompt = (f"I am thinking of an integer between {low} and {high}. Guess it. "
                  "After each guess I answer 'higher' or 'lower'. Reply with a single integer.")
        return [{"role": "user", "content": prompt}]

    async def step(self, action: str) -> StepResult:
        if self._target is None:
            raise RuntimeError("step() before reset()")
        self._guesses += 1
        guess = last_int(action)
        info: dict[str, Any] = {"guess": guess, "guesses": self._guesses}
        if guess is None:
            return StepResult([{"role": "user", "content": "Please reply with a single integer."}], info=info)
        if guess == self._target:
            return StepResult([], reward=1.0, terminated=True, info=info)
        feedback = "higher" if guess < self._target else "lower"
        return StepResult([{"role": "user", "content": feedback}], info=info)


SPEC = EnvSpec(
    name="guess-number",
    factory=GuessNumberEnv,
    description="Multi-turn number guessing: the env answers 'higher' or 'lower'; reward 1.0 on the hit.",
    multi_turn=True,
    example_task={"seed": 3},
)
