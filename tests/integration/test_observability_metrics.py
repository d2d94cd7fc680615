"""The metrics the Grafana dashboard and the alerts read that the services did not export before, each shown to
move on real NATS and Postgres: failures by class (recorder), staleness, live inference workers, waiting episodes
and admission stalled (scheduler admission), work items per route and live env workers per route (scheduler queue
gauges)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from rollout_ledger.cli.stack.servers import ADMIN_USER, PrivateNats
from rollout_ledger.services.scheduler import queue_gauges
from rollout_ledger.services.scheduler.metrics import SchedulerMetrics, create_metrics
from rollout_ledger.shared import nats_auth
from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.events import EpisodeFailed, FailureClass, decode, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import ENV_WORKERS_BUCKET, WORK_STREAM, event_subject, work_consumer
from tests.helpers import Sql, until
from tests.integration.test_admission import push, serve
from tests.integration.test_recorder import (
    _metric,
    drained,
    env_failed,
    publish,
    recorder,
    seed_episodes,
    settings_for,
)
from tests.integration.test_scheduler_api import Api, body, make_settings, register_env, running


@pytest.fixture
async def api(nats_url: str, database_url: str, nc: bus.NATS) -> AsyncIterator[Api]:
    async with running(make_settings(nats_url, database_url, admission_interval_s=0.2), nc) as a:
        await register_env(a.js, "echo")
        yield a


async def scraped(api: Api, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample on the scheduler's /metrics (None when it is not exported)."""
    text = (await api.client.get("/metrics")).text
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if line.startswith("#") or head.split("{", 1)[0] != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        return float(value)
    return None


def sample(metrics: SchedulerMetrics, name: str, route: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"route": route})


# --- recorder: failures by class ----------------------------------------------------------------------------------

async def test_attempt_failures_are_counted_by_class_once(nc: bus.NATS, nats_url: str, database_url: str,
                                                          sql: Sql) -> None:
    [final, retried] = seed_episodes(sql, "fails", num_tasks=2)
    events = [
        env_failed(final, "fails", 1, "reset raised"),
        EpisodeFailed(event_id=f"{retried}:a1:end", episode_id=retried, batch_id="fails", attempt=1, seq=1,
                      produced_by="env/w1", failure_class=FailureClass.INFERENCE, reason="engine down",
                      num_turns=0, will_retry=True),
    ]
    await publish(nc, events)
    settings = settings_for(nats_url, database_url)
    env_final = {"failure_class": "env", "retried": "false"}
    inference_retried = {"failure_class": "inference", "retried": "true"}
    async with recorder(settings):
        await until(lambda: drained(nc), 20, "consumer drained")
        assert await _metric(settings, "rollout_attempt_failures_total", env_final) == 1
        assert await _metric(settings, "rollout_attempt_failures_total", inference_retried) == 1
        assert await _metric(settings, "rollout_attempt_failures_total") == 2

        # the same events again under other Nats-Msg-Ids: stored once, counted once
        js = nc.jetstream()
        for ev in events:
            event = decode(encode(ev))
            await js.publish(event_subject(event.type), encode(event),
                             headers={"Nats-Msg-Id": f"{event.event_id}:again"})

        async def processed_again() -> bool:
            return await _metric(settings, "rollout_events_processed_total") == 4 and await drained(nc)

        await until(processed_again, 20, "the copies processed")
        assert await _metric(settings, "rollout_attempt_failures_total") == 2
        assert await _metric(settings, "rollout_ready") == 1
    assert sql.scalar("select count(*) from attempt_failures") == 2


# --- scheduler: staleness, live inference workers, waiting episodes, admission stalled ---------------------------

async def test_staleness_waiting_and_a_stalled_admission_move(api: Api) -> None:
    await serve(api, "inf-a", 0)
    await serve(api, "inf-b", 0)
    r = await api.client.post("/v1/batches", json=body(batch_id="gauged", tasks=[{"q": str(i)} for i in range(4)],
                                                         group_size=2, max_staleness=0, episodes_per_version=2))
    assert r.status_code == 201, r.text
    assert r.json()["num_waiting"] == 6

    async def holding() -> bool:
        return (await scraped(api, "rollout_episodes_waiting") == 6
                and await scraped(api, "rollout_inference_workers_live") == 2
                and await scraped(api, "rollout_policy_staleness_versions") == 0
                and (await scraped(api, "rollout_admission_stalled_seconds") or 0) >= 0.5)

    await until(holding, 10, "six episodes held by the run-ahead bound, stalled for half a second")
    assert await scraped(api, "rollout_ready") == 1

    # the trainer pushes version 1 and only one worker follows: staleness 1, nothing admitted
    await push(api, 1)
    await serve(api, "inf-a", 1)

    async def stale() -> bool:
        return (await scraped(api, "rollout_policy_staleness_versions") == 1
                and await scraped(api, "rollout_policy_version_announced") == 1
                and await scraped(api, "rollout_policy_version_serving_min") == 0)

    await until(stale, 10, "staleness 1 while inf-b serves version 0")
    stalled = await scraped(api, "rollout_admission_stalled_seconds")
    assert stalled is not None and stalled >= 0.5 and await scraped(api, "rollout_episodes_waiting") == 6

    # every worker serves 1: the next step is admitted, the stall ends, staleness is 0 again
    await serve(api, "inf-b", 1)

    async def admitted() -> bool:
        now = await scraped(api, "rollout_admission_stalled_seconds")
        return (await scraped(api, "rollout_episodes_waiting") == 4 and now is not None and now < stalled
                and await scraped(api, "rollout_policy_staleness_versions") == 0)

    await until(admitted, 10, "two more episodes admitted and the stall clock reset")

    # cancelled: nothing waits, nothing is stalled
    assert (await api.client.post("/v1/batches/gauged/cancel")).status_code in (200, 202)

    async def idle() -> bool:
        return (await scraped(api, "rollout_episodes_waiting") == 0
                and await scraped(api, "rollout_admission_stalled_seconds") == 0)

    await until(idle, 10, "no episode waiting after the cancel")


# --- scheduler: work items and live env workers per route ---------------------------------------------------------

async def test_queue_gauges_follow_the_work_queue_per_route(api: Api) -> None:
    assert await scraped(api, "rollout_work_queue_waiting") is None, "an empty queue has no route yet"
    r = await api.client.post("/v1/batches", json=body(batch_id="queued"))
    assert r.status_code == 201 and r.json()["num_published"] == 6, r.text
    metrics = create_metrics()
    workers_kv = await api.js.key_value(ENV_WORKERS_BUCKET)

    # no env worker has the route yet: every item waits, nobody serves it
    await queue_gauges.refresh(metrics, api.js, workers_kv)
    assert sample(metrics, "rollout_work_queue_waiting", "echo") == 6
    assert sample(metrics, "rollout_work_queue_unacked", "echo") == 0
    assert sample(metrics, "rollout_env_workers_live", "echo") == 0

    # a worker with the route comes up and takes two items (running, not acked yet)
    await workers_kv.put("w1", orjson.dumps({"worker": "w1", "routes": ["echo"], "envs": ["echo"]}))
    await bus.ensure_consumer(api.js, bus.work_consumer_spec(30.0, 5, 100, route="echo"))
    psub = await api.js.pull_subscribe_bind(work_consumer("echo"), WORK_STREAM)
    taken = await psub.fetch(2, timeout=5)
    assert len(taken) == 2
    await queue_gauges.refresh(metrics, api.js, workers_kv)
    assert sample(metrics, "rollout_work_queue_waiting", "echo") == 4
    assert sample(metrics, "rollout_work_queue_unacked", "echo") == 2
    assert sample(metrics, "rollout_env_workers_live", "echo") == 1

    # both finish (acked): the queue holds four, none unacked
    for msg in taken:
        await msg.ack_sync()
    await queue_gauges.refresh(metrics, api.js, workers_kv)
    assert sample(metrics, "rollout_work_queue_waiting", "echo") == 4
    assert sample(metrics, "rollout_work_queue_unacked", "echo") == 0

    # the worker goes away: its route's live count drops to 0 while items still wait (the consumer-lag alert)
    await workers_kv.delete("w1")
    await queue_gauges.refresh(metrics, api.js, workers_kv)
    assert sample(metrics, "rollout_env_workers_live", "echo") == 0
    assert sample(metrics, "rollout_work_queue_waiting", "echo") == 4
    await psub.unsubscribe()


async def test_the_scheduler_exports_the_queue_gauges_from_its_start(nats_url: str, database_url: str,
                                                                     nc: bus.NATS) -> None:
    """The app's own loop reads the queue when it starts (then every ``QUEUE_GAUGE_INTERVAL_S``)."""
    js = nc.jetstream()
    await bus.ensure_topology(js)
    await js.publish("rl.work.episodes.echo", b"{}", headers={"Nats-Msg-Id": f"gauge-{datetime.now(UTC)}"})
    async with running(make_settings(nats_url, database_url), nc) as api:
        async def exported() -> bool:
            return await scraped(api, "rollout_work_queue_waiting", {"route": "echo"}) == 1

        await until(exported, 10, "the scheduler's queue gauge for route echo")
        assert await scraped(api, "rollout_env_workers_live", {"route": "echo"}) == 0


@pytest.fixture
def secured() -> Iterator[PrivateNats]:
    """A nats-server of its own with the project's users and permissions (``rollout_ledger/shared/nats_auth.py``)."""
    root = Path(tempfile.mkdtemp(prefix="rollout-ledger-nats-auth-", dir="/tmp"))
    server = PrivateNats(root, auth=True)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


async def login(server: PrivateNats, user: str) -> bus.NATS:
    return await bus.connect(server.url, name=f"test-{user}", security=server.security(user), initial_wait_s=5)


async def test_the_scheduler_user_may_read_the_queue_and_an_env_worker_may_not(secured: PrivateNats) -> None:
    """The scheduler's login lists the work consumers and reads the live env workers (its queue gauges); an env
    worker's login is refused the consumer list."""
    admin = await login(secured, ADMIN_USER)
    await bus.ensure_topology(admin.jetstream())
    await admin.jetstream().publish("rl.work.episodes.echo", b"{}", headers={"Nats-Msg-Id": "auth-gauge"})
    scheduler = await login(secured, nats_auth.SCHEDULER)
    worker = await login(secured, nats_auth.ENV_WORKER)
    try:
        js = scheduler.jetstream()
        assert (await queue_gauges.read_queue(js))["echo"].waiting == 1
        assert await queue_gauges.read_live_routes(js, await js.key_value(ENV_WORKERS_BUCKET)) == {}
        with pytest.raises(BusError):
            await queue_gauges.read_queue(worker.jetstream(timeout=1.0))
    finally:
        for nc in (scheduler, worker, admin):
            await nc.close()
