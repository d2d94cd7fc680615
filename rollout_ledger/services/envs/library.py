"""Environments from libraries and from user code, registered beside the built-ins: tau2-bench (``tau2:<domain>``,
tau2_bench.py), reasoning-gym (``rg:<dataset>``, reasoning_gym.py), OpenEnv servers (``openenv:<name>``,
openenv_remote.py) and user classes (``ROLLOUT_ENV_CLASSES`` and the ``rollout_ledger.envs`` entry points,
custom.py)."""

from __future__ import annotations

from typing import Protocol

from rollout_ledger.services.envs import custom, openenv_remote, reasoning_gym, tau2_bench
from rollout_ledger.services.envs.base import EnvSpec


class LibrarySettings(custom.CustomSettings, openenv_remote.OpenEnvSettings, reasoning_gym.RgSettings,
                      tau2_bench.Tau2Settings, Protocol):
    """What the library's families read from their host's settings (the env worker's ``EnvWorkerSettings``); the
    library imports no service: the settings come to it."""


def library_specs(settings: LibrarySettings) -> list[EnvSpec]:
    """Every library and user env this worker's settings enable (each family validates its own settings)."""
    return [*tau2_bench.specs(settings), *reasoning_gym.specs(settings), *openenv_remote.specs(settings),
            *custom.specs(settings)]
