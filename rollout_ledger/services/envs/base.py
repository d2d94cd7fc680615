"""The in-process environment protocol: a single-use ``Env`` with ``reset`` and ``step``, its ``StepResult``, the
``EnvContext`` the worker binds before ``reset`` (ids and a chat LLM for simulated users), and the ``EnvSpec`` a
registry holds."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (whatever the chat template accepts)."""


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action."""

    observation: list[Message]
    """Messages appended after the assistant's turn (usually one ``user`` or ``tool`` message; may be empty)."""
    reward: float = 0.0
    """Reward for this step; the episode's reward is the sum over its steps."""
    terminated: bool = False
    """The task is over (solved or failed for good)."""
    truncated: bool = False
    """The environment cut the episode short (its own budget ran out)."""
    aborted: bool = False
    """The agent's action ends the episode without an outcome (e.g. a malformed tool call with abort-on-error);
    the driver finishes the episode with status ``aborted``."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-serialisable details, stored with the step."""


class EnvLLM(Protocol):
    """A chat model served by the inference workers, for an environment's own use (a simulated user, a judge).

    Its generations are not the policy's: they reach the trajectory only as the environment's observation text
    (tokenized like any environment message, loss mask 0)."""

    async def chat(self, messages: list[Message], *, pool: str = "", max_tokens: int = 256,
                   temperature: float = 1.0, stop: list[str] | None = None) -> str:
        """The assistant reply to ``messages`` (chat template of the pool's model), from the model pool ``pool``
        (empty: the policy's own workers)."""
        ...


@dataclass(frozen=True)
class EnvContext:
    """What the worker tells an episode's ``Env`` before ``reset`` (``Env.bind``)."""

    episode_id: str
    batch_id: str
    attempt: int
    llm: EnvLLM | None = None
    """A chat LLM on the inference workers; None where the worker offers none (unit tests)."""


REPLAY = "replay"
"""Resume capability: reset with the same task and the recorded actions applied again gives the recorded
observations (a deterministic env: every observation is compared, a mismatch falls back to ``RESTART``)."""
SNAPSHOT = "snapshot"
"""Resume capability: ``snapshot()`` after a step returns a JSON-serialisable state, stored with the step, and
``restore(state)`` after ``reset`` brings it back."""
RESTART = "restart"
"""Resume capability: the state cannot be restored (the default); an interrupted episode starts again at turn 0."""
RESUME_MODES = (REPLAY, SNAPSHOT, RESTART)


class Env(abc.ABC):
    """One episode of an environment. Single use: ``bind``, ``reset`` once, then ``step`` until done."""

    resume: str = RESTART
    """How an interrupted episode gets this env's state back (``REPLAY``, ``SNAPSHOT`` or ``RESTART``). Declare
    ``REPLAY`` only when the same task and the same actions give the same observations (no clock, no unseeded
    randomness, no side effects outside the process that a second run would repeat)."""

    def snapshot(self) -> Any:
        """The env's state after the last step, JSON-serialisable (``SNAPSHOT`` envs)."""
        raise NotImplementedError(f"{type(self).__name__} declares no snapshot")

    async def restore(self, state: Any) -> None:
        """Bring back a state ``snapshot`` returned, after ``reset`` with the same task (``SNAPSHOT`` envs)."""
        raise NotImplementedError(f"{type(self).__name__} declares no snapshot")

    def bind(self, context: EnvContext) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called once before ``reset`` with the episode's ids and the worker's services."""

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any]) -> list[Message]:
        """Start the episode for ``task``; return the initial chat messages (the prompt)."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Take the assistant's text ``action``; return the observation and reward."""

    def tools(self) -> list[dict[str, Any]] | None:
        """Tool schemas (OpenAI/Hermes function format) the chat template renders into the prompt, after
        ``reset``; ``None`` when the environment has no tools."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources (called once, after the last step or a failure)."""


class TaskError(ValueError):
    """The task given to ``reset`` is malformed for this environment."""


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment."""

    name: str
    """Registry key; the ``env`` of work items."""
    factory: Callable[[], Env]
    """Builds a fresh single-use ``Env``."""
    description: str
    """One line for GET /v1/envs."""
    multi_turn: bool
    """Whether an episode can take more than one turn."""
    example_task: dict[str, Any] = field(default_factory=dict)
    """A valid task, shown to users."""
    family: str = ""
    """Set on the members of a parametrised family (``rg`` for ``rg:<dataset>``): a family is advertised and
    routed as one (its members listed in its advert), not as one entry per member."""

    @property
    def route(self) -> str:
        """What work is routed by: the family, or the env's own name."""
        return self.family or self.name

    def advert(self, registered_by: str) -> dict[str, Any]:
        """The JSON value put into the ``rl_envs`` bucket under ``name``."""
        return {
            "name": self.name,
            "description": self.description,
            "multi_turn": self.multi_turn,
            "example_task": self.example_task,
            "registered_by": registered_by,
        }
