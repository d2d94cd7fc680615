"""The group advantages of rollout_ledger/client/advantages.py computed in numpy, one group at a time: the reference the
exporter's SQL is tested against (tests/unit/test_export_records.py, tests/integration/test_export_selection.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollout_ledger.client.advantages import AdvantageKind, AdvantageSpec


def group_advantages(rewards: Sequence[float | None], spec: AdvantageSpec) -> list[float | None]:
    """The advantages of one group's rewards (the reference the SQL is tested against)."""
    present = np.array([r for r in rewards if r is not None], dtype=np.float64)
    n = len(present)
    out: list[float | None] = []
    for r in rewards:
        if r is None:
            out.append(None)
        elif spec.kind is AdvantageKind.NONE:
            out.append(float(r))
        elif spec.kind is AdvantageKind.RLOO:
            out.append(float(r - (present.sum() - r) / (n - 1)) if n > 1 else 0.0)
        else:
            mean = float(present.mean())
            if not spec.normalize_std:
                out.append(float(r - mean))
            else:
                std = float(present.std(ddof=1)) if n > 1 else 0.0
                out.append(float((r - mean) / (std + spec.epsilon)))
    return out
