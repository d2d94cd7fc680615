"""Policy versions on the scheduler: the records a trainer's announcements leave in Postgres, the durable
announcement on the bus (``rl_policy`` / ``current``), the workers' reports read back from ``rl_policy_workers``
and mirrored into ``policy_worker_states``.

A version is written once (idempotent on the version: the same request again is the same record; another request
for an existing version is refused) and versions only increase. The announcement is put after the row commits, by
compare-and-set, and never moves the current version backwards (two trainers announcing at once, or a retried
older request). A POST retried after the announcement failed announces again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from rollout_ledger.services.scheduler.batch_store import store_errors
from rollout_ledger.services.scheduler.env_registry import bucket_keys
from rollout_ledger.services.scheduler.schemas import PolicyVersionCreate
from rollout_ledger.shared.db import policy_versions, policy_worker_states, row_dict
from rollout_ledger.shared.errors import BusError, SchemaError
from rollout_ledger.shared.kit.bus import NATS_FAILURES, as_bus_error, best_effort, bus_errors
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.policy_bus import parse_announcement
from rollout_ledger.shared.kit.runtime import sleep_or_stop
from rollout_ledger.shared.policy_versions import PolicyAnnouncement, WorkerPolicyReport, WorkerPolicyState, read_value
from rollout_ledger.shared.subjects import POLICY_KEY, POLICY_WORKERS_BUCKET

log = get_logger(__name__)

_LOCK = "rollout-ledger:policy_versions"
"""Advisory lock name serialising announcements (the max-version check and the insert)."""


class VersionConflict(Exception):
    """The request cannot be recorded: the version exists with other values, or is not above the newest."""


def request_hash(body: PolicyVersionCreate) -> str:
    return hashlib.sha256(orjson.dumps(body.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass(frozen=True)
class Recorded:
    row: dict[str, Any]
    created: bool
    newest: bool
    """The version is the newest recorded (so it is the one to announce)."""


async def record_version(engine: AsyncEngine, body: PolicyVersionCreate) -> Recorded:
    """Insert the version, or return the identical existing one; ``VersionConflict`` otherwise."""
    rhash = request_hash(body)
    with store_errors("recording a policy version"):
        async with engine.begin() as conn:
            await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": _LOCK})
            newest = (await conn.execute(select(func.max(policy_versions.c.version)))).scalar()
            existing = (await conn.execute(
                select(policy_versions).where(policy_versions.c.version == body.version))).first()
            if existing is not None:
                row = row_dict(existing)
                if row["request_hash"] != rhash:
                    raise VersionConflict(
                        f"version {body.version} was announced already with checkpoint {row['checkpoint']!r}, "
                        f"mode {row['mode']!r}: a version never changes (announce {int(newest) + 1} instead)")
                return Recorded(row, created=False, newest=body.version == newest)
            if newest is not None and body.version <= newest:
                raise VersionConflict(f"versions only increase: the newest is {newest}, so {body.version} "
                                      f"cannot be announced (use {int(newest) + 1} or more)")
            inserted = (await conn.execute(pg_insert(policy_versions).values(
                version=body.version, checkpoint=body.checkpoint, mode=str(body.mode), notes=body.notes,
                request_hash=rhash).returning(*policy_versions.c))).one()
            return Recorded(row_dict(inserted), created=True, newest=True)


def announcement_of(row: dict[str, Any]) -> PolicyAnnouncement:
    return PolicyAnnouncement(version=row["version"], checkpoint=row["checkpoint"], mode=row["mode"],
                              notes=row["notes"], created_at=row["created_at"])


async def announce(kv: KeyValue, announcement: PolicyAnnouncement, tries: int = 10) -> bool:
    """Make ``announcement`` the current version unless a newer one is (compare-and-set); True if it is now."""
    value = orjson.dumps(announcement.model_dump(mode="json"))
    for _ in range(tries):
        with bus_errors(f"announce policy version {announcement.version}"):
            try:
                entry = await kv.get(POLICY_KEY)
            except KeyNotFoundError:
                entry = None
            current = parse_announcement(entry.value if entry is not None else None)
            if current is not None and current.version >= announcement.version:
                return current.version == announcement.version
            try:
                if entry is None:
                    await kv.create(POLICY_KEY, value)
                else:
                    await kv.update(POLICY_KEY, value, last=entry.revision)
                return True
            except KeyWrongLastSequenceError:
                pass  # another announcement won the race: read it and decide again
        await asyncio.sleep(0.01)
    raise BusError(f"cannot announce policy version {announcement.version}: the current version kept changing")


async def current_version(conn: AsyncConnection) -> dict[str, Any] | None:
    row = (await conn.execute(select(policy_versions).order_by(policy_versions.c.version.desc()).limit(1))).first()
    return row_dict(row) if row is not None else None


async def worker_reports(kv: KeyValue, js: JetStreamContext) -> list[WorkerPolicyReport]:
    """Every inference worker's latest report (a worker that stopped reporting expires with the bucket's TTL).

    The keys come from the bucket stream's subjects (``envs.bucket_keys``), not ``kv.keys()``: its watcher can
    report the bucket empty before its first entry arrives, and no reports read as "no live worker", which lets
    admission start episodes that a lagging worker should hold back."""
    keys = await bucket_keys(js, POLICY_WORKERS_BUCKET)
    reports = []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        except NATS_FAILURES as exc:
            raise as_bus_error(exc, f"read the policy report of {key}") from exc
        report = parse_report(entry.value)
        if report is not None:
            reports.append(report)
    return reports


def parse_report(value: bytes | None) -> WorkerPolicyReport | None:
    try:
        return read_value(WorkerPolicyReport, value)
    except SchemaError as exc:
        log.warning("policy.bad_worker_report", error=str(exc))
        return None


async def in_flight_by_version(conn: AsyncConnection) -> dict[str, int]:
    """Running episodes by the weight version of their latest kept turn (``none``: no turn yet)."""
    rows = await conn.execute(text("""
        SELECT coalesce(t.weight_version::text, 'none') AS version, count(*) AS n
        FROM episodes e
        LEFT JOIN LATERAL (
            SELECT weight_version FROM turns
            WHERE episode_id = e.id AND attempt = e.attempt AND NOT superseded
            ORDER BY turn_index DESC LIMIT 1) t ON true
        WHERE e.status = 'running'
        GROUP BY 1 ORDER BY 1"""))
    return {r.version: int(r.n) for r in rows}


async def mirror_report(engine: AsyncEngine, report: WorkerPolicyReport) -> None:
    """Upsert the report's (version, worker) row; an older report of the same pair changes nothing."""
    stmt = pg_insert(policy_worker_states).values(
        version=report.version, worker_id=report.worker_id, state=str(report.state), error=report.error,
        engine=report.engine, reported_at=report.time)
    stmt = stmt.on_conflict_do_update(
        index_elements=[policy_worker_states.c.version, policy_worker_states.c.worker_id],
        set_={"state": stmt.excluded.state, "error": stmt.excluded.error, "engine": stmt.excluded.engine,
              "reported_at": stmt.excluded.reported_at, "updated_at": func.now()},
        where=policy_worker_states.c.reported_at <= stmt.excluded.reported_at)
    with store_errors("mirroring a worker's policy report"):
        async with engine.begin() as conn:
            await conn.execute(stmt)
            if report.serving is not None:
                # a worker serving version v has retired every older one it served, whether or not its explicit
                # "retired" report reached us (the bucket keeps one value per worker: a watcher can miss one)
                await conn.execute(
                    update(policy_worker_states)
                    .where(policy_worker_states.c.worker_id == report.worker_id,
                           policy_worker_states.c.version < report.serving,
                           policy_worker_states.c.state == str(WorkerPolicyState.SERVING),
                           policy_worker_states.c.reported_at <= report.time)
                    .values(state=str(WorkerPolicyState.RETIRED), updated_at=func.now()))


async def run_mirror(kv: KeyValue, engine: AsyncEngine, stop: asyncio.Event, retry_s: float = 1.0,
                     on_report: Callable[[], None] | None = None) -> None:
    """Until ``stop``: every report put into ``rl_policy_workers`` becomes a row of ``policy_worker_states`` (and
    calls ``on_report``). A lost watch (NATS restarting) is opened again; it replays the latest report of every
    worker first."""
    while not stop.is_set():
        try:
            await _mirror_once(kv, engine, stop, on_report)
        except Exception as exc:  # nats-py errors share no base class: watch again after a pause
            log.warning("policy.mirror_watch_lost", error=f"{type(exc).__name__}: {exc}")
            await sleep_or_stop(stop, retry_s)


async def _mirror_once(kv: KeyValue, engine: AsyncEngine, stop: asyncio.Event,
                       on_report: Callable[[], None] | None) -> None:
    watcher = await kv.watchall()
    try:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=1.0)
            except TimeoutError:  # nats-py's timeout is a TimeoutError too
                continue
            if entry is None or entry.value is None:
                continue
            report = parse_report(entry.value)
            if report is None:
                continue
            try:
                await mirror_report(engine, report)
            except Exception as exc:  # a lost mirror write is repaired by the worker's next report
                log.warning("policy.mirror_failed", worker=report.worker_id, error=str(exc))
            if on_report is not None:
                on_report()
    finally:
        with best_effort("stop the policy watcher"):
            await watcher.stop()
