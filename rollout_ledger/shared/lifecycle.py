"""The episode lifecycle: statuses and the only table of legal transitions.

Every writer of ``episodes.status`` goes through ``allowed_sources`` (used in SQL ``WHERE status = ANY``),
so an illegal or out-of-order transition is a no-op, never a corruption.
"""

from __future__ import annotations

import enum


class EpisodeStatus(enum.StrEnum):
    """Where an episode is in its life."""

    WAITING = "waiting"
    """Stored by the scheduler and held by admission: its batch bounds staleness (``max_staleness``) and the bound
    does not let it start yet. It has no work item (services/scheduler/admission.py)."""
    REQUESTED = "requested"
    """Stored by the scheduler and on the work queue."""
    RUNNING = "running"
    """An env worker started an attempt."""
    COMPLETED = "completed"
    """Finished: the environment terminated it."""
    TRUNCATED = "truncated"
    """Finished: cut by max_turns or the context length."""
    ABORTED = "aborted"
    """Finished: the environment or agent gave up."""
    FAILED = "failed"
    """Ended by a failure (see failure_class)."""
    CANCELLED = "cancelled"
    """Its batch was cancelled."""


S = EpisodeStatus

FINISHED: frozenset[EpisodeStatus] = frozenset({S.COMPLETED, S.TRUNCATED, S.ABORTED})
"""Statuses of episodes that ended with a trajectory of their own (not failed, not cancelled)."""
TERMINAL: frozenset[EpisodeStatus] = FINISHED | {S.FAILED, S.CANCELLED}
"""Statuses an episode never leaves."""

TRANSITIONS: dict[EpisodeStatus, frozenset[EpisodeStatus]] = {
    # admission moves WAITING -> REQUESTED (and publishes its work item); a cancel ends it
    S.WAITING: frozenset({S.REQUESTED, S.FAILED, S.CANCELLED}),
    S.REQUESTED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED}),
    # RUNNING -> RUNNING is a new attempt after a crashed worker's redelivery.
    S.RUNNING: frozenset({S.RUNNING, S.COMPLETED, S.TRUNCATED, S.ABORTED, S.FAILED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.TRUNCATED: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
"""Legal moves: from a status to the statuses it may become."""


def can_transition(src: EpisodeStatus, dst: EpisodeStatus) -> bool:
    return dst in TRANSITIONS[src]


def allowed_sources(dst: EpisodeStatus) -> list[str]:
    """The statuses from which ``dst`` may be entered, for ``UPDATE ... WHERE status = ANY(:sources)``."""
    return [str(src) for src, dsts in TRANSITIONS.items() if dst in dsts]
