"""Scaffold: the reasoning_gym env family (filled in by its own change)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_ledger.services.envs.base import EnvSpec

if TYPE_CHECKING:
    from rollout_ledger.services.env_worker.settings import EnvWorkerSettings


def specs(settings: EnvWorkerSettings) -> list[EnvSpec]:
    """The envs of this family that ``settings`` enable."""
    return []
