"""Environments from libraries and from user code, registered beside the built-ins: tau2-bench (``tau2:<domain>``,
tau2_bench.py), reasoning-gym (``rg:<dataset>``, reasoning_gym.py), OpenEnv servers (``openenv:<name>``,
openenv_remote.py) and user classes (``ROLLOUT_ENV_CLASSES`` and the ``rollout_ledger.envs`` entry points,
custom.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_ledger.services.envs import custom, openenv_remote, reasoning_gym, tau2_bench
from rollout_ledger.services.envs.base import EnvSpec

if TYPE_CHECKING:
    from rollout_ledger.services.env_worker.settings import EnvWorkerSettings


def library_specs(settings: EnvWorkerSettings) -> list[EnvSpec]:
    """Every library and user env this worker's settings enable (each family validates its own settings)."""
    return [*tau2_bench.specs(settings), *reasoning_gym.specs(settings), *openenv_remote.specs(settings),
            *custom.specs(settings)]
