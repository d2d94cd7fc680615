"""Two of every service under load (issue 28, part 3): two schedulers, two recorders, three env workers and two
inference workers as real processes on one NATS and one Postgres, with work submitted through both schedulers.

What must be single is made safe, and each check counts what happened instead of hoping nothing did:
- the same batch id posted to both schedulers at once is stored once (one 201, one replay);
- admission runs in both schedulers, and a bounded batch never gets past its bound: after each version the
  admitted count is exactly the bound while both schedulers run passes (counted on their metrics);
- both outboxes republish forgotten work items together, and each item is republished by exactly one of them;
- nothing is lost, stored twice or generated twice.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx

from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.client.rest import LedgerClient
from tests.helpers import API_TOKEN, AUTH, Sql, metric, wait_for

TURNS = 3
FAST = {"ROLLOUT_FAKE_DELAY_S": "0.01", "ROLLOUT_ADMISSION_INTERVAL_S": "0.2",
        "ROLLOUT_REPUBLISH_INTERVAL_S": "0.3", "ROLLOUT_REPUBLISH_GRACE_S": "0.5"}


def fixed_turns(n: int, **extra: Any) -> dict[str, Any]:
    return {"env": "fixed-turns", "tasks": [{"turns": TURNS}] * n, "group_size": 1, "max_turns": TURNS,
            "sampling": {"max_tokens": 8}, **extra}


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/batches", headers=AUTH, json=body, timeout=60)


def start_replicas(stack: Stack) -> list[ServiceProcess]:
    """2 inference workers, 3 env workers, 2 recorders, then 2 schedulers; the schedulers."""
    procs = [stack.start("inference-worker", name=f"inference-worker-{i}", wait=False, ROLLOUT_ENGINE="fake", **FAST)
             for i in range(2)]
    procs += [stack.start("env-worker", name=f"env-worker-{i}", wait=False, **FAST) for i in range(3)]
    procs += [stack.start("recorder", name=f"recorder-{i}", wait=False, **FAST) for i in range(2)]
    for proc in procs:
        proc.wait_ready(timeout_s=120)
    return [stack.start("scheduler", name=f"scheduler-{i}", **FAST) for i in range(2)]


def race(urls: list[str], body: dict[str, Any]) -> list[int]:
    """POST ``body`` to every scheduler at the same moment; the status codes."""
    gate = threading.Barrier(len(urls))
    codes: list[int] = []

    def one(url: str) -> None:
        gate.wait()
        codes.append(post(url, body).status_code)

    threads = [threading.Thread(target=one, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(codes)


def test_two_of_every_service_lose_duplicate_and_double_admit_nothing(stack: Stack, database_url: str,
                                                                        model_dir: str) -> None:
    a, b = start_replicas(stack)
    urls = [a.url, b.url]
    sql = Sql(database_url)
    batch_ids: list[str] = []
    try:
        # -- load through both schedulers, and the same batch raced to both ------------------------------------
        for i in range(8):
            r = post(urls[i % 2], fixed_turns(20))
            assert r.status_code == 201, r.text
            batch_ids.append(r.json()["batch_id"])
        for k in range(3):
            assert race(urls, fixed_turns(10, batch_id=f"raced-{k}")) == [200, 201], "one creates, one replays"
            batch_ids.append(f"raced-{k}")
        assert sql.scalar("select count(*) from episodes where batch_id like 'raced-%'") == 30

        # -- a bounded batch: on-policy (k = 0), 4 episodes per version, admission running in both schedulers ----
        r = post(a.url, {**fixed_turns(8), "group_size": 2, "batch_id": "bounded", "max_staleness": 0,
                         "episodes_per_version": 4})
        assert r.status_code == 201, r.text
        batch_ids.append("bounded")
        admitted = "select count(*) from episodes where batch_id = 'bounded' and status <> 'waiting'"
        for version in range(4):
            if version:
                with LedgerClient(urls[version % 2], API_TOKEN) as client:
                    client.publish_version(version, model_dir, timeout_s=120)  # the same weights, a new version
            bound = 4 * (version + 1)
            wait_for(lambda b=bound: sql.scalar(admitted) == b, 60, f"{bound} episodes admitted at version {version}")
            # both schedulers run three more passes each at this version: none may admit past the bound
            passes = [metric(u, "rollout_admission_passes_total") for u in urls]
            wait_for(lambda p=passes: all(metric(u, "rollout_admission_passes_total") >= n + 3
                                          for u, n in zip(urls, p, strict=True)), 30, "three passes per scheduler")
            assert sql.scalar(admitted) == bound, f"admitted past the bound at version {version}"
        assert sum(metric(u, "rollout_episodes_admitted_total") for u in urls) == 16, "each admitted once"

        total = 8 * 20 + 3 * 10 + 16
        ended = "select count(*) from trajectories where batch_id = any(:b)"
        wait_for(lambda: sql.scalar(ended, b=batch_ids) == total, 180, f"{total} trajectories")

        # -- both outboxes at once: forgotten work items are republished, each by one scheduler ----------------
        # (env workers stopped, so the items stay queued and still ``requested``; published_at cleared is what a
        # crash between the episodes' commit and their publish leaves)
        env_workers = [p for p in stack.procs if p.service == "env-worker"]
        for proc in env_workers:
            proc.stop()
        r = post(b.url, fixed_turns(40, batch_id="forgotten"))
        assert r.status_code == 201 and r.json()["num_published"] == 40, r.text
        batch_ids.append("forgotten")
        republished_before = sum(metric(u, "rollout_outbox_republished_total") for u in urls)
        sql.execute("update episodes set published_at = null where batch_id = 'forgotten'")
        wait_for(lambda: sql.scalar("select count(*) from episodes where batch_id = 'forgotten' "
                                    "and published_at is null") == 0, 60, "the outboxes to republish every item")
        by_scheduler = [metric(u, "rollout_outbox_republished_total") for u in urls]
        assert sum(by_scheduler) - republished_before == 40, f"each item republished once: {by_scheduler}"
        for proc in env_workers:
            stack.start("env-worker", name=proc.name, **FAST)
        total += 40
        wait_for(lambda: sql.scalar(ended, b=batch_ids) == total, 120, f"{total} trajectories")

        # -- everything ended once, and nothing was generated twice ---------------------------------------------
        statuses = {r["status"]: r["n"] for r in sql.rows(
            "select status, count(*) as n from episodes where batch_id = any(:b) group by status", b=batch_ids)}
        assert statuses == {"completed": total}
        in_batches = "episode_id in (select id from episodes where batch_id = any(:b))"
        assert sql.scalar(f"select count(*) from turns where {in_batches}", b=batch_ids) == total * TURNS, \
            "every turn generated once (a work item run twice would generate its turns again)"
        assert sql.scalar(f"select count(*) from steps where {in_batches}", b=batch_ids) == total * TURNS
        assert sql.scalar("select count(*) from episodes where batch_id = any(:b) and attempt <> 1",
                          b=batch_ids) == 0
    finally:
        sql.close()
