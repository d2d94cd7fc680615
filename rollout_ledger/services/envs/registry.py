"""The env registry: name -> factory, description, multi-turn flag and example task (advertised in KV rl_envs)."""

from __future__ import annotations

from collections.abc import Iterable

from rollout_ledger.services.envs.base import Env, EnvSpec


class UnknownEnvError(KeyError):
    """No environment of that name is registered (or enabled) in this worker."""


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
