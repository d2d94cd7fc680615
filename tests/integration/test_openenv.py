"""OpenEnv envs against a REAL OpenEnv server: the ``openenv`` package's echo env (rendered by ``openenv init``,
served by uvicorn from ``.venv-openenv``; tests/openenv_server.py), one WebSocket session per episode.

First the adapter alone (a multi-step episode, the action mapping's errors, a server at capacity), then one batch
through real service processes (fake engine) with the rewards the server computed recorded per step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.envs.base import EnvContext
from rollout_ledger.services.envs.openenv_remote import OpenEnvEndpoint, OpenEnvEnv, SessionPool, ws_url
from rollout_ledger.services.envs.remote import RemoteConfig
from rollout_ledger.shared.errors import EnvError
from tests.helpers import AUTH, Sql, until
from tests.integration.test_pipeline import check_token_exact
from tests.integration.test_remote_env import counts, failures, submit, wait_done
from tests.openenv_server import OpenEnvServer, openenv_python


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenEnvServer]:
    """One echo server for the module (``max_concurrent_envs=1``, as its template is generated)."""
    server = OpenEnvServer(openenv_python(), tmp_path_factory.mktemp("openenv"))
    server.render()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def echo_reward(text: str) -> float:
    """The echo env's reward for an action (its template: ``min(len(message) * 0.1, 1.0)``)."""
    return min(len(text) * 0.1, 1.0)


def _env(url: str, retries: list[int] | None = None, **options: str) -> OpenEnvEnv:
    config = RemoteConfig(timeout_s=5, retries=20, backoff_s=0.05, backoff_max_s=0.2, concurrency=1,
                          startup_jitter_s=0)
    counter = retries if retries is not None else []
    env = OpenEnvEnv(SessionPool(OpenEnvEndpoint("echo", ws_url(url), **options), config,
                                 on_retry=lambda: counter.append(1)))
    env.bind(EnvContext(episode_id="b.0.0", batch_id="b", attempt=1))
    return env


async def test_a_multi_step_episode_on_the_real_server(echo_server: OpenEnvServer) -> None:
    env = _env(echo_server.url, observation="echoed_message")
    assert await env.reset({"seed": 3, "system": "Echo."}) == [
        {"role": "system", "content": "Echo."}, {"role": "user", "content": "Echo Env environment ready!"}]
    first = await env.step("hello")
    assert (first.observation, first.reward, first.terminated, first.truncated) == (
        [{"role": "user", "content": "hello"}], 0.5, False, False)
    second = await env.step("a longer reply")  # the same session: the server's step count goes on
    assert (second.observation, second.reward) == ([{"role": "user", "content": "a longer reply"}], 1.0)
    assert second.info == {"metadata": {"original_message": "a longer reply", "step": 2}}
    await env.close()

    default = _env(echo_server.url, action="json")  # every field as JSON; the reply is the action's JSON
    assert await default.reset({}) == [
        {"role": "user", "content": '{"echoed_message": "Echo Env environment ready!", "message_length": 0}'}]
    step = await default.step('{"message": "hey"}')
    assert json.loads(step.observation[0]["content"]) == {"echoed_message": "hey", "message_length": 3}
    refused = await default.step('{"text": "hey"}')  # the server's VALIDATION_ERROR: the policy's mistake
    assert refused.aborted and "VALIDATION_ERROR" in refused.info["invalid_action"]
    await default.close()

    wrong = _env(echo_server.url, action="text")  # our mapping's mistake: not retried
    await wrong.reset({})
    with pytest.raises(EnvError, match=r"VALIDATION_ERROR.*action= option") as err:
        await wrong.step("hey")
    assert err.value.retryable is False
    await wrong.close()


async def test_a_server_at_capacity_is_retried_until_its_session_frees(echo_server: OpenEnvServer) -> None:
    async with websockets.connect(ws_url(echo_server.url), proxy=None) as other:  # holds the server's one session
        await other.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(await other.recv())["type"] == "observation"
        retries: list[int] = []
        env = _env(echo_server.url, retries=retries)
        reset = asyncio.create_task(env.reset({}))
        await until(lambda: len(retries) >= 2, 10, "two retries of the refused reset")
        assert not reset.done()  # refused (CAPACITY_REACHED), retried with backoff
        await other.send(json.dumps({"type": "close"}))
    assert (await asyncio.wait_for(reset, 10))[0]["role"] == "user"
    assert (await env.step("hi")).reward == pytest.approx(0.2)
    await env.close()


def test_a_batch_through_the_stack_records_the_servers_rewards(
        stack: Stack, database_url: str, echo_server: OpenEnvServer) -> None:
    stack.start("inference-worker", ROLLOUT_ENGINE="fake")
    served = f"echo={echo_server.url};observation=echoed_message;concurrency=1"
    stack.start("env-worker", ROLLOUT_OPENENV_ENVS=f"{served},gone=ws://127.0.0.1:{free_port()}",
                ROLLOUT_REMOTE_STARTUP_JITTER_S="0", ROLLOUT_REMOTE_TIMEOUT_S="5", ROLLOUT_REMOTE_RETRIES="1",
                ROLLOUT_REMOTE_BACKOFF_S="0.05", ROLLOUT_RETRY_ENV="1")
    stack.start("recorder")
    url = stack.start("scheduler").url
    names = {e["name"] for e in httpx.get(f"{url}/v1/envs", headers=AUTH, timeout=10).json()["envs"]}
    assert {"openenv:echo", "openenv:gone"} <= names
    batch_id = submit(url, "openenv:echo", [{"seed": 0}, {"seed": 1}], max_turns=3, group_size=2, max_tokens=2)
    gone_id = submit(url, "openenv:gone", [{"seed": 0}])  # nothing listens there: refused, retried, class env
    info = wait_done(url, batch_id)
    assert counts(info) == {"truncated": 4}  # the echo env is never done: max_turns ends each episode
    assert counts(wait_done(url, gone_id)) == {"failed": 1}
    sql = Sql(database_url)
    try:
        assert check_token_exact(sql, batch_id) == 4
        steps = sql.rows("select s.episode_id, s.action, s.observation, s.reward, s.info from steps s "
                         "join episodes e on e.id = s.episode_id where e.batch_id = :b and not s.superseded "
                         "order by s.episode_id, s.turn_index", b=batch_id)
        assert len(steps) == 4 * 3
        for i, s in enumerate(steps):  # the server received the policy's exact text: echoes it, scores its length
            assert s["observation"] == (s["action"] if i % 3 < 2 else "")  # the last turn's is not shown
            assert s["reward"] == pytest.approx(echo_reward(s["action"]))
            assert s["info"]["metadata"]["original_message"] == s["action"]
        assert [s["info"]["metadata"]["step"] for s in steps] == [1, 2, 3] * 4  # one session per episode
        rewards = {r["id"]: r["reward"] for r in sql.rows("select id, reward from episodes where batch_id = :b",
                                                           b=batch_id)}
        for episode_id, reward in rewards.items():
            assert reward == pytest.approx(sum(s["reward"] for s in steps if s["episode_id"] == episode_id))
        assert any(s["reward"] < 1.0 for s in steps)  # short replies: rewards below the cap, so they tell apart
        rows = failures(sql, gone_id)  # retryable: the attempt budget (ROLLOUT_RETRY_ENV=1) ran a second attempt
        assert [(r["attempt"], r["failure_class"], r["retried"]) for r in rows] == [(1, "env", True), (2, "env", False)]
        assert all("no session after 2 tries" in r["reason"] for r in rows)
        prompt = sql.scalar("select prompt_text from episodes where batch_id = :b limit 1", b=batch_id)
        assert "Echo Env environment ready!" in prompt
    finally:
        sql.close()


def test_the_helper_says_make_openenv_when_the_venv_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_OPENENV_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(pytest.fail.Exception, match="make openenv"):
        openenv_python()
