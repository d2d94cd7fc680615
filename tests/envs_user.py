"""User environment classes for the tests of ``ROLLOUT_ENV_CLASSES`` and the ``rollout_ledger.envs`` entry points:
gymnasium-style classes (sync and async, one with tools), a subclass of our ``Env``, and classes that must be
refused at start-up. Importable from the repository root (``tests.envs_user:SyncAdder``)."""

from __future__ import annotations

import os
import random
import re
from typing import Any, ClassVar

from rollout_ledger.services.envs.base import Env, EnvContext, Message, StepResult


def _last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


class SyncAdder:
    """Adds two numbers: one turn, reward 1.0 when the last integer of the answer is the sum."""

    multi_turn = False
    example_task: ClassVar[dict[str, Any]] = {"a": 12, "b": 7}

    def __init__(self) -> None:
        self.total = 0
        self.closed = False

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        options = options or {}
        rng = random.Random(seed)
        a, b = options.get("a", rng.randint(0, 50)), options.get("b", rng.randint(0, 50))
        self.total = a + b
        return f"What is {a} + {b}?", {"a": a, "b": b}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        parsed = _last_int(action)
        return "", float(parsed == self.total), True, False, {"expected": self.total, "parsed": parsed}

    def close(self) -> None:
        self.closed = True


class AsyncGuess:
    """Guess a number between 1 and ``high``: "higher" / "lower" until found (reward 1.0), truncated after
    ``tries`` guesses. Async methods; observations as chat messages."""

    example_task: ClassVar[dict[str, Any]] = {"seed": 1, "high": 10, "tries": 6}

    def __init__(self) -> None:
        self.secret = 0
        self.tries = 0
        self.guesses = 0
        self.context: EnvContext | None = None

    def bind(self, context: EnvContext) -> None:
        self.context = context

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None,
                    ) -> tuple[list[Message], dict[str, Any]]:
        options = options or {}
        high = int(options.get("high", 10))
        self.secret = random.Random(seed).randint(1, high)
        self.tries = int(options.get("tries", 6))
        episode = self.context.episode_id if self.context is not None else None
        return [{"role": "user", "content": f"Guess a number between 1 and {high}."}], {"episode": episode}

    async def step(self, action: str) -> tuple[Message | None, float, bool, bool, dict[str, Any]]:
        self.guesses += 1
        guess = _last_int(action)
        info = {"guess": guess, "secret": self.secret}
        if guess == self.secret:
            return None, 1.0, True, False, info
        hint = "higher" if guess is None or guess < self.secret else "lower"
        truncated = self.guesses >= self.tries
        return {"role": "user", "content": f"No, {hint}."}, 0.0, False, truncated, info

    async def close(self) -> None:
        self.secret = 0


class WithTools(SyncAdder):
    """The adder, with a tool schema it offers (a method)."""

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": "add", "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}}]


class NativeEcho(Env):
    """Our own Env, registered as it is: says back the task's text, reward 1.0 when the answer contains it."""

    def __init__(self) -> None:
        self.text = ""

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.text = str(task.get("text", "hello"))
        return [{"role": "user", "content": f"Say {self.text!r}."}]

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[], reward=float(self.text in action), terminated=True)


class FourTuple(SyncAdder):
    """Old gym's step (obs, reward, done, info): refused at its first step."""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:  # type: ignore[override]
        return "", 0.0, True, {}


# --- refused at start-up ------------------------------------------------------------------------------------
class NoStep:
    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return "x", {}


class OldReset:
    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "x", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "", 0.0, True, False, {}


class StepWithoutAction(SyncAdder):
    def step(self) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        return "", 0.0, True, False, {}


class NeedsArguments(SyncAdder):
    def __init__(self, difficulty: int) -> None:
        super().__init__()


class AbstractEnv(Env):
    async def reset(self, task: dict[str, Any]) -> list[Message]:
        return []


NOT_A_CLASS = 3


class Countdown:
    """``options["turns"]`` turns, each answered "k left"; declares itself deterministic (resumed by replay)."""

    deterministic = True

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.left = int((options or {}).get("turns", 3))
        return f"Count down from {self.left}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        return f"{self.left} left.", float(self.left == 0), self.left == 0, False, {}


class PidTalker(Countdown):
    """Declares itself deterministic but answers with its process id: a replay in another worker diverges."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        return f"{obs} (pid {os.getpid()})", reward, terminated, truncated, info


class SnapshotCounter(Countdown):
    """Resumed by snapshot: ``snapshot()`` is the steps left, ``restore`` sets it; ``restores`` counts the calls
    (in the step info, so a test sees that the resumed attempt restored instead of replaying)."""

    resume = "snapshot"
    deterministic = False

    def __init__(self) -> None:
        self.restored = 0

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"restored": self.restored}

    def snapshot(self) -> dict[str, int]:
        return {"left": self.left}

    def restore(self, state: dict[str, int]) -> None:
        self.left = int(state["left"])
        self.restored += 1
