"""The OpenEnv adapter against a tiny in-test WebSocket server speaking OpenEnv's frames: settings parsing, the
observation/action mapping, and the failure classes (refused, capacity, closed mid-episode, malformed, timeout).

The adapter against a real OpenEnv server process is tested in tests/integration/test_openenv.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from rollout_ledger.cli.stack.servers import free_port
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.envs.base import EnvContext, TaskError
from rollout_ledger.services.envs.library import library_specs
from rollout_ledger.services.envs.openenv_remote import (
    OpenEnvEndpoint,
    OpenEnvEnv,
    SessionPool,
    action_json,
    parse_openenv_envs,
    ws_url,
)
from rollout_ledger.services.envs.remote import RemoteConfig
from rollout_ledger.shared.errors import EnvError
from tests.helpers import until

Frame = dict[str, Any]
Reply = Callable[[ServerConnection, Frame], Awaitable[None]]


def obs(fields: dict[str, Any], reward: Any = 0.0, done: bool = False, **extra: Any) -> str:
    return json.dumps({"type": "observation", "data": {"observation": {"metadata": {}, **fields}, "reward": reward,
                                                       "done": done, **extra}})


def error(code: str, message: str = "nope") -> str:
    return json.dumps({"type": "error", "data": {"code": code, "message": message}})


@dataclass
class FakeOpenEnv:
    """An OpenEnv-shaped server: per connection a counter env (``step`` answers ``n`` and reward 1 at n == 3);
    ``on_connect``/``on_step`` override the answers to provoke failures."""

    connections: int = 0
    open_now: int = 0
    max_open: int = 0
    received: list[Frame] = field(default_factory=list)
    on_connect: Callable[[int], str | None] = lambda n: None
    """An error frame to send (then close) on connection number n (1-based), or None."""
    on_step: Reply | None = None
    hold_reset_s: float = 0.0
    server: Server | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        try:
            refusal = self.on_connect(self.connections)
            if refusal is not None:
                await ws.send(refusal)
                return
            n = 0
            async for raw in ws:
                msg = json.loads(raw)
                self.received.append(msg)
                if msg["type"] == "reset":
                    await asyncio.sleep(self.hold_reset_s)
                    n = 0
                    await ws.send(obs({"text": "ready", "n": n}))
                elif msg["type"] == "step" and self.on_step is not None:
                    await self.on_step(ws, msg)
                elif msg["type"] == "step":
                    if "message" not in msg["data"]:
                        await ws.send(error("VALIDATION_ERROR", "Invalid message"))
                        continue
                    n += 1
                    await ws.send(obs({"text": f"n={n}", "n": n}, reward=1.0 if n == 3 else 0.0, done=n == 3))
                elif msg["type"] == "close":
                    return
        except ConnectionClosed:
            pass
        finally:
            self.open_now -= 1


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenEnv]:
    f = FakeOpenEnv()
    async with serve(f.handler, "127.0.0.1", 0) as server:
        f.server = server
        f.port = next(iter(server.sockets)).getsockname()[1]
        yield f


FAST = RemoteConfig(timeout_s=2.0, retries=2, backoff_s=0.01, backoff_max_s=0.05, concurrency=4, startup_jitter_s=0)


def make_env(url: str, config: RemoteConfig = FAST, retries: list[int] | None = None,
             **endpoint: Any) -> OpenEnvEnv:
    counter = retries if retries is not None else []
    pool = SessionPool(OpenEnvEndpoint("counter", ws_url(url), **endpoint), config,
                       on_retry=lambda: counter.append(1))
    env = OpenEnvEnv(pool)
    env.bind(EnvContext(episode_id="b.0.0", batch_id="b", attempt=1))
    return env


# --- settings -------------------------------------------------------------------------------------------
def test_parse_openenv_envs() -> None:
    assert parse_openenv_envs(" echo=http://h:8000 , g=wss://x/p/ws;action=json;observation=board;concurrency=2,") \
        == [OpenEnvEndpoint("echo", "ws://h:8000/ws"),
            OpenEnvEndpoint("g", "wss://x/p/ws", action="json", observation="board", concurrency=2)]
    assert ws_url("https://h/prefix/") == "wss://h/prefix/ws"
    assert parse_openenv_envs("") == []
    assert OpenEnvEndpoint("echo", "ws://h/ws").registry_name == "openenv:echo"
    for bad, why in (("echo", "expected name=url"), ("a b=ws://h", "expected name=url"),
                     ("a=ftp://h", "must start with ws://"), ("a=ws://h?x=1", "query"),
                     ("a=ws://h,a=ws://g", "twice"), ("a=ws://h;colour=red", "not one of"),
                     ("a=ws://h;concurrency=0", "concurrency"), ("a=ws://h;action=a b", "field name"),
                     ("a=ws://h;action=x;action=y", "given twice")):
        with pytest.raises(ValueError, match=why):
            parse_openenv_envs(bad)


def test_settings_register_openenv_envs_and_refuse_bad_ones() -> None:
    with pytest.raises(ValueError, match="OpenEnv env 'nourl'"):
        EnvWorkerSettings(openenv_envs="nourl")
    s = EnvWorkerSettings(openenv_envs="echo=http://127.0.0.1:9;concurrency=1,chess=ws://h:1;action=json",
                          openenv_concurrency=3, remote_timeout_s=7)
    specs = {spec.name: spec for spec in library_specs(s)}
    assert {"openenv:echo", "openenv:chess"} <= set(specs)
    echo = specs["openenv:echo"].factory()
    assert isinstance(echo, OpenEnvEnv)
    assert (echo.pool.config.concurrency, echo.pool.config.timeout_s) == (1, 7)
    chess = specs["openenv:chess"].factory()
    assert isinstance(chess, OpenEnvEnv) and chess.pool.config.concurrency == 3
    assert "JSON action" in specs["openenv:chess"].description


def test_action_json_finds_the_object() -> None:
    assert action_json(' {"move": "e2e4"} ') == {"move": "e2e4"}
    assert action_json('I play ```json\n{"move": "e2e4", "n": 1}\n``` ok') == {"move": "e2e4", "n": 1}
    assert action_json("e2e4") is None and action_json("[1, 2]") is None


# --- the mapping ----------------------------------------------------------------------------------------
async def test_a_multi_step_episode_maps_observations_actions_and_done(fake: FakeOpenEnv) -> None:
    env = make_env(fake.url, observation="text")
    prompt = await env.reset({"seed": 7, "system": "Count.", "reset": {"level": 2}})
    assert prompt == [{"role": "system", "content": "Count."}, {"role": "user", "content": "ready"}]
    assert fake.received[0] == {"type": "reset", "data": {"level": 2, "seed": 7, "episode_id": "b.0.0"}}
    one = await env.step("a")
    assert (one.observation, one.reward, one.terminated, one.truncated) == (
        [{"role": "user", "content": "n=1"}], 0.0, False, False)
    assert fake.received[1] == {"type": "step", "data": {"message": "a"}}
    await env.step("b")
    last = await env.step("c")
    assert (last.observation, last.reward, last.terminated, last.truncated) == ([], 1.0, True, False)
    assert last.info == {"final_observation": "n=3"}
    await env.close()
    await until(lambda: fake.received[-1] == {"type": "close"} and fake.open_now == 0, 5, "the session closed")
    assert fake.connections == 1  # one session for the whole episode


async def test_default_rendering_is_every_field_as_json_and_bad_tasks_are_task_errors(fake: FakeOpenEnv) -> None:
    env = make_env(fake.url)
    assert await env.reset({}) == [{"role": "user", "content": '{"text": "ready", "n": 0}'}]
    await env.close()
    for task in ({"colour": 1}, {"reset": [1]}, {"seed": "x"}, {"system": 3}):
        with pytest.raises(TaskError):
            await make_env(fake.url).reset(task)
    missing = make_env(fake.url, observation="board")
    with pytest.raises(EnvError, match="no field 'board'") as err:
        await missing.reset({})
    assert err.value.retryable is False
    await missing.close()


async def test_truncated_done_and_reward_shapes(fake: FakeOpenEnv) -> None:
    answers = iter([obs({"t": 1}, reward=None), obs({"t": 2}, reward=True),
                    obs({"t": 3}, reward=2, done=True, metadata={"truncated": True, "why": "budget"})])

    async def reply(ws: ServerConnection, msg: Frame) -> None:
        await ws.send(next(answers))
    fake.on_step = reply
    env = make_env(fake.url)
    await env.reset({})
    assert (await env.step("x")).reward == 0.0
    assert (await env.step("x")).reward == 1.0
    end = await env.step("x")
    assert (end.reward, end.terminated, end.truncated) == (2.0, False, True)
    assert end.info["metadata"] == {"truncated": True, "why": "budget"}
    await env.close()


async def test_json_actions_and_what_a_refused_action_means(fake: FakeOpenEnv) -> None:
    env = make_env(fake.url, action="json")
    await env.reset({})
    ok = await env.step('Sure: {"message": "hi"}')
    assert ok.observation == [{"role": "user", "content": '{"text": "n=1", "n": 1}'}]
    no_json = await env.step("hi")  # the policy's mistake: the episode ends, no outcome
    assert (no_json.aborted, no_json.reward) == (True, 0.0) and "no JSON object" in no_json.info["invalid_action"]
    refused = await env.step('{"msg": "hi"}')
    assert refused.aborted and "VALIDATION_ERROR" in refused.info["invalid_action"]
    await env.close()
    wrong_field = make_env(fake.url, action="text")  # our configuration's mistake
    await wrong_field.reset({})
    with pytest.raises(EnvError, match="set the env's action= option") as err:
        await wrong_field.step("hi")
    assert err.value.retryable is False
    await wrong_field.close()


# --- failure classes -------------------------------------------------------------------------------------
async def test_a_refused_connection_is_retried_then_env_retryable() -> None:
    retries: list[int] = []
    env = make_env(f"ws://127.0.0.1:{free_port()}", retries=retries)
    with pytest.raises(EnvError, match="no session after 3 tries") as err:
        await env.reset({})
    assert err.value.retryable is True and len(retries) == 2
    await env.close()


async def test_a_server_at_capacity_is_retried_and_then_serves(fake: FakeOpenEnv) -> None:
    fake.on_connect = lambda n: error("CAPACITY_REACHED", "Server at capacity: 1/1") if n == 1 else None
    retries: list[int] = []
    env = make_env(fake.url, retries=retries)
    assert await env.reset({}) == [{"role": "user", "content": '{"text": "ready", "n": 0}'}]
    assert len(retries) == 1 and fake.connections == 2
    await env.close()


async def test_a_refused_reset_and_a_4xx_handshake_are_not_retried(fake: FakeOpenEnv) -> None:
    fake.on_connect = lambda n: error("VALIDATION_ERROR", "bad reset kwargs")
    retries: list[int] = []
    env = make_env(fake.url, retries=retries)
    with pytest.raises(EnvError, match="reset refused: VALIDATION_ERROR") as err:
        await env.reset({})
    assert err.value.retryable is False and retries == []
    await env.close()

    async def not_found(conn: ServerConnection, request: Any) -> Any:
        return conn.respond(HTTPStatus.NOT_FOUND, "no /ws here\n")
    async with serve(fake.handler, "127.0.0.1", 0, process_request=not_found) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        env = make_env(f"http://127.0.0.1:{port}", retries=retries)
        with pytest.raises(EnvError, match="HTTP 404") as err:
            await env.reset({})
        assert err.value.retryable is False and retries == []
        await env.close()


async def test_the_server_closing_mid_episode_is_env_retryable(fake: FakeOpenEnv) -> None:
    async def hang_up(ws: ServerConnection, msg: Frame) -> None:
        await ws.close()
    fake.on_step = hang_up
    env = make_env(fake.url)
    await env.reset({})
    with pytest.raises(EnvError, match=r"step 0: connection closed .*session is lost") as err:
        await env.step("a")
    assert err.value.retryable is True
    await env.close()


@pytest.mark.parametrize(("answer", "why"), [
    ("not json", "frame is not JSON"),
    ('["observation"]', "not an object"),
    ('{"type": "state", "data": {}}', "expected a frame of type 'observation'"),
    ('{"type": "observation", "data": {"observation": "x", "reward": 0}}', "'observation' must be an object"),
    ('{"type": "observation", "data": {"observation": {}, "reward": "high"}}', "is not a number"),
    ('{"type": "observation", "data": {"observation": {}, "reward": NaN}}', "not a finite number"),
    ('{"type": "observation", "data": {"observation": {}, "reward": 1' + "0" * 400 + '}}', "not a finite number"),
    ('{"type": "observation", "data": {"observation": {}, "done": "yes"}}', "'done' must be a boolean"),
    (error("UNKNOWN_TYPE"), "UNKNOWN_TYPE"),
])
async def test_a_malformed_answer_is_not_retryable(fake: FakeOpenEnv, answer: str, why: str) -> None:
    async def bad(ws: ServerConnection, msg: Frame) -> None:
        await ws.send(answer)
    fake.on_step = bad
    env = make_env(fake.url)
    await env.reset({})
    with pytest.raises(EnvError, match=why) as err:
        await env.step("a")
    assert err.value.retryable is False
    await env.close()


async def test_an_env_failing_its_step_is_env_retryable(fake: FakeOpenEnv) -> None:
    async def boom(ws: ServerConnection, msg: Frame) -> None:
        await ws.send(error("EXECUTION_ERROR", "division by zero"))
    fake.on_step = boom
    env = make_env(fake.url)
    await env.reset({})
    with pytest.raises(EnvError, match="EXECUTION_ERROR: division by zero") as err:
        await env.step("a")
    assert err.value.retryable is True
    await env.close()


async def test_timeouts(fake: FakeOpenEnv) -> None:
    quick = RemoteConfig(timeout_s=0.2, retries=1, backoff_s=0.01, backoff_max_s=0.01, startup_jitter_s=0)

    async def silent(ws: ServerConnection, msg: Frame) -> None:
        return None
    fake.on_step = silent
    env = make_env(fake.url, quick)
    await env.reset({})
    started = time.monotonic()
    with pytest.raises(EnvError, match=r"no answer within 0\.2s") as err:
        await env.step("a")
    assert err.value.retryable is True and time.monotonic() - started < 1.5
    await env.close()

    fake.hold_reset_s = 5  # every reset hangs: retried, then retryable
    retries: list[int] = []
    env = make_env(fake.url, quick, retries=retries)
    with pytest.raises(EnvError, match=r"no session after 2 tries.*no answer within") as err:
        await env.reset({})
    assert err.value.retryable is True and retries == [1]
    await env.close()


async def test_the_pool_bounds_open_sessions(fake: FakeOpenEnv) -> None:
    one = RemoteConfig(timeout_s=2, retries=0, concurrency=1, startup_jitter_s=0)
    pool = SessionPool(OpenEnvEndpoint("counter", ws_url(fake.url)), one)
    first, second = OpenEnvEnv(pool), OpenEnvEnv(pool)
    await first.reset({})
    waiting = asyncio.create_task(second.reset({}))
    await until(lambda: pool.slots.waiting == 1, 5, "the second episode asking for the slot")
    assert not waiting.done() and fake.connections == 1  # and waits for it: no second connection
    await first.close()
    await asyncio.wait_for(waiting, 5)
    await second.close()
    assert fake.max_open == 1 and fake.connections == 2
