"""Rolling upgrades: old and new pods side by side lose nothing.

- Workers of the previous release (its own code, taken from git at ``PREVIOUS_RELEASE``) run beside this release's
  workers on one bus and one store: every episode ends, token-exact, nothing dead-lettered, both generations did
  work. Move ``PREVIOUS_RELEASE`` forward at each release (to the last commit of the previous one).
- A newer producer's events (extra optional fields at this major) are stored as if the fields were not there.
- An event or work item of a newer major is parked, counted and kept, never dead-lettered or terminated.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import msgpack
import pytest

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.migrations.runner import downgrade, upgrade
from rollout_ledger.shared.db import EXPAND_REVISION
from rollout_ledger.shared.events import SCHEMA_VERSION, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    EVENTS_STREAM,
    MSG_ID_HEADER,
    RECORDER_CONSUMER,
    WORK_STREAM,
    WORK_SUBJECT,
    event_subject,
)
from tests.helpers import Sql, metric, until
from tests.integration.test_pipeline import check_token_exact, submit_and_wait
from tests.integration.test_recorder import episode_events, seed_episodes

PREVIOUS_RELEASE = "a71684c19b104cfb5aa0af25cc78d875ae45004b"
"""The last commit of the previous release: the contract the workers of the previous release speak."""
PREVIOUS_SCHEMA = "0008"
"""That release's database revision (its services refuse to start on any other)."""

ROOT = Path(__file__).resolve().parents[2]


def previous_release(tmp_path: Path) -> str:
    """A PYTHONPATH under which ``rollout_ledger`` is the previous release's code (its own package layout)."""
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.fail(f"commit {PREVIOUS_RELEASE} (the previous release) is not in this clone: "
                    "the rolling-upgrade test needs the project's history (a full clone)")
    src = tmp_path / "previous"
    src.mkdir()
    archive = tmp_path / "previous.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", f"--output={archive}", PREVIOUS_RELEASE,
                    "shared", "services", "migrations"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    pkg = tmp_path / "previous-pkg" / "rollout_ledger"
    pkg.mkdir(parents=True)
    for name in ("shared", "services", "migrations"):
        (pkg / name).symlink_to(src / name)
    (pkg / "__init__.py").write_text("")  # a regular package: found before this checkout's rollout_ledger/
    return str(pkg.parent)


def previous(service: str) -> tuple[str, ...]:
    """The previous release's service. ``-P``: the working directory (this checkout, whose ``rollout_ledger/`` is
    this release) is not put before ``PYTHONPATH``."""
    return (sys.executable, "-P", "-m", "rollout_ledger.services.cli", "serve", service)


def test_previous_release_workers_beside_current_ones_lose_nothing(stack: Stack, database_url: str,
                                                                    tmp_path: Path) -> None:
    """The order of a real rolling upgrade: the previous release runs on its schema, the migrations Job brings the
    database to this release's expand revision (an old pod already running is unaffected), this release's pods
    start beside the old ones, and a batch runs across both generations. Then the old pods are gone, the contract
    revision partitions trajectories under the running new pods, and a batch runs on them.

    The batch goes through the previous release's scheduler, which queues work on the single subject
    ``rl.work.episodes``: this release's env workers pull that subject too (routing's legacy consumer), so both
    generations run it. A batch through this release's scheduler is routed per env (``rl.work.episodes.<route>``),
    which only this release's env workers pull: it runs on them."""
    old = previous_release(tmp_path)
    downgrade(database_url, PREVIOUS_SCHEMA)
    old_scheduler = stack.start("scheduler", name="scheduler-old", command=previous("scheduler"), PYTHONPATH=old,
                                DATABASE_URL=database_url)
    old_inf = stack.start("inference-worker", name="inference-old", command=previous("inference-worker"),
                          PYTHONPATH=old, ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="0.01")
    old_env = stack.start("env-worker", name="env-old", command=previous("env-worker"), PYTHONPATH=old,
                          ROLLOUT_CONCURRENCY="4", ROLLOUT_FETCH_BATCH="1")
    # the previous release predates the per-service logins (migration 0012): its pods keep the DSN they ran with
    old_recorder = stack.start("recorder", name="recorder-old", command=previous("recorder"), PYTHONPATH=old,
                               ROLLOUT_BATCH_SIZE="16", DATABASE_URL=database_url)
    upgrade(database_url, EXPAND_REVISION)  # the migrations Job of this release (docs/deploy.md, "Upgrading")
    new_inf = stack.start("inference-worker", name="inference-new", ROLLOUT_ENGINE="fake",
                          ROLLOUT_FAKE_DELAY_S="0.01")
    new_env = stack.start("env-worker", name="env-new", ROLLOUT_CONCURRENCY="4", ROLLOUT_FETCH_BATCH="1")
    stack.start("recorder", name="recorder-new", ROLLOUT_BATCH_SIZE="16")
    url = stack.start("scheduler").url

    info = submit_and_wait(old_scheduler.url, timeout_s=120, env="guess-number",
                           tasks=[{"seed": i} for i in range(12)], group_size=4, max_turns=4,
                           sampling={"temperature": 1.0, "max_tokens": 16})
    assert info["num_episodes"] == 48 and info["done"]
    routed = submit_and_wait(url, timeout_s=60, env="guess-number", tasks=[{"seed": i} for i in range(4)],
                             group_size=2, max_turns=4, sampling={"temperature": 1.0, "max_tokens": 16})
    assert routed["num_episodes"] == 8 and routed["done"]
    sql = Sql(database_url)
    try:
        batch_id = str(info["batch_id"])
        statuses = {r["status"]: r["n"] for r in sql.rows("select status, count(*) as n from episodes group by 1")}
        assert set(statuses) <= {"completed", "truncated"} and sum(statuses.values()) == 56, statuses
        assert check_token_exact(sql, batch_id) == 48
        assert check_token_exact(sql, str(routed["batch_id"])) == 8
        assert sql.scalar("select count(*) from dead_letters") == 0
        assert sql.scalar("select count(*) from attempt_failures") == 0
        env_workers = {r["worker_id"] for r in sql.rows("select distinct worker_id from episodes where batch_id = :b",
                                                        b=batch_id)}
        assert env_workers == {"env-new", "env-old"}, "both generations of env workers ran episodes"
        routed_workers = {r["worker_id"] for r in sql.rows("select distinct worker_id from episodes where batch_id "
                                                           "= :b and worker_id is not null", b=str(routed["batch_id"]))}
        assert routed_workers == {"env-new"}, "routed work reaches this release's env workers"
        inference = {r["worker_id"] for r in sql.rows("select distinct worker_id from turns")}
        assert inference == {"inference-new", "inference-old"}, "both generations of inference workers served"
        for proc in (new_inf, old_inf, new_env, old_env, old_scheduler):
            assert proc.alive, f"{proc.name} died"

        # the rollout is done: no pod of the previous release runs; the contract revision, under the new pods
        for proc in (old_scheduler, old_env, old_inf, old_recorder):
            assert proc.stop() == 0, f"{proc.name} did not drain"
        upgrade(database_url)
        assert sql.scalar("select relkind from pg_class where oid = 'trajectories'::regclass") == "p"
        after = submit_and_wait(url, timeout_s=60, env="guess-number", tasks=[{"seed": i} for i in range(4)],
                                group_size=2, max_turns=4, sampling={"temperature": 1.0, "max_tokens": 16})
        assert after["num_episodes"] == 8 and after["done"]
        assert check_token_exact(sql, str(after["batch_id"])) == 8
        assert sql.scalar("select count(*) from trajectories") == 64
        assert sql.scalar("select count(*) from dead_letters") == 0
        for proc in (new_inf, new_env):
            assert proc.alive, f"{proc.name} died"
    finally:
        sql.close()


def _with_extra_fields(event: Any) -> bytes:
    raw = msgpack.unpackb(encode(event), timestamp=3, strict_map_key=False)
    raw["policy_version"] = 4  # what a newer producer of this major might add
    raw["trace"] = {"id": "abc", "spans": [1, 2]}
    return msgpack.packb(raw, datetime=True)


async def test_a_newer_producers_extra_fields_are_stored_as_known(stack: Stack, nc: bus.NATS,
                                                                 database_url: str) -> None:
    sql = Sql(database_url)
    try:
        (eid,) = seed_episodes(sql, "extra")
        rec = stack.start("recorder")
        js = nc.jetstream()
        for ev in episode_events(eid, [([10, 11], [2, 50, 1]), ([12], [3])]):
            await js.publish(event_subject(ev.type), _with_extra_fields(ev),  # type: ignore[attr-defined]
                             headers={MSG_ID_HEADER: ev.event_id})  # type: ignore[attr-defined]
        await until(lambda: sql.scalar("select count(*) from trajectories") == 1, 30, "the trajectory")
        assert sql.scalar("select status from episodes where id = :e", e=eid) == "completed"
        assert sql.scalar("select num_tokens from trajectories") == 8 + 2 + 3 + 1 + 1
        assert sql.scalar("select count(*) from dead_letters") == 0
        assert metric(rec.url, "rollout_recorder_newer_contract_total") == 0
    finally:
        sql.close()


async def test_events_and_work_items_of_a_newer_major_are_parked_not_dead_lettered(
        stack: Stack, nc: bus.NATS, database_url: str) -> None:
    sql = Sql(database_url)
    try:
        (eid,) = seed_episodes(sql, "newer")
        rec = stack.start("recorder", ROLLOUT_PARK_DELAY_S="0.3")
        env = stack.start("env-worker", ROLLOUT_PARK_DELAY_S="0.3")
        js = nc.jetstream()
        started = episode_events(eid, [([10, 11], [2, 50, 1])])[0]
        raw = msgpack.unpackb(encode(started), timestamp=3, strict_map_key=False)
        raw["schema_version"] = SCHEMA_VERSION + 1
        raw["prompt"] = raw.pop("prompt_token_ids")  # a breaking change this recorder cannot read
        await js.publish(event_subject("episode.started"), msgpack.packb(raw, datetime=True),
                         headers={MSG_ID_HEADER: "newer:started"})
        work = {"type": "episode.requested", "schema_version": SCHEMA_VERSION + 1, "event_id": "newer.0.0:requested",
                "episode_id": "newer.0.0", "batch_id": "newer", "what_v2_needs": {"x": 1}}
        await js.publish(WORK_SUBJECT, msgpack.packb(work), headers={MSG_ID_HEADER: "newer.0.0:requested"})

        await until(lambda: metric(rec.url, "rollout_recorder_newer_contract_total") >= 3, 30,
                    "the recorder to park the event again and again")
        await until(lambda: metric(env.url, "rollout_work_items_parked_total") >= 3, 30,
                    "the env worker to hand the work item back again and again")
        # Parked three times and more, yet no max-deliveries advisory (max_deliver is 3): hand-backs spend no
        # deliveries, so the recorder stored no work item as a dead letter and failed no episode.
        assert sql.scalar("select count(*) from dead_letters") == 0, "a newer event is not garbage"
        assert sql.scalar("select count(*) from attempt_failures") == 0
        assert sql.scalar("select status from episodes where id = :e", e=eid) == "requested"
        work_state = (await js.stream_info(WORK_STREAM)).state
        assert work_state.messages == 1, "the work item is still on the queue, for an upgraded worker"
        recorder = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
        assert recorder.ack_floor.stream_seq == 0, "the parked event was never acked"
        assert rec.alive and env.alive
    finally:
        sql.close()
