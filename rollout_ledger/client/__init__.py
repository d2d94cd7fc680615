"""The trainer's side of the ledger, installable without vLLM or torch (``pip install 'rollout-ledger[client]'``):
``LedgerClient`` (the scheduler's REST API), ``TrajectoryReader`` (a consumer's trajectories, exactly once) and the
record shapes each trainer takes; ``rollout_ledger.client.adapters`` plugs them into TRL, verl and slime.

    from rollout_ledger.client import LedgerClient, Selection, TrajectoryReader
"""

from __future__ import annotations

from rollout_ledger.client.reader import (
           AdvantageKind,
           AdvantageSpec,
           Batch,
           RewardChoice,
           Selection,
           TrajectoryReader,
           Unit,
)
from rollout_ledger.client.rest import LedgerClient, SchedulerError

__all__ = ["AdvantageKind", "AdvantageSpec", "Batch", "LedgerClient", "RewardChoice", "SchedulerError", "Selection",
           "TrajectoryReader", "Unit"]
