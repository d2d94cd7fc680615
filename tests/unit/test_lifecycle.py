"""The lifecycle table: terminal states are final, a new attempt may restart a running episode."""

from __future__ import annotations

import pytest

from rollout_ledger.shared.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    EpisodeStatus,
    allowed_sources,
    can_transition,
)

S = EpisodeStatus


def test_every_status_has_a_row() -> None:
    assert set(TRANSITIONS) == set(EpisodeStatus)


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
def test_terminal_is_final(terminal: EpisodeStatus) -> None:
    assert TRANSITIONS[terminal] == frozenset()
    for dst in EpisodeStatus:
        assert not can_transition(terminal, dst), f"{terminal} -> {dst}"


def test_happy_path_and_retry() -> None:
    assert can_transition(S.REQUESTED, S.RUNNING)
    assert can_transition(S.RUNNING, S.RUNNING)  # redelivered attempt
    assert can_transition(S.RUNNING, S.COMPLETED)
    assert not can_transition(S.REQUESTED, S.COMPLETED)
    assert not can_transition(S.COMPLETED, S.RUNNING)


def test_a_waiting_episode_is_admitted_or_ends_but_never_starts_directly() -> None:
    assert can_transition(S.WAITING, S.REQUESTED)
    assert can_transition(S.WAITING, S.CANCELLED)
    assert not can_transition(S.WAITING, S.RUNNING), "it has no work item: nothing can start it"
    assert not can_transition(S.REQUESTED, S.WAITING)


def test_allowed_sources_for_sql() -> None:
    assert sorted(allowed_sources(S.RUNNING)) == ["requested", "running"]
    assert sorted(allowed_sources(S.CANCELLED)) == ["requested", "running", "waiting"]
    assert allowed_sources(S.REQUESTED) == ["waiting"], "only admission makes an episode requested"
    assert allowed_sources(S.COMPLETED) == ["running"]
