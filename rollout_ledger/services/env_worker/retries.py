"""Per-class retry budgets: whether a failed episode attempt runs again, and the work item of that next attempt.

Design note. Each failure class has its own budget of further attempts (``EnvWorkerSettings.retry_<class>``);
``infra`` is not counted here: a worker that dies never reports, and JetStream redelivers its work item up to
``max_deliver`` times (then the recorder fails the episode, class ``infra``). An attempt that fails with class
``c`` runs again when the failure is retryable (a remote env unreachable, no inference worker answered, a
deadline passed; not a bad task, a 4xx, or an env's own exception) and fewer than ``budget[c]`` attempts have
failed with ``c`` so far.

The next attempt is a fresh work item, published before the old one is acked: the old item's copy with
``attempt_base`` = the failed attempt and ``failures`` counting the failure, under ``Nats-Msg-Id``
``{episode_id}:requested:a{next}``. An env worker runs a work item as attempt ``attempt_base + delivery count``,
so the retried attempt is ``n + 1`` and every event id stays unique; a crash of the worker running it is
still redelivered by JetStream as ``n + 2``, ``n + 3``, ...

If publishing the next item fails, the old item is handed back instead (nak): its redelivery runs attempt
``n + 1`` with the old counts, so the episode still gets its attempt. If the worker dies after publishing the
next item and before acking the old one, both run as attempt ``n + 1``; they share event ids, JetStream's
dedupe window keeps one event of each id, and the recorder's token-count check fails the episode (``infra``)
when the stored mix does not assemble. That window is two round trips wide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rollout_ledger.shared.events import EpisodeRequested, FailureClass, utcnow
from rollout_ledger.shared.ids import retry_requested_id


@dataclass(frozen=True)
class RetryBudgets:
    """Further attempts allowed per failure class (a class not named has none)."""

    budgets: Mapping[FailureClass, int] = field(default_factory=dict)

    def allows(self, item: EpisodeRequested, failure_class: FailureClass, retryable: bool) -> bool:
        """Whether an attempt of ``item`` that failed with ``failure_class`` gets another attempt."""
        if not retryable or failure_class is FailureClass.INFRA:
            return False
        return item.failures.get(str(failure_class), 0) < self.budgets.get(failure_class, 0)

    def next_item(self, item: EpisodeRequested, attempt: int, failure_class: FailureClass) -> EpisodeRequested:
        """The work item of the attempt after ``attempt`` (which failed with ``failure_class``)."""
        failures = dict(item.failures)
        failures[str(failure_class)] = failures.get(str(failure_class), 0) + 1
        return item.model_copy(update={
            "event_id": retry_requested_id(item.episode_id, attempt + 1), "attempt": attempt + 1,
            "attempt_base": attempt, "failures": failures, "time": utcnow()})
