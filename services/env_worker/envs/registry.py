"""The env registry: name -> factory, description, multi-turn flag and example task (advertised in KV rl_envs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout_ledger.services.env_worker.envs.base import Env


class UnknownEnvError(KeyError):
    """No environment of that name is registered (or enabled) in this worker."""


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

    def advert(self, registered_by: str) -> dict[str, Any]:
        """The JSON value put into the ``rl_envs`` bucket under ``name``."""
        return {
            "name": self.name,
            "description": self.description,
            "multi_turn": self.multi_turn,
            "example_task": self.example_task,
            "registered_by": registered_by,
        }


class EnvRegistry:
    """Environments known to one worker process."""

    def __init__(self, specs: Iterable[EnvSpec] = ()) -> None:
        self._specs: dict[str, EnvSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: EnvSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"env {spec.name!r} is registered twice")
        self._specs[spec.name] = spec

    def get(self, name: str) -> EnvSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownEnvError(name) from None

    def create(self, name: str) -> Env:
        return self.get(name).factory()

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[EnvSpec]:
        return [self._specs[n] for n in self.names()]

    def only(self, names: Iterable[str]) -> EnvRegistry:
        """A registry restricted to ``names`` (each must exist)."""
        return EnvRegistry(self.get(n) for n in names)


def builtin_registry() -> EnvRegistry:
    """A registry holding the built-in environments."""
    from rollout_ledger.services.env_worker.envs.arithmetic import SPEC as ARITHMETIC
    from rollout_ledger.services.env_worker.envs.fixed_turns import SPEC as FIXED_TURNS
    from rollout_ledger.services.env_worker.envs.guess_number import SPEC as GUESS_NUMBER
    from rollout_ledger.services.env_worker.envs.retail import SPEC as RETAIL

    return EnvRegistry([ARITHMETIC, GUESS_NUMBER, FIXED_TURNS, RETAIL])
