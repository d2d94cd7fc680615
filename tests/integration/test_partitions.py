"""Time partitions and their archive on real Postgres (migration 0016, rollout_ledger/services/exporter/archive.py):
rows land in their month's partition, a redelivered event is still stored once, and an archived period's trajectories
come back from `rollout export` and ``TrajectoryReader.archived`` exactly as before it was archived."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.client.archived import ENDPOINT_ENV, open_location
from rollout_ledger.client.reader import TrajectoryReader
from rollout_ledger.client.selection import Selection
from rollout_ledger.migrations.runner import downgrade, upgrade
from rollout_ledger.services.exporter.archive import archive
from rollout_ledger.services.exporter.export import export
from rollout_ledger.shared.db import SCHEMA_REVISION
from rollout_ledger.shared.events import decode, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import event_subject
from tests.helpers import Sql, until
from tests.integration.export_data import Traj, run, seed_batch, seed_turns
from tests.integration.test_recorder import (
    drained,
    episode_events,
    publish,
    recorder,
    seed_episodes,
    settings_for,
)

MONTHS_BACK = 4


def _month(months_back: int) -> dt.datetime:
    """The middle of the month ``months_back`` before this one (UTC; negative: after it)."""
    first = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    for _ in range(months_back):
        first = (first - dt.timedelta(days=1)).replace(day=1)
    for _ in range(-months_back):
        first = (first + dt.timedelta(days=32)).replace(day=1)
    return first.replace(day=14, hour=10)


def _partition_of(url: str, table: str, where: str) -> set[str]:
    return {str(r[0]) for r in run(url, f"SELECT DISTINCT tableoid::regclass::text FROM {table} WHERE {where}")}


async def test_rows_land_in_their_months_partition_and_a_redelivery_is_stored_once(
        nc: bus.NATS, nats_url: str, database_url: str, sql: Sql) -> None:
    old = _month(2)
    run(database_url, "SELECT rl_ensure_partitions(3, %s)", (MONTHS_BACK,))
    [late, now] = seed_episodes(sql, "part", num_tasks=2)
    run(database_url, "UPDATE episodes SET created_at = %s WHERE id = %s", (old, late))  # its batch came then
    late_events: list[BaseModel] = [e.model_copy(update={"time": old})
                                    for e in episode_events(late, [([5, 6], [2, 40]), ([7], [])])]
    await publish(nc, late_events)
    await publish(nc, episode_events(now, [([8, 9], [])]))
    js = nc.jetstream()
    for ev in late_events:  # the same events again, as a redelivery or a re-publish outside the dedupe window
        event = decode(encode(ev))
        await js.publish(event_subject(event.type), encode(event), headers={"Nats-Msg-Id": f"{event.event_id}:again"})
    async with recorder(settings_for(nats_url, database_url, batch_size=3)):
        await until(lambda: sql.scalar("select count(*) from trajectories") == 2, 30, "two trajectories")
        await until(lambda: drained(nc), 20, "consumer drained")

    assert sql.scalar("select count(*) from turns where episode_id = :e", e=late) == 2
    assert sql.scalar("select count(*) from steps where episode_id = :e", e=late) == 2
    month = f"{old:%Y%m}"
    assert _partition_of(database_url, "turns", f"episode_id = '{late}'") == {f"rl_partitions.turns_p{month}"}
    assert _partition_of(database_url, "steps", f"episode_id = '{late}'") == {f"rl_partitions.steps_p{month}"}
    this = f"{dt.datetime.now(dt.UTC):%Y%m}"
    assert _partition_of(database_url, "turns", f"episode_id = '{now}'") == {f"rl_partitions.turns_p{this}"}
    # a trajectory lives in its episode's month, whenever it was written
    assert _partition_of(database_url, "trajectories", f"episode_id = '{late}'") == {
        f"rl_partitions.trajectories_p{month}"}
    assert _partition_of(database_url, "trajectories", f"episode_id = '{now}'") == {
        f"rl_partitions.trajectories_p{this}"}
    assert sql.scalar("select count(*) from dead_letters") == 0


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Where the archive goes: a local folder, or a bucket on a local S3-compatible server (moto)."""
    if request.param == "file":
        yield f"file://{tmp_path}/archive"
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    try:
        for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        host, port = server.get_host_and_port()
        monkeypatch.setenv(ENDPOINT_ENV, f"http://{host}:{port}")
        pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http",
                          allow_bucket_creation=True).create_dir("rollout-archive")
        yield "s3://rollout-archive/ledger"
    finally:
        server.stop()


GROUPS = [[Traj(reward=1.0), Traj(reward=0.0)], [Traj(reward=0.5), Traj(reward=0.25)]]


def _records(path: Path) -> list[dict[str, object]]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda r: (str(r["episode_id"]), str(r.get("prompt"))))


def test_archive_writes_a_manifest_drops_the_period_and_reads_come_back_the_same(database_url: str, tmp_path: Path,
                                                                               target: str) -> None:
    old = _month(3)
    run(database_url, "SELECT rl_ensure_partitions(3, %s)", (MONTHS_BACK,))
    seed_batch(database_url, "arch", GROUPS, created_at=old.isoformat())
    seed_turns(database_url, "arch", GROUPS)
    seed_batch(database_url, "live", [[Traj()]])
    # as the recorder would have written them then: the turns' events and the feed entries of that month
    run(database_url, "UPDATE turns SET produced_at = %s WHERE episode_id LIKE 'arch.%%'", (old,))
    run(database_url, "UPDATE steps SET produced_at = %s WHERE episode_id LIKE 'arch.%%'", (old,))
    run(database_url, "UPDATE trajectory_feed SET logged_at = %s WHERE batch_id = 'arch'", (old,))
    month = f"{old:%Y%m}"
    assert _partition_of(database_url, "trajectory_feed", "batch_id = 'arch'") == {
        f"rl_partitions.trajectory_feed_p{month}"}
    turns = int(run(database_url, "SELECT count(*) FROM turns WHERE episode_id LIKE 'arch.%%'")[0][0])
    assert turns > 0

    before = tmp_path / "before.parquet"
    export(database_url, Selection(batch_ids=("arch",)), before, "openrlhf")
    reader = TrajectoryReader(database_url, "slow", fmt="openrlhf")  # registered at the start of the feed
    try:
        held = [r for r in archive(database_url, dt.timedelta(days=30), target) if r.lo and f"{r.lo:%Y%m}" == month]
        assert len(held) == 1 and not held[0].archived and "consumer slow" in (held[0].skipped or "")
        assert _partition_of(database_url, "turns", "episode_id LIKE 'arch.%%'") == {
            f"rl_partitions.turns_p{month}"}
        for batch in reader.batches():  # the consumer reads everything: it no longer holds the period
            batch.ack()

        results = archive(database_url, dt.timedelta(days=30), target)
        [res] = [r for r in results if r.lo and f"{r.lo:%Y%m}" == month]
        assert res.archived, res.skipped
        assert res.rows == {"turns": turns, "steps": turns, "trajectory_feed": 4, "trajectories": 4}
        this = f"{dt.datetime.now(dt.UTC):%Y%m}"
        assert all(f"{r.lo:%Y%m}" < this for r in results if r.lo), "only whole periods past the cutoff"

        loc = open_location(f"{target}/{old:%Y-%m}")
        with loc.fs.open_input_stream(loc.path("manifest.json")) as f:
            manifest = json.loads(f.read())
        assert manifest["schema_revision"] == SCHEMA_REVISION and manifest["batch_ids"] == ["arch"]
        assert manifest["period"]["start"].startswith(f"{old:%Y-%m}-01")
        for table, entry in manifest["files"].items():
            with loc.fs.open_input_stream(loc.path(entry["path"])) as f:
                data = f.read()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"], table
            assert pq.read_metadata(io.BytesIO(data)).num_rows == entry["rows"] == res.rows[table]

        for table in ("turns", "steps", "trajectory_feed", "trajectories"):
            assert run(database_url, f"SELECT to_regclass('rl_partitions.{table}_p{month}')") == [(None,)]
        assert run(database_url, "SELECT count(*) FROM trajectories WHERE batch_id = 'arch'") == [(0,)]
        assert run(database_url, "SELECT count(*) FROM turns WHERE episode_id LIKE 'arch.%%'") == [(0,)]
        assert run(database_url, "SELECT count(*) FROM trajectories WHERE batch_id = 'live'") == [(1,)]
        assert run(database_url, "SELECT manifest, batch_ids FROM archives WHERE period_start = %s",
                   (res.lo,)) == [(f"{target}/{old:%Y-%m}/manifest.json", ["arch"])]

        after = tmp_path / "after.parquet"
        export(database_url, Selection(batch_ids=("arch",)), after, "openrlhf")
        assert _records(after) == _records(before) and len(_records(before)) == 4

        fresh = TrajectoryReader(database_url, "fresh", fmt="openrlhf")
        try:
            got = [row for t in fresh.archived(Selection(batch_ids=("arch",))) for row in t.to_pylist()]
            assert fresh.next_batch() is not None  # the live batch, from the feed
        finally:
            fresh.close()
        assert sorted(got, key=lambda r: (str(r["episode_id"]), str(r.get("prompt")))) == _records(before)
    finally:
        reader.close()


ALL = ("turns", "steps", "trajectory_feed", "trajectories")


def _counts(url: str, tables: tuple[str, ...] = ("turns", "steps", "trajectory_feed")) -> dict[str, int]:
    return {t: int(run(url, f"SELECT count(*) FROM {t}")[0][0]) for t in tables}


def test_migration_carries_existing_rows_in_place_and_downgrade_copies_them_back(database_url: str) -> None:
    downgrade(database_url, "0015")
    seed_batch(database_url, "kept", GROUPS)
    seed_turns(database_url, "kept", GROUPS)
    assert _counts(database_url)["turns"] > 0

    upgrade(database_url, "0016")
    # a batch stored after 0016 ran, in a later month than its first partitions end (0018 runs months later)
    later = _month(-2)
    seed_batch(database_url, "after", [[Traj()]], created_at=later.isoformat())
    before = _counts(database_url, ALL)
    assert before["trajectory_feed"] == before["trajectories"] == 5
    upgrade(database_url)
    assert _counts(database_url, ALL) == before
    for table in ("turns", "steps", "trajectory_feed"):  # the old table is the first partition, nothing copied
        assert _partition_of(database_url, table, "batch_id = 'kept'" if table == "trajectory_feed" else "TRUE") == {
            f"rl_partitions.{table}_legacy"}
    # trajectories' first partition ends where turns' does; the later batch's row moved to its month
    assert _partition_of(database_url, "trajectories", "batch_id = 'kept'") == {"rl_partitions.trajectories_legacy"}
    assert _partition_of(database_url, "trajectories", "batch_id = 'after'") == {
        f"rl_partitions.trajectories_p{later:%Y%m}"}
    assert run(database_url, "SELECT count(*) FROM trajectory_feed WHERE batch_id = 'after'") == [(1,)]  # no re-log
    assert run(database_url, "SELECT count(*) FROM trajectories t JOIN episodes e ON e.id = t.episode_id "
                             "WHERE t.episode_created_at <> e.created_at") == [(0,)]
    # the views read the new tables, the grants came along
    assert run(database_url, "SELECT count(*) FROM v_turn_stats") == [(before["turns"],)]
    assert run(database_url, "SELECT count(*) FROM v_trajectory_versions") == [(before["trajectories"],)]
    assert run(database_url, "SELECT has_table_privilege('rollout_recorder', 'turns', 'INSERT'), "
                             "has_table_privilege('rollout_pruner', 'trajectory_feed', 'DELETE'), "
                             "has_table_privilege('rollout_recorder', 'trajectories', 'UPDATE'), "
                             "has_table_privilege('rollout_reader', 'trajectories', 'SELECT')") == [(True,) * 4]
    run(database_url, "UPDATE turns SET produced_at = %s WHERE turn_index = 0", (later,))
    assert f"rl_partitions.turns_p{later:%Y%m}" in _partition_of(database_url, "turns", "TRUE")
    with pytest.raises(psycopg.errors.UniqueViolation):  # one event id and time, one row, whatever the partition
        run(database_url, "INSERT INTO turns SELECT * FROM turns WHERE turn_index = 0 LIMIT 1")
    with pytest.raises(psycopg.errors.UniqueViolation):  # one trajectory per episode (its key is its episode's)
        run(database_url, "INSERT INTO trajectories SELECT * FROM trajectories WHERE batch_id = 'after'")

    downgrade(database_url, "0015")
    assert _counts(database_url, ALL) == before
    for table in ("turns", "trajectories"):
        assert run(database_url, f"SELECT relkind FROM pg_class WHERE oid = '{table}'::regclass") == [("r",)]
    assert run(database_url, "SELECT count(*) FROM v_turn_stats") == [(before["turns"],)]
    upgrade(database_url)
    assert _counts(database_url, ALL) == before


def test_a_crash_before_the_drop_or_a_late_row_loses_nothing(database_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_ledger.services.exporter import archive as archiving

    old = _month(3)
    run(database_url, "SELECT rl_ensure_partitions(3, %s)", (MONTHS_BACK,))
    seed_batch(database_url, "crash", GROUPS, created_at=old.isoformat())
    seed_turns(database_url, "crash", GROUPS)
    run(database_url, "UPDATE turns SET produced_at = %s", (old,))
    run(database_url, "UPDATE steps SET produced_at = %s", (old,))
    run(database_url, "UPDATE trajectory_feed SET logged_at = %s", (old,))
    stored = (_counts(database_url), run(database_url, "SELECT count(*) FROM trajectories"))
    target = f"file://{tmp_path}/archive"
    month = f"{old:%Y%m}"

    def crash(*args: object) -> None:
        raise SystemExit("killed after the files were written")

    written = archiving._write_period
    with monkeypatch.context() as m:  # the process dies after the files, before the manifest is checked
        m.setattr(archiving, "_verify", crash)
        with pytest.raises(SystemExit):
            archive(database_url, dt.timedelta(days=30), target)
    assert (_counts(database_url), run(database_url, "SELECT count(*) FROM trajectories")) == stored
    assert run(database_url, "SELECT count(*) FROM archives") == [(0,)]

    def late_row(*args: object) -> object:  # a turn of the month arrives after its file was written
        manifest = written(*args)  # type: ignore[arg-type]
        if manifest["tables"]["turns"]:
            run(database_url, "INSERT INTO turns SELECT (event_id || ':late'), episode_id, attempt, turn_index + 100, "
                              "prompt_len, token_ids, logprobs, finish_reason, weight_version, engine, worker_id, "
                              "queue_ms, generate_ms, cached_tokens, superseded, produced_at FROM turns LIMIT 1")
        return manifest

    with monkeypatch.context() as m:
        m.setattr(archiving, "_write_period", late_row)
        [kept] = [r for r in archive(database_url, dt.timedelta(days=30), target) if r.lo and f"{r.lo:%Y%m}" == month]
    assert not kept.archived and "rows changed" in (kept.skipped or "")
    assert _partition_of(database_url, "turns", "TRUE") == {f"rl_partitions.turns_p{month}"}
    assert run(database_url, "SELECT count(*) FROM trajectories") == stored[1]

    [done] = [r for r in archive(database_url, dt.timedelta(days=30), target) if r.lo and f"{r.lo:%Y%m}" == month]
    assert done.archived and done.rows["turns"] == stored[0]["turns"] + 1
    assert _counts(database_url) == {"turns": 0, "steps": 0, "trajectory_feed": 0}


def test_the_cli_archives_a_month_and_refuses_bad_input_clearly(database_url: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rollout_ledger.cli.main import app

    old = _month(3)
    run(database_url, "SELECT rl_ensure_partitions(3, %s)", (MONTHS_BACK,))
    seed_batch(database_url, "cli", GROUPS, created_at=old.isoformat())
    run(database_url, "UPDATE trajectory_feed SET logged_at = %s", (old,))
    runner = CliRunner()
    env = {"DATABASE_URL": database_url}
    for args, message in ((["--older-than", "90x", "--to", f"file://{tmp_path}"], "positive number with s, m, h"),
                          (["--older-than", "30d", "--to", "archive/here"], "use file:///abs/path or s3://"),
                          (["--older-than", "30d", "--to", "s3://bucket/p", "--s3-endpoint", "minio:9000"],
                           "must be http(s)://host[:port]")):
        res = runner.invoke(app, ["archive", *args], env=env)
        said = " ".join(res.output.replace("│", " ").split())  # as typed, whatever the error box wrapped
        assert res.exit_code != 0 and message in said, res.output
    assert run(database_url, "SELECT count(*) FROM trajectories WHERE batch_id = 'cli'") == [(4,)]

    res = runner.invoke(app, ["archive", "--older-than", "30d", "--to", f"file://{tmp_path}", "--dry-run"], env=env)
    assert res.exit_code == 0 and "would be archived" in res.output, res.output
    assert run(database_url, "SELECT count(*) FROM trajectories WHERE batch_id = 'cli'") == [(4,)]
    res = runner.invoke(app, ["archive", "--older-than", "30d", "--to", f"file://{tmp_path}"], env=env)
    line = next((x for x in res.output.splitlines() if x.startswith(f"[{old:%Y-%m}-01")), "")
    assert res.exit_code == 0 and "\tarchived\t" in line and "trajectories 4" in line, res.output
    assert run(database_url, "SELECT count(*) FROM trajectories WHERE batch_id = 'cli'") == [(0,)]
    assert (tmp_path / f"{old:%Y-%m}" / "manifest.json").exists()
