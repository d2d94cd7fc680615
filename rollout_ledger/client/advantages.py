"""Group advantages (GRPO, RLOO, none): the SQL the exporter computes them with.

Every estimator works on the rewards of one group (one task's samples) as the selection left it:

- ``grpo``: ``(r - mean) / (std + epsilon)`` with the sample standard deviation (n - 1, as ``torch.std``);
  with ``normalize_std`` off, ``r - mean``. A group of one has std 0, so its advantage is 0.
- ``rloo``: ``r - mean of the other samples`` = ``r - (sum - r) / (n - 1)``; 0 for a group of one.
- ``none``: the reward itself (no baseline), for trainers that compute their own advantages.

A NULL reward gives a NULL advantage and does not count in its group's statistics.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AdvantageKind(enum.StrEnum):
    """How the ``advantage`` column is computed from a group's rewards."""

    GRPO = "grpo"
    """Group-normalised: (r - mean) / (std + epsilon), or r - mean without std normalisation."""
    RLOO = "rloo"
    """Leave-one-out baseline: r minus the mean reward of the group's other samples."""
    NONE = "none"
    """No baseline: the advantage is the reward."""


@dataclass(frozen=True)
class AdvantageSpec:
    """Which estimator and its knobs."""

    kind: AdvantageKind = AdvantageKind.GRPO
    epsilon: float = 1e-6
    """Added to the group's std before dividing (grpo with ``normalize_std``)."""
    normalize_std: bool = True
    """grpo only: divide by the group's std (Dr. GRPO and others turn this off)."""

    def __post_init__(self) -> None:
        if self.epsilon < 0:
            raise ValueError(f"advantage epsilon must be >= 0, got {self.epsilon}")

    def sql(self, reward: str, mean: str, std: str, total: str, count: str) -> str:
        """The SQL expression of one row's advantage, given its reward and its group's aggregates' expressions."""
        if self.kind is AdvantageKind.NONE:
            return reward
        if self.kind is AdvantageKind.RLOO:
            return f"CASE WHEN {count} > 1 THEN {reward} - ({total} - {reward}) / ({count} - 1) ELSE 0.0 END"
        if self.normalize_std:
            return f"({reward} - {mean}) / (coalesce({std}, 0.0) + %(adv_epsilon)s)"
        return f"{reward} - {mean}"

    def describe(self) -> str:
        if self.kind is AdvantageKind.GRPO:
            return f"grpo(eps={self.epsilon:g}, std={'on' if self.normalize_std else 'off'})"
        return str(self.kind)
