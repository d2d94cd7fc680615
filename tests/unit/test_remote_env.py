"""Remote env pieces that need no server: settings parsing, KV keys, backoff, budgets, the server's actor journal.

The adapter against a real server process is tested in tests/integration/test_remote_env.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from rollout_ledger.services.env_worker.retries import RetryBudgets
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envs.remote import ActorPool, RemoteConfig, RemoteEndpoint, RemoteEnv, parse_remote_envs
from rollout_ledger.services.envserver.actors import ActorConflict, ActorNotFound, ActorTable
from rollout_ledger.shared.errors import EnvError
from rollout_ledger.shared.events import EpisodeRequested, FailureClass, SamplingParams
from rollout_ledger.shared.subjects import env_key, env_name_of_key


def test_parse_remote_envs() -> None:
    assert parse_remote_envs(" a=http://h:1 , b.c=https://x/y/ ,") == [
        RemoteEndpoint("a", "http://h:1"), RemoteEndpoint("b.c", "https://x/y")]
    assert parse_remote_envs("") == []
    assert RemoteEndpoint("a", "http://h:1").registry_name == "remote:a"
    for bad, why in (("a", "expected name="), ("a b=http://h", "expected name="), ("a=ftp://h", "http://"),
                     ("a=http://h,a=http://g", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_remote_envs(bad)


def test_settings_refuse_a_bad_remote_env_list() -> None:
    with pytest.raises(ValueError, match="remote env 'nourl'"):
        EnvWorkerSettings(remote_envs="nourl")
    s = EnvWorkerSettings(remote_envs="g=http://127.0.0.1:9", retry_env=2)
    assert [e.registry_name for e in s.remote_endpoints()] == ["remote:g"]
    assert s.retry_budgets()[FailureClass.ENV] == 2


def test_env_keys_round_trip_and_are_valid_kv_keys() -> None:
    import re

    for name in ("arithmetic", "remote:guess-number", "a=b", "agent:pkg.mod:run", "é"):
        key = env_key(name)
        assert re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key), key
        assert env_name_of_key(key) == name
    assert env_key("guess-number") == "guess-number"  # existing keys are unchanged


def test_backoff_is_exponential_capped_and_jittered() -> None:
    cfg = RemoteConfig(backoff_s=0.2, backoff_max_s=1.0)
    rng = random.Random(1)
    for retry, base in ((0, 0.2), (1, 0.4), (2, 0.8), (3, 1.0), (9, 1.0)):
        pauses = [cfg.backoff(retry, rng) for _ in range(200)]
        assert all(base * 0.5 <= p <= base for p in pauses)
        assert max(pauses) - min(pauses) > base * 0.3  # jittered


def _item() -> EpisodeRequested:
    return EpisodeRequested(event_id="b.0.0:requested", episode_id="b.0.0", batch_id="b", attempt=1, seq=0,
                            produced_by="test", env="remote:x", task={}, group_id="b.0", group_index=0,
                            group_size=1, sampling=SamplingParams(), max_turns=2)


def test_budgets_per_class() -> None:
    budgets = RetryBudgets({FailureClass.ENV: 2, FailureClass.TIMEOUT: 0})
    item = _item()
    assert budgets.allows(item, FailureClass.ENV, retryable=True)
    assert not budgets.allows(item, FailureClass.ENV, retryable=False)  # a 4xx, a bad task
    assert not budgets.allows(item, FailureClass.TIMEOUT, retryable=True)  # budget 0
    assert not budgets.allows(item, FailureClass.AGENT, retryable=True)  # not named: none
    assert not budgets.allows(item, FailureClass.INFRA, retryable=True)  # JetStream's max_deliver, not here
    second = budgets.next_item(item, 1, FailureClass.ENV)
    assert (second.event_id, second.attempt, second.attempt_base, second.failures) == (
        "b.0.0:requested:a2", 2, 1, {"env": 1})
    assert budgets.allows(second, FailureClass.ENV, retryable=True)
    third = budgets.next_item(second, 2, FailureClass.ENV)
    assert third.failures == {"env": 2} and third.attempt_base == 2
    assert not budgets.allows(third, FailureClass.ENV, retryable=True)  # 2 failures, budget 2: spent
    # a class's count does not touch another's
    assert RetryBudgets({FailureClass.INFERENCE: 1}).allows(third, FailureClass.INFERENCE, retryable=True)


async def test_actor_journal_rebuilds_after_a_restart(tmp_path: Path) -> None:
    table = ActorTable(builtin_registry(), tmp_path)
    actor = await table.reset("guess-number", "x1", {"target": 37, "low": 1, "high": 100})
    assert (await table.step(actor, "50", 0))["terminated"] is False
    assert await table.step(actor, "50", 0) == actor.answers[0]  # a retried step: the recorded answer
    with pytest.raises(ActorConflict):
        await table.step(actor, "51", 0)
    with pytest.raises(ActorConflict):
        await table.step(actor, "25", 5)

    restarted = ActorTable(builtin_registry(), tmp_path)  # a new process on the same state directory
    again = await restarted.get("guess-number", "x1")
    assert again.messages == actor.messages and again.actions == ["50"]
    answer = await restarted.step(again, "37", 1)
    assert answer["terminated"] is True and answer["reward"] == 1.0
    with pytest.raises(ActorConflict, match="ended"):
        await restarted.step(again, "37", None)
    assert await restarted.close("guess-number", "x1")
    with pytest.raises(ActorNotFound):
        await ActorTable(builtin_registry(), tmp_path).get("guess-number", "x1")


async def test_a_failing_step_leaves_the_actor_as_it_was(tmp_path: Path) -> None:
    table = ActorTable(builtin_registry(), tmp_path)
    actor = await table.reset("fixed-turns", "f", {"turns": 3, "fail_at": 2})
    await table.step(actor, "a", 0)
    for _ in range(3):  # the same fault every time: the env is rebuilt from the journal after each
        with pytest.raises(RuntimeError, match="fault injected at turn 2"):
            await table.step(actor, "b", 1)
    assert actor.actions == ["a"] and len(actor.messages) == 3


@pytest.mark.parametrize("reward", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b'"nan"', b'"-inf"'])
async def test_a_non_finite_remote_reward_is_an_env_error(reward: bytes) -> None:
    """httpx parses NaN / Infinity / 1e999 and float() takes "nan": the adapter refuses them (not retryable), so the
    driver fails the attempt with class env instead of storing the reward."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"reward": ' + reward + b', "terminated": true, "observation": []}',
                              headers={"content-type": "application/json"})

    pool = ActorPool(RemoteEndpoint("nan-env", "http://envs.invalid"), RemoteConfig(startup_jitter_s=0))
    pool._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    env = RemoteEnv(pool)
    with pytest.raises(EnvError, match="not a finite number") as err:
        await env.step("anything")
    assert err.value.retryable is False
    await pool.aclose()
