"""Remote environment actors and failure budgets, with real processes on real NATS + Postgres.

The reference environment server (``rollout envserver``) runs as a separate process on a free port; tests kill
it with SIGKILL and start it again on the same port and state directory. Episodes go through the scheduler,
an env worker and the recorder (real processes); turns come from the fake engine (a real inference-worker
process) or, where a test must hold a turn at a chosen moment, from the in-test scripted ``Policy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.cli.stack.supervisor import Stack
from tests.helpers import AUTH, Sql, metric, until, wait_for
from tests.integration.policy import Policy
from tests.integration.test_pipeline import check_token_exact


@dataclass
class EnvServerProcess:
    """``rollout envserver`` as a child process: start, SIGKILL, start again on the same port and state."""

    log_dir: Path
    state_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> EnvServerProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_dir / f"envserver-{self.starts}.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_ledger.cli.main", "envserver", "--host", "127.0.0.1",
             "--port", str(self.port), "--state-dir", str(self.state_dir)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._healthy, timeout_s, f"envserver on port {self.port}")
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"envserver exited with {self.proc.returncode}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or closed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def stats(self) -> dict[str, int]:
        data: dict[str, int] = httpx.get(f"{self.url}/stats", timeout=5).json()
        return data


@pytest.fixture
def envserver(tmp_path: Path) -> Iterator[EnvServerProcess]:
    server = EnvServerProcess(tmp_path / "envserver-logs", tmp_path / "envserver-state").start()
    yield server
    server.stop()


FAST_REMOTE = {"ROLLOUT_REMOTE_STARTUP_JITTER_S": "0", "ROLLOUT_REMOTE_TIMEOUT_S": "5"}


def submit(url: str, env: str, tasks: list[dict[str, Any]], max_turns: int = 6, group_size: int = 1,
           max_tokens: int = 24) -> str:
    resp = httpx.post(f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": env, "tasks": tasks, "group_size": group_size, "max_turns": max_turns,
        "sampling": {"temperature": 1.0, "max_tokens": max_tokens}})
    assert resp.status_code == 201, resp.text
    batch_id: str = resp.json()["batch_id"]
    return batch_id


def wait_done(url: str, batch_id: str, timeout_s: float = 90) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        info: dict[str, Any] = httpx.get(f"{url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()
        return info if info["done"] else None
    return wait_for(done, timeout_s, f"batch {batch_id} to finish", interval_s=0.2)


def counts(info: dict[str, Any]) -> dict[str, int]:
    """The batch's non-zero counts by status."""
    return {k: v for k, v in info["counts"].items() if v}


def failures(sql: Sql, batch_id: str) -> list[dict[str, Any]]:
    return sql.rows("select episode_id, attempt, failure_class, reason, retried from attempt_failures "
                    "where batch_id = :b order by episode_id, attempt", b=batch_id)


# --- a full episode over HTTP, token-exact ------------------------------------------------------------
def test_remote_episodes_are_token_exact_and_match_the_builtin_prompts(
        stack: Stack, database_url: str, envserver: EnvServerProcess) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    remote = f"guess-number={envserver.url},arithmetic={envserver.url},retail-orders={envserver.url}"
    stack.start("env-worker", ROLLOUT_REMOTE_ENVS=remote, **FAST_REMOTE)
    stack.start("recorder")
    url = stack.start("scheduler").url
    names = {e["name"] for e in httpx.get(f"{url}/v1/envs", headers=AUTH, timeout=10).json()["envs"]}
    assert {"remote:guess-number", "remote:arithmetic", "remote:retail-orders", "guess-number"} <= names

    tasks = [{"seed": i} for i in range(3)]
    batches = {env: submit(url, env, tasks, max_turns=4, group_size=2)
               for env in ("remote:guess-number", "guess-number", "remote:arithmetic", "remote:retail-orders")}
    for batch_id in batches.values():
        wait_done(url, batch_id)
    sql = Sql(database_url)
    try:
        for env, batch_id in batches.items():
            assert check_token_exact(sql, batch_id) == 6, env
            assert sql.scalar("select count(*) from episodes where batch_id = :b and status = 'failed'",
                              b=batch_id) == 0
        # the server's rendering is the built-in's: the same prompt ids for the same task
        def prompts(batch_id: str) -> dict[Any, list[int]]:
            return {str(r["task"]): list(r["prompt_token_ids"]) for r in sql.rows(
                "select task, prompt_token_ids from episodes where batch_id = :b and group_index = 0", b=batch_id)}
        assert prompts(batches["remote:guess-number"]) == prompts(batches["guess-number"])
        # multi-turn observations came from the server (get_task_prompt after each step)
        feedback = {r["observation"] for r in sql.rows(
            "select s.observation from steps s join episodes e on e.id = s.episode_id "
            "where e.batch_id = :b and s.observation <> ''", b=batches["remote:guess-number"])}
        assert feedback <= {"higher", "lower", "Please reply with a single integer."} and feedback
        # retail-orders' tools came over the wire: the prompt renders the tool schemas
        prompt = sql.scalar("select prompt_text from episodes where batch_id = :b limit 1",
                            b=batches["remote:retail-orders"])
        assert "find_user_by_email" in prompt and "<tools>" in prompt
    finally:
        sql.close()
    stats = envserver.stats()
    assert stats["reset"] == 18 and stats.get("reset.5xx", 0) == 0 and stats["step"] >= 18
    assert stats["close"] == 18


# --- the server killed mid-episode ------------------------------------------------------------------
def _kill_env(**extra: str) -> dict[str, str]:
    return {"ROLLOUT_REMOTE_BACKOFF_S": "0.1", "ROLLOUT_REMOTE_BACKOFF_MAX_S": "0.5", **FAST_REMOTE, **extra}


async def _start(stack: Stack, service: str, **env: str) -> Any:
    return await asyncio.to_thread(stack.start, service, **env)


async def test_server_killed_mid_episode_and_restarted_in_time_completes(
        stack: Stack, database_url: str, envserver: EnvServerProcess, policy: Policy) -> None:
    policy.hold = lambda r: r.turn_index == 1
    worker = await _start(stack, "env-worker", ROLLOUT_REMOTE_ENVS=f"guess-number={envserver.url}",
                          **_kill_env(ROLLOUT_REMOTE_RETRIES="60"))
    await _start(stack, "recorder")
    url = (await _start(stack, "scheduler")).url
    batch_id = await asyncio.to_thread(submit, url, "remote:guess-number",
                                       [{"target": 37, "low": 1, "high": 100}])
    await until(lambda: any(r.turn_index == 1 for r in policy.requests), 30, "turn 1 to be requested")
    envserver.kill()  # between step 0 and step 1: the next request is refused
    policy.release.set()
    await until(lambda: metric(worker.url, "rollout_remote_env_retries_total") >= 2, 30, "retries of step 1")
    await asyncio.to_thread(envserver.start)  # same port, same journal
    info = await asyncio.to_thread(wait_done, url, batch_id)
    assert counts(info) == {"completed": 1}
    sql = Sql(database_url)
    try:
        ep = sql.rows("select status, attempt, reward, num_turns from episodes where batch_id = :b", b=batch_id)[0]
        assert (ep["status"], ep["attempt"], ep["reward"], ep["num_turns"]) == ("completed", 1, 1.0, 3)
        assert check_token_exact(sql, batch_id) == 1
        assert [s["observation"] for s in sql.rows(
            "select observation from steps s join episodes e on e.id = s.episode_id where e.batch_id = :b "
            "order by s.turn_index", b=batch_id)] == ["lower", "higher", ""]  # 50, 25, 37: resumed, not restarted
        assert failures(sql, batch_id) == []
    finally:
        sql.close()
    stats = envserver.stats()  # the restarted server rebuilt the actor from its journal and took steps 1 and 2
    assert stats.get("reset", 0) == 0 and stats["step"] == 2 and stats.get("step.4xx", 0) == 0


async def test_server_killed_and_not_restarted_is_an_env_failure_after_its_budget(
        stack: Stack, database_url: str, envserver: EnvServerProcess, policy: Policy) -> None:
    policy.hold = lambda r: r.turn_index == 1 and r.attempt == 1
    await _start(stack, "env-worker", ROLLOUT_REMOTE_ENVS=f"guess-number={envserver.url}",
                 **_kill_env(ROLLOUT_REMOTE_RETRIES="2", ROLLOUT_RETRY_ENV="1"))
    await _start(stack, "recorder")
    url = (await _start(stack, "scheduler")).url
    batch_id = await asyncio.to_thread(submit, url, "remote:guess-number",
                                       [{"target": 37, "low": 1, "high": 100}])
    await until(lambda: any(r.turn_index == 1 for r in policy.requests), 30, "turn 1 to be requested")
    envserver.kill()
    policy.release.set()
    info = await asyncio.to_thread(wait_done, url, batch_id)
    assert counts(info) == {"failed": 1}
    sql = Sql(database_url)
    try:
        ep = sql.rows("select id, status, attempt, failure_class, failure_reason from episodes "
                      "where batch_id = :b", b=batch_id)[0]
        assert (ep["status"], ep["attempt"], ep["failure_class"]) == ("failed", 2, "env")
        assert "no answer after 3 requests" in ep["failure_reason"]
        rows = failures(sql, batch_id)
        assert [(r["attempt"], r["failure_class"], r["retried"]) for r in rows] == [(1, "env", True),
                                                                                    (2, "env", False)]
        assert "step 1" in rows[0]["reason"] and "reset" in rows[1]["reason"]
        # attempt 1 kept its turns as rows, superseded by attempt 2; the failed trajectory is attempt 2's
        assert sql.scalar("select attempt from trajectories where episode_id = :e", e=ep["id"]) in (2, None)
    finally:
        sql.close()


# --- 4xx: never retried -------------------------------------------------------------------------------
def test_a_4xx_is_not_retried(stack: Stack, database_url: str, envserver: EnvServerProcess) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    worker = stack.start("env-worker", ROLLOUT_REMOTE_ENVS=f"guess-number={envserver.url}",
                         ROLLOUT_RETRY_ENV="3", **FAST_REMOTE)
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = submit(url, "remote:guess-number", [{"target": 0, "low": 1, "high": 9}, {"seed": 1}])
    info = wait_done(url, batch_id)
    assert counts(info).get("failed") == 1 and info["num_episodes"] == 2
    assert envserver.stats()["reset.4xx"] == 1  # one request: no retry of the request, no second attempt
    assert metric(worker.url, "rollout_remote_env_retries_total") == 0
    sql = Sql(database_url)
    try:
        rows = failures(sql, batch_id)
        assert [(r["attempt"], r["failure_class"], r["retried"]) for r in rows] == [(1, "env", False)]
        assert "HTTP 422" in rows[0]["reason"] and "not within [1, 9]" in rows[0]["reason"]
    finally:
        sql.close()


# --- budgets: N failures with budget N-1; the rest of the batch finishes -----------------------------
def test_env_failing_every_attempt_spends_its_budget_and_the_batch_finishes(
        stack: Stack, database_url: str, envserver: EnvServerProcess) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    worker = stack.start("env-worker", ROLLOUT_REMOTE_ENVS=f"fixed-turns={envserver.url}", ROLLOUT_RETRY_ENV="2",
                         ROLLOUT_REMOTE_RETRIES="1", ROLLOUT_REMOTE_BACKOFF_S="0.05", **FAST_REMOTE)
    stack.start("recorder")
    url = stack.start("scheduler").url
    tasks = [{"turns": 3, "fail_at": 2}, {"turns": 2}, {"turns": 3}, {"turns": 1}]
    batch_id = submit(url, "remote:fixed-turns", tasks, max_turns=4, max_tokens=8)
    info = wait_done(url, batch_id)
    assert counts(info) == {"completed": 3, "failed": 1}
    sql = Sql(database_url)
    try:
        rows = failures(sql, batch_id)
        assert [(r["attempt"], r["failure_class"], r["retried"]) for r in rows] == [
            (1, "env", True), (2, "env", True), (3, "env", False)]
        assert {r["episode_id"] for r in rows} == {f"{batch_id}.0.0"}
        assert all("InjectedEnvFault" in r["reason"] and "HTTP 500" in r["reason"] for r in rows)
        failed = sql.rows("select attempt, failure_class, num_turns from episodes where status = 'failed' "
                          "and batch_id = :b", b=batch_id)
        assert failed == [{"attempt": 3, "failure_class": "env", "num_turns": 1}]
        # failures are queryable by class
        by_class = sql.rows("select failure_class, count(*) as n, count(*) filter (where retried) as retried "
                            "from attempt_failures group by 1")
        assert by_class == [{"failure_class": "env", "n": 3, "retried": 2}]
        assert check_token_exact(sql, batch_id) == 4  # the failed one keeps attempt 3's partial trajectory
    finally:
        sql.close()
    assert metric(worker.url, "rollout_attempts_retried_total", {"failure_class": "env"}) == 2
    stats = envserver.stats()
    assert stats["step.5xx"] == 3 * 2  # each attempt: the request and its one retry
    assert stats["reset"] == 3 + 3


# --- the episode deadline -------------------------------------------------------------------------------
async def test_episode_timeout_is_class_timeout_and_cancels_inference(
        stack: Stack, database_url: str, policy: Policy) -> None:
    slow_env = {"turns": 2, "step_delay_s": 30}
    policy.hold = lambda r: r.episode_id.endswith(".1.0")  # task 1: its first turn never comes back
    worker = await _start(stack, "env-worker", ROLLOUT_EPISODE_TIMEOUT_S="2")
    await _start(stack, "recorder")
    url = (await _start(stack, "scheduler")).url
    batch_id = await asyncio.to_thread(submit, url, "fixed-turns", [slow_env, {"turns": 1}, {"turns": 2}],
                                       max_turns=3)
    info = await asyncio.to_thread(wait_done, url, batch_id, 60)
    assert counts(info) == {"failed": 2, "completed": 1}
    sql = Sql(database_url)
    try:
        eps = {r["id"]: r for r in sql.rows("select id, status, failure_class, failure_reason, attempt from episodes "
                                            "where batch_id = :b", b=batch_id)}
        for i in (0, 1):
            ep = eps[f"{batch_id}.{i}.0"]
            assert (ep["status"], ep["failure_class"], ep["attempt"]) == ("failed", "timeout", 1)
            assert "deadline of 2" in ep["failure_reason"]
        assert eps[f"{batch_id}.2.0"]["status"] == "completed"
        rows = failures(sql, batch_id)
        assert [(r["failure_class"], r["retried"]) for r in rows] == [("timeout", False)] * 2
    finally:
        sql.close()
    assert metric(worker.url, "rollout_episodes_in_flight") == 0  # the held inference no longer holds a slot
    with contextlib.suppress(Exception):
        policy.release.set()


def test_episode_timeout_aborts_the_generation_in_the_engine(stack: Stack, database_url: str) -> None:
    inference = stack.start("inference-worker", ROLLOUT_ENGINE="fake", ROLLOUT_FAKE_DELAY_S="60")
    stack.start("env-worker", ROLLOUT_EPISODE_TIMEOUT_S="1.5")
    stack.start("recorder")
    url = stack.start("scheduler").url
    batch_id = submit(url, "arithmetic", [{"seed": 1}], max_turns=1)
    info = wait_done(url, batch_id, 30)  # well before the engine's 60 s
    assert counts(info) == {"failed": 1}

    def aborted() -> bool:
        return metric(inference.url, "rollout_inference_requests_total", {"outcome": "aborted"}) == 1
    wait_for(aborted, 10, "the inference worker to abort the request")
    assert metric(inference.url, "rollout_inference_inflight") == 0
    sql = Sql(database_url)
    try:
        assert sql.scalar("select failure_class from episodes where batch_id = :b", b=batch_id) == "timeout"
        assert sql.scalar("select count(*) from turns") == 0  # the aborted generation left no turn
    finally:
        sql.close()


# --- the example server users copy -------------------------------------------------------------------
@pytest.fixture
def example_server(tmp_path: Path) -> Iterator[str]:
    """examples/remote_env/server.py as its own process; yields its URL."""
    port = free_port()
    example = Path(__file__).resolve().parents[2] / "examples" / "remote_env" / "server.py"
    with open(tmp_path / "example.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(example), "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        return False

    try:
        wait_for(up, 30, "the example server")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_example_server_speaks_the_protocol(example_server: str) -> None:
    from rollout_ledger.services.envs.remote import ActorPool, RemoteConfig, RemoteEndpoint, RemoteEnv
    from rollout_ledger.shared.errors import EnvError

    pool = ActorPool(RemoteEndpoint("reverse-word", example_server), RemoteConfig(startup_jitter_s=0))
    env = RemoteEnv(pool)
    prompt = await env.reset({"word": "ledger"})
    assert prompt == [{"role": "user", "content": "Reverse the word 'ledger'. Reply with the reversed word only."}]
    wrong = await env.step("regdle")
    assert (wrong.reward, wrong.terminated, wrong.observation[0]["role"]) == (0.0, False, "user")
    right = await env.step("regdel")
    assert (right.reward, right.terminated, right.observation) == (1.0, True, [])
    await env.close()
    bad = RemoteEnv(pool)
    with pytest.raises(EnvError, match="HTTP 422") as err:
        await bad.reset({"word": "not a word"})
    assert err.value.retryable is False
    await bad.close()
    await pool.aclose()
