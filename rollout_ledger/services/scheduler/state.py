"""What one scheduler app holds: settings, health, metrics, and the clients its lifespan opens."""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js.kv import KeyValue
from sqlalchemy.ext.asyncio import AsyncEngine

from rollout_ledger.services.scheduler.admission import Admission
from rollout_ledger.services.scheduler.metrics import SchedulerMetrics
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.services.scheduler.trajectory_view import TokenizerCache
from rollout_ledger.services.scheduler.work_items import WorkItemPublisher
from rollout_ledger.shared.kit.bus import NATS, JetStreamContext
from rollout_ledger.shared.kit.runtime import Health


@dataclass
class Resources:
    """Clients opened by the app's lifespan and closed when it ends."""

    nc: NATS
    js: JetStreamContext
    engine: AsyncEngine
    envs_kv: KeyValue
    cancel_kv: KeyValue
    publisher: WorkItemPublisher
    policy_kv: KeyValue
    """``rl_policy``: the announced policy version."""
    policy_workers_kv: KeyValue
    """``rl_policy_workers``: each inference worker's report."""
    admission: Admission
    """Moves bounded batches' waiting episodes to the work queue when the staleness bound allows."""


@dataclass
class SchedulerState:
    """Per-app state (``app.state.scheduler``); ``resources`` is None outside the lifespan."""

    settings: SchedulerSettings
    health: Health
    metrics: SchedulerMetrics
    tokenizers: TokenizerCache
    resources: Resources | None = None
    db_ok: bool = False
    """Last outcome of a database round trip (the outbox pass), for /readyz."""
    startup_error: Exception | None = field(default=None, repr=False)
    """Why the lifespan refused to start (e.g. an old schema), for ``main`` to report."""
