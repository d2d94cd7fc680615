"""Env-aware routing with real processes (fake engine) on real NATS + Postgres: env workers with disjoint env sets
run only their own envs' episodes (none fails with "unknown env"), a batch whose env has no live worker waits
(``waiting_for_env`` in its status, nothing failed) and completes once a worker with the env starts, and items a
previous release queued on the single work subject still run, on a worker that has their env.
The pure parts (tokens, adverts, families, the fair slot split) are in tests/unit/test_routing.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.events import encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import (
    ENV_WORKERS_BUCKET,
    ENVS_BUCKET,
    WORK_STREAM,
    work_consumer,
    work_max_deliveries_advisory,
    work_subject,
)
from tests.helpers import AUTH, Sql, publish_event, until
from tests.integration.test_env_worker import work_item
from tests.integration.test_recorder import drained, episode_events, publish, recorder, seed_episodes, settings_for

FINISHED = {"completed", "truncated"}


async def _submit(http: httpx.AsyncClient, env: str, tasks: list[dict[str, Any]], **body: Any) -> str:
    resp = await http.post("/v1/batches", json={"env": env, "tasks": tasks, "max_turns": 4,
                                                "sampling": {"max_tokens": 16}, **body})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["batch_id"])


async def _status(http: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    resp = await http.get(f"/v1/batches/{batch_id}")
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def _done(http: httpx.AsyncClient, batch_id: str, timeout_s: float = 40) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        info = await _status(http, batch_id)
        return info if info["done"] else None
    return dict(await until(done, timeout_s, f"batch {batch_id} to finish"))


def _workers(sql: Sql, batch_id: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for row in sql.rows("select status, worker_id from episodes where batch_id = :b", b=batch_id):
        out.setdefault(str(row["status"]), set()).add(str(row["worker_id"]))
    return out


async def test_episodes_go_only_to_workers_that_have_their_env(stack: Stack, nc: bus.NATS,
                                                                database_url: str) -> None:
    start = asyncio.to_thread
    await start(stack.start, "inference-worker", ROLLOUT_ENGINE="fake")
    fast = {"ROLLOUT_ROUTE_HAND_BACK_S": "0.2", "ROLLOUT_INFERENCE_DISCOVERY_S": "0.2"}
    await asyncio.gather(start(stack.start, "env-worker", "env-arith", ROLLOUT_ENVS="arithmetic", **fast),
                         start(stack.start, "env-worker", "env-guess", ROLLOUT_ENVS="guess-number", **fast),
                         start(stack.start, "recorder"))
    url = (await start(stack.start, "scheduler")).url
    js = nc.jetstream()
    sql = Sql(database_url)
    try:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10) as http:
            envs = {e["name"]: e for e in (await http.get("/v1/envs")).json()["envs"]}
            assert envs["arithmetic"]["route"] == "arithmetic" and envs["guess-number"]["route"] == "guess-number"

            # 1. two workers with disjoint envs, a batch of each: every episode ends on the worker with its env
            arith = await _submit(http, "arithmetic", [{"seed": i} for i in range(6)], group_size=2, max_turns=1)
            guess = await _submit(http, "guess-number", [{"seed": i} for i in range(4)], group_size=2)
            for batch_id, worker in ((arith, "env-arith"), (guess, "env-guess")):
                info = await _done(http, batch_id)
                assert info["counts"]["failed"] == 0 and info["waiting_for_env"] == {}, info
                workers = _workers(sql, batch_id)
                assert set(workers) <= FINISHED and set().union(*workers.values()) == {worker}, workers
            assert sql.scalar("select count(*) from attempt_failures") == 0, "no 'unknown env' failure"
            for route in ("arithmetic", "guess-number"):  # one shared consumer per route
                await js.consumer_info(WORK_STREAM, work_consumer(route))

            # 2. the only worker with guess-number stops: a guess-number batch waits, visibly, and fails nothing
            guess_worker = next(p for p in stack.procs if p.name == "env-guess")
            await start(guess_worker.stop)
            waiting = await _submit(http, "guess-number", [{"seed": i} for i in range(3)])

            async def shows_waiting() -> dict[str, Any] | None:
                info = await _status(http, waiting)
                return info if info["waiting_for_env"] == {"guess-number": 3} else None
            info = await until(shows_waiting, 10, "the batch to show it waits for guess-number")
            assert info["counts"]["requested"] == 3 and info["num_published"] == 3
            # env-arith is live: it must not take (and fail) them. It has pulled since they were queued once it has
            # run an episode submitted after them.
            probe = await _submit(http, "arithmetic", [{"seed": 99}], max_turns=1)
            probed = await _done(http, probe)
            assert probed["counts"]["failed"] == 0 and set().union(*_workers(sql, probe).values()) == {"env-arith"}
            info = await _status(http, waiting)
            assert info["counts"]["requested"] == 3 and info["counts"]["failed"] == 0, info

            async def probe_acked() -> bool:  # its item leaves the queue once acked, after its end was recorded
                info = await js.stream_info(WORK_STREAM, subjects_filter=work_subject("arithmetic"))
                return not (info.state.subjects or {}).get(work_subject("arithmetic"))
            await until(probe_acked, 10, "the probe's work item acked")
            assert (await js.stream_info(WORK_STREAM)).state.messages == 3, "the items wait on the work queue"

            # ... and completes once a worker with the env starts
            await start(stack.start, "env-worker", "env-guess-2", ROLLOUT_ENVS="guess-number", **fast)
            info = await _done(http, waiting)
            assert info["counts"]["failed"] == 0 and info["waiting_for_env"] == {}
            assert set().union(*_workers(sql, waiting).values()) == {"env-guess-2"}

            # 3. items a previous release queued on the single subject still run, each on a worker with its env
            #    (a worker without it hands the item back without spending a delivery)
            tasks: list[tuple[str, dict[str, Any]]] = [("arithmetic", {"a": 2, "b": 3, "op": "+"}),
                                                       ("guess-number", {"target": 7, "low": 1, "high": 10})]
            legacy = [work_item(env, task, batch_id=f"legacy{n}") for n, (env, task) in enumerate(tasks * 2)]
            for item in legacy:
                seed_episodes(sql, item.batch_id, env=item.env)
                await publish_event(js, item)  # no route: the legacy subject rl.work.episodes

            def legacy_done() -> bool:
                return bool(sql.scalar("select count(*) from episodes where batch_id like 'legacy%' "
                                       "and status in ('completed', 'truncated')") == len(legacy))
            await until(legacy_done, 30, "the legacy items to run")
            for item in legacy:
                worker = sql.scalar("select worker_id from episodes where id = :e", e=item.episode_id)
                assert worker == ("env-arith" if item.env == "arithmetic" else "env-guess-2"), (item.env, worker)
            assert sql.scalar("select count(*) from attempt_failures") == 0
            assert sql.scalar("select count(*) from dead_letters") == 0

        # the live workers' reports: the stopped one removed its own
        reports = await js.key_value(ENV_WORKERS_BUCKET)
        assert {(await reports.get(k)).key for k in ("env-arith", "env-guess-2")} == {"env-arith", "env-guess-2"}
        assert b'"routes":["guess-number"]' in ((await reports.get("env-guess-2")).value or b"")
        assert (await (await js.key_value(ENVS_BUCKET)).get("arithmetic")).value is not None
    finally:
        sql.close()


async def test_a_route_consumers_max_deliveries_advisory_fails_the_episode_and_forgeries_do_not(
        nc: bus.NATS, nats_url: str, database_url: str) -> None:
    """The recorder acts on the max-deliveries advisory of a route's consumer (``env-workers-<token>``) as on the
    legacy one's, and stays strict: an advisory whose subject, consumer and message subject do not agree is refused."""
    sql = Sql(database_url)
    try:
        route = "remote:echo"  # a route whose token is escaped (remote=3Aecho)
        [ep] = seed_episodes(sql, "adv", env=route)
        js = nc.jetstream()
        await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=2, max_ack_pending=10,
                                                             route=route))
        await bus.ensure_consumer(js, bus.work_consumer_spec(ack_wait_s=30, max_deliver=2, max_ack_pending=10,
                                                             route="arithmetic"))
        item = work_item(route, {"q": 1}, batch_id="adv")
        await publish_event(js, item, route=route)
        work = await js.pull_subscribe_bind(work_consumer(route), WORK_STREAM)
        await publish(nc, episode_events(ep, [([3], [])], terminal=False)[:1])  # attempt 1 started
        for _ in range(2):  # two env workers "die": each delivery handed back without an ack
            [msg] = await work.fetch(1, timeout=5)
            assert msg.subject == work_subject(route)
            await msg.nak()
        assert await bus.fetch(work, 1, 0.5) == []  # a third pull makes the server give up on the item
        # forgeries (NATS refuses them from service users; here the test's own user writes them): the consumer named
        # in the body is not the subject's, or is a route's whose subject is not the item's
        other = work_consumer("arithmetic")
        for subject, body in ((work_max_deliveries_advisory(other), {"consumer": work_consumer(route)}),
                              (work_max_deliveries_advisory(other), {"consumer": other}),
                              (work_max_deliveries_advisory("env-workers-remote=3aecho"),
                               {"consumer": "env-workers-remote=3aecho"})):
            await js.publish(subject, orjson.dumps({"stream": WORK_STREAM, "stream_seq": 1, "deliveries": 2, **body}))
        async with recorder(settings_for(nats_url, database_url)):
            await until(lambda: sql.scalar("select status from episodes") == "failed", 20, "episode failed")
            await until(lambda: sql.scalar("select count(*) from dead_letters") == 4, 20, "letters")
            await until(lambda: drained(nc), 10, "drained")
        row = sql.rows("select failure_class, failure_reason, attempt from episodes")[0]
        assert row["failure_class"] == "infra" and "died 2 times" in row["failure_reason"] and row["attempt"] == 2
        letters = sql.rows("select source, subject, reason, payload from dead_letters order by id")
        [stored] = [r for r in letters if r["source"] == "work-queue"]
        assert stored["subject"] == work_subject(route) and bytes(stored["payload"]) == encode(item)
        refused = sorted(str(r["reason"]) for r in letters if r["source"] == "recorder-advisories")
        assert len(refused) == 3 and all(r.startswith("untrusted advisory") for r in refused), refused
        assert any(f"not {work_subject('arithmetic')}" in r or "never delivered" in r for r in refused), refused
        assert (await js.stream_info(WORK_STREAM)).state.messages == 0  # the item was deleted
        await work.unsubscribe()
    finally:
        sql.close()
