"""The admission rule (rollout_ledger/services/scheduler/admission.py): the staleness gap, the run-ahead limit, its
base, whole groups, and the reason given for what is held."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rollout_ledger.services.scheduler.admission import Bound, Versions, bound_of, decide
from rollout_ledger.shared.policy_versions import WorkerPolicyReport, WorkerPolicyState


def report(worker: str, serving: int | None) -> WorkerPolicyReport:
    return WorkerPolicyReport(worker_id=worker, serving=serving, version=serving or 0,
                              state=WorkerPolicyState.SERVING, time=datetime.now(UTC))


def test_versions_take_the_lowest_serving_worker_and_the_newest_announcement() -> None:
    v = Versions.of(5, [report("a", 5), report("b", 3), report("c", None)])
    assert (v.current, v.serving, v.gap) == (5, 3, 2)
    assert Versions.of(None, []) == Versions(0, 0), "nothing announced, nobody serving: version 0, no gap"
    assert Versions.of(2, []) == Versions(2, 2), "no live worker: one that starts serves the announced version"
    assert Versions.of(1, [report("a", 4)]) == Versions(4, 4), "workers on a version nobody announced count"


def test_the_gap_holds_everything_while_workers_lag_more_than_k() -> None:
    bound = Bound(max_staleness=1, episodes_per_version=None, base_version=0, group_size=2)
    held = decide(bound, Versions(current=3, serving=1), admitted=0, waiting=8)
    assert held.admit == 0 and "2 behind the announced 3" in (held.held or "")
    ok = decide(bound, Versions(current=3, serving=2), admitted=0, waiting=8)
    assert (ok.admit, ok.limit, ok.held) == (8, None, None), "no run-ahead bound: every waiting episode starts"


@pytest.mark.parametrize(("k", "current", "admitted", "expected_limit", "expected_admit"), [
    (0, 0, 0, 4, 4),     # on-policy: one step's episodes at the base version
    (0, 0, 4, 4, 0),     # ... and no more until the trainer pushes the next version
    (0, 1, 4, 8, 4),     # version 1 pushed (and served): the next step's
    (1, 0, 0, 8, 8),     # k = 1: two steps ahead of the trainer
    (1, 2, 8, 16, 8),
    (2, 0, 6, 12, 6),
])
def test_run_ahead_is_current_minus_base_plus_k_plus_one_steps(k: int, current: int, admitted: int,
                                                               expected_limit: int, expected_admit: int) -> None:
    bound = Bound(max_staleness=k, episodes_per_version=4, base_version=0, group_size=2)
    d = decide(bound, Versions(current=current, serving=current), admitted=admitted, waiting=100)
    assert (d.limit, d.admit) == (expected_limit, expected_admit)
    if expected_admit == 0:
        assert d.held is not None and "run-ahead" in d.held and f"limit at version {current}" in d.held


def test_the_base_is_the_version_announced_when_the_batch_was_stored() -> None:
    bound = Bound(max_staleness=0, episodes_per_version=4, base_version=7, group_size=4)
    assert decide(bound, Versions(7, 7), admitted=0, waiting=12).admit == 4
    assert decide(bound, Versions(9, 9), admitted=4, waiting=8).admit == 8, "two pushes since: two more steps"


def test_only_whole_groups_start() -> None:
    bound = Bound(max_staleness=0, episodes_per_version=6, base_version=0, group_size=4)
    d = decide(bound, Versions(0, 0), admitted=0, waiting=16)
    assert d.admit == 4, "room for 6, but a group of 4 starts whole or not at all"
    assert decide(bound, Versions(0, 0), admitted=4, waiting=12).admit == 0


def test_nothing_waiting_holds_nothing() -> None:
    bound = Bound(max_staleness=0, episodes_per_version=2, base_version=0, group_size=2)
    assert decide(bound, Versions(0, 0), admitted=2, waiting=0).held is None


def test_a_batch_without_k_is_unbounded() -> None:
    row = {"max_staleness": None, "episodes_per_version": None, "admission_base_version": None, "group_size": 2}
    assert bound_of(row) is None
    row.update(max_staleness=1, episodes_per_version=4, admission_base_version=3)
    assert bound_of(row) == Bound(1, 4, 3, 2)
