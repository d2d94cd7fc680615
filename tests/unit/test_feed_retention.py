"""The retention period of `rollout feed prune --older-than` (rollout_ledger/services/exporter/retention.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from rollout_ledger.services.exporter.retention import RetentionError, parse_age


@pytest.mark.parametrize(("text", "want"), [("7d", dt.timedelta(days=7)), ("12h", dt.timedelta(hours=12)),
                                            ("30m", dt.timedelta(minutes=30)), (" 90s ", dt.timedelta(seconds=90)),
                                            ("2w", dt.timedelta(weeks=2)), ("1.5d", dt.timedelta(hours=36))])
def test_retention_periods(text: str, want: dt.timedelta) -> None:
    assert parse_age(text) == want


@pytest.mark.parametrize("text", ["", "7", "0d", "-1d", "7 days", "d", "1y"])
def test_bad_retention_periods(text: str) -> None:
    with pytest.raises(RetentionError, match="positive number"):
        parse_age(text)
