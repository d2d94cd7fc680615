"""Unit tests of the built-in environments and the env registry."""

from __future__ import annotations

import pytest

from rollout_ledger.services.envs.arithmetic import ArithmeticEnv, make_problem, solve
from rollout_ledger.services.envs.base import TaskError
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envs.fixed_turns import FixedTurnsEnv, InjectedEnvFault
from rollout_ledger.services.envs.guess_number import GuessNumberEnv
from rollout_ledger.services.envs.registry import UnknownEnvError


async def test_arithmetic_reward_on_last_integer() -> None:
    env = ArithmeticEnv()
    messages = await env.reset({"a": 12, "b": 30, "op": "+"})
    assert messages == [{"role": "user", "content": "What is 12 + 30? Answer with a single integer."}]
    right = await env.step("Let me think: 12 plus 30 is 42")
    assert right.reward == 1.0 and right.terminated and right.observation == []
    env2 = ArithmeticEnv()
    await env2.reset({"a": 12, "b": 30, "op": "+"})
    wrong = await env2.step("42? no, 41")
    assert wrong.reward == 0.0 and wrong.terminated
    assert wrong.info == {"expected": 42, "parsed": 41}


async def test_arithmetic_negative_and_no_number() -> None:
    env = ArithmeticEnv()
    await env.reset({"a": 3, "b": 10, "op": "-"})
    assert (await env.step("-7")).reward == 1.0
    env = ArithmeticEnv()
    await env.reset({"a": 3, "b": 10, "op": "*"})
    assert (await env.step("thirty")).reward == 0.0


def test_arithmetic_is_seeded() -> None:
    assert make_problem({"seed": 5}) == make_problem({"seed": 5})
    assert len({make_problem({"seed": s}) for s in range(50)}) > 40
    a, b, op = make_problem({"seed": 5})
    assert solve(a, b, op) == eval(f"{a} {op} {b}")


async def test_arithmetic_rejects_bad_tasks() -> None:
    for task in ({"a": 1, "b": 2, "op": "/"}, {"a": "1", "b": 2, "op": "+"}, {}):
        with pytest.raises(TaskError):
            await ArithmeticEnv().reset(task)


async def test_guess_number_feedback_until_hit() -> None:
    env = GuessNumberEnv()
    await env.reset({"target": 37, "low": 1, "high": 100})
    low = await env.step("I guess 10")
    assert low.observation == [{"role": "user", "content": "higher"}]
    assert not low.terminated and low.reward == 0.0
    high = await env.step("50")
    assert high.observation == [{"role": "user", "content": "lower"}]
    none = await env.step("no idea")
    assert none.observation[0]["content"].startswith("Please") and not none.terminated
    hit = await env.step("37")
    assert hit.terminated and hit.reward == 1.0 and hit.info["guesses"] == 4


async def test_guess_number_seeded_and_validated() -> None:
    a, b = GuessNumberEnv(), GuessNumberEnv()
    assert await a.reset({"seed": 9}) == await b.reset({"seed": 9})
    with pytest.raises(TaskError):
        await GuessNumberEnv().reset({"target": 500, "low": 1, "high": 100})


async def test_fixed_turns_runs_exactly_t_turns() -> None:
    env = FixedTurnsEnv()
    await env.reset({"turns": 3})
    results = [await env.step("ok") for _ in range(3)]
    assert [r.observation[0]["content"] for r in results] == [
        "Turn 1 of 3 done. Continue.", "Turn 2 of 3 done. Continue.", "Turn 3 of 3 done. Continue."]
    assert [r.terminated for r in results] == [False, False, True]
    assert sum(r.reward for r in results) == 1.0


async def test_fixed_turns_fault_injection() -> None:
    env = FixedTurnsEnv()
    await env.reset({"turns": 3, "fail_at": 2})
    await env.step("ok")
    with pytest.raises(InjectedEnvFault):
        await env.step("ok")
    with pytest.raises(TaskError):
        await FixedTurnsEnv().reset({"turns": 0})


def test_registry_lists_and_restricts() -> None:
    reg = builtin_registry()
    assert reg.names() == ["arithmetic", "fixed-turns", "guess-number", "retail-orders"]
    advert = reg.get("guess-number").advert("w1")
    assert advert["multi_turn"] is True and advert["registered_by"] == "w1" and advert["example_task"]
    assert reg.get("arithmetic").multi_turn is False
    only = reg.only(["arithmetic"])
    assert only.names() == ["arithmetic"]
    with pytest.raises(UnknownEnvError):
        only.create("guess-number")
    assert reg.create("arithmetic") is not reg.create("arithmetic")


async def test_example_tasks_reset() -> None:
    reg = builtin_registry()
    for spec in reg.specs():
        messages = await spec.factory().reset(spec.example_task)
        assert messages and messages[-1]["role"] == "user"


async def test_fixed_turns_topic() -> None:
    env = FixedTurnsEnv()
    messages = await env.reset({"turns": 2, "topic": "the sea"})
    assert messages[0]["content"] == "This conversation lasts 2 turns. Write a few sentences about the sea."
    with pytest.raises(TaskError, match="topic"):
        await FixedTurnsEnv().reset({"turns": 2, "topic": 7})
