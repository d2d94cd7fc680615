"""The ``retail-orders`` env with scripted policies, and its tool-aware tokenisation with the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from rollout_ledger.services.env_worker.tokenization import TOOLS_TEMPLATE, Transcript, TurnTemplate, renders_tools
from rollout_ledger.services.envs.base import StepResult, TaskError
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envs.retail import (
    DELIVERED,
    PENDING,
    TOOLS,
    RetailEnv,
    build_task,
    solution,
)
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.errors import TokenizationError
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.unit.test_tokenization import sample


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def play(task: dict[str, Any], turns: Sequence[str]) -> tuple[RetailEnv, list[StepResult]]:
    env = RetailEnv()
    await env.reset(task)
    results = []
    for turn in turns:
        result = await env.step(turn)
        results.append(result)
        if result.terminated or result.aborted:
            break
    return env, results


# --- the task -----------------------------------------------------------------------------------------
def test_tasks_are_deterministic_and_solvable() -> None:
    assert build_task(5) == build_task(5)
    assert build_task(5) != build_task(6)
    sizes = set()
    for seed in range(150):
        task = build_task(seed)
        sizes.add(len(task.actions))
        assert task.goal != task.store and len(task.requests) == len(task.actions)
        assert all(a.arguments["order_id"] in task.store["users"][task.user_id]["order_ids"] for a in task.actions)
        env, results = run(play({"seed": seed}, solution(task)))
        last = results[-1]
        assert (last.terminated, last.reward, last.info["end"], last.info["goal_reached"]) == (True, 1.0, "done", True)
        assert sum(r.reward for r in results) == 1.0 and env.store == task.goal
        assert all(not r.observation[0]["content"].startswith("Error") for r in results[:-1])
    assert sizes == {1, 2}
    for n in (1, 2, 3):
        task = build_task(11, n)
        assert len(task.actions) == n and len({a.arguments["order_id"] for a in task.actions}) == n
        assert run(play({"seed": 11, "num_requests": n}, solution(task)))[1][-1].reward == 1.0


@pytest.mark.parametrize("task", [{}, {"seed": "1"}, {"seed": 1, "num_requests": 4}, {"seed": 1, "num_requests": 0},
                                  {"seed": 1, "abort_on_error": "yes"}, {"seed": 1, "user_patience": 0}])
def test_bad_tasks_raise_task_error(task: dict[str, Any]) -> None:
    with pytest.raises(TaskError):
        run(RetailEnv().reset(task))


def test_reset_gives_system_prompt_user_request_and_tools() -> None:
    env = RetailEnv()
    messages = run(env.reset({"seed": 3}))
    task = build_task(3)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "find_user_by_email" in messages[0]["content"]
    assert messages[1]["content"] == task.first_message() and task.email in messages[1]["content"]
    tools = env.tools()
    assert [t["function"]["name"] for t in tools] == [t.name for t in TOOLS]
    assert "done" in {t["function"]["name"] for t in tools} and json.loads(json.dumps(tools)) == tools
    tools[0]["function"]["name"] = "changed"  # a copy: the next env is unaffected
    assert RetailEnv().tools()[0]["function"]["name"] == "find_user_by_email"


def test_registered_in_builtins() -> None:
    spec = builtin_registry().get("retail-orders")
    assert spec.multi_turn and spec.advert("w")["example_task"] == {"seed": 1}
    assert isinstance(spec.factory(), RetailEnv)


# --- tools and the store ------------------------------------------------------------------------------
def test_store_refusals_are_tool_errors_not_crashes() -> None:
    task = build_task(2, 3)
    cancel = next(a for a in task.actions if a.name == "cancel_order")
    delivered = next(o for o in task.store["users"][task.user_id]["order_ids"]
                     if task.store["orders"][o]["status"] == DELIVERED)
    other = next(o for o, order in task.store["orders"].items() if order["user_id"] != task.user_id)
    turns = [
        format_call("cancel_order", cancel.arguments),  # before identifying the user
        format_call("find_user_by_email", {"email": "nobody@example.com"}),
        format_call("find_user_by_email", {"email": task.email}),
        format_call("cancel_order", {"order_id": delivered, "reason": "no longer needed"}),
        format_call("cancel_order", {"order_id": other, "reason": "no longer needed"}),
        format_call("get_order", {"order_id": "#W0"}),
        format_call("return_items", {"order_id": delivered, "item_ids": ["i999"]}),
        format_call("list_orders", {"user_id": "u9"}),
    ]
    env, results = run(play({"seed": 2, "num_requests": 3}, turns))
    errors = [r.observation[0]["content"] for r in results]
    assert errors[2].startswith("{") and json.loads(errors[2])["user_id"] == task.user_id
    del errors[2]
    assert all(e.startswith("Error: ") for e in errors)
    assert "find_user_by_email first" in errors[0] and "only pending orders" in errors[2]
    assert "does not belong" in errors[3] and "#W0 not found" in errors[4] and "distinct ids" in errors[5]
    assert all(r.observation[0]["role"] == "tool" and not r.terminated and r.reward == 0.0 for r in results)
    assert results[-1].info["tool_errors"] == 7 and results[-1].info["malformed_calls"] == 0
    assert env.store == task.store  # nothing changed


def test_read_tools_answer_json() -> None:
    task = build_task(4)
    user_orders = task.store["users"][task.user_id]["order_ids"]
    turns = [format_call("find_user_by_email", {"email": task.email.upper()}),
             format_call("list_orders", {"user_id": task.user_id}),
             format_call("get_order", {"order_id": user_orders[0]})]
    _, results = run(play({"seed": 4}, turns))
    listed = json.loads(results[1].observation[0]["content"])
    assert [o["order_id"] for o in listed] == user_orders and listed[0]["status"] == PENDING
    assert json.loads(results[2].observation[0]["content"]) == task.store["orders"][user_orders[0]]
    assert results[2].observation[0]["name"] == "get_order"


def test_wrong_state_gets_no_reward() -> None:
    seed = next(s for s in range(100) if build_task(s, 1).actions[0].name == "return_items")
    task = build_task(seed, 1)
    pending = next(o for o in task.store["users"][task.user_id]["order_ids"]
                   if task.store["orders"][o]["status"] == PENDING)
    right = solution(task)
    # the request is done, plus a change the user did not ask for: the goal is compared exactly
    extra = format_call("change_address", {"order_id": pending, "address": "1 Elsewhere"})
    env, results = run(play({"seed": seed, "num_requests": 1}, [*right[:-1], extra, right[-1]]))
    assert not results[-2].observation[0]["content"].startswith("Error")
    assert results[-1].terminated and results[-1].reward == 0.0 and results[-1].info["goal_reached"] is False
    assert env.store != task.goal
    # part of the requests, then done
    task = build_task(seed, 2)
    _, results = run(play({"seed": seed, "num_requests": 2}, [*solution(task)[:2], format_call("done", {})]))
    assert results[-1].terminated and results[-1].reward == 0.0
    _, results = run(play({"seed": seed}, [format_call("transfer_to_human", {"summary": "help"})]))
    assert results[-1].terminated and results[-1].reward == 0.0 and results[-1].info["end"] == "transfer_to_human"


# --- the scripted user ----------------------------------------------------------------------------------
def test_user_restates_open_requests_then_says_goodbye() -> None:
    task = build_task(1, 2)
    first, second = task.actions
    turns = ["Hello! How can I help?", format_call("find_user_by_email", {"email": task.email}),
             format_call(first.name, first.arguments), "Done with the first one.",
             format_call(second.name, second.arguments), "All set!"]
    _, results = run(play({"seed": 1, "num_requests": 2}, turns))
    texts = [r.observation[0]["content"] if r.observation else "" for r in results]
    assert texts[0] == "That's not done yet. " + " ".join(task.requests)
    assert texts[3] == "That's not done yet. " + task.requests[1]
    assert results[3].observation[0]["role"] == "user" and not results[3].terminated
    last = results[-1]
    assert last.terminated and last.reward == 1.0 and last.info["end"] == "user_satisfied"
    assert texts[-1].startswith("Thank you")
    assert len(results) == len(turns) and sum(r.reward for r in results) == 1.0


def test_user_gives_up_after_patience() -> None:
    _, results = run(play({"seed": 1, "user_patience": 3}, ["hi"] * 10))
    assert len(results) == 3 and results[-1].terminated and results[-1].reward == 0.0
    assert results[-1].info["end"] == "user_gave_up" and results[-1].info["user_replies"] == 3


# --- malformed calls ------------------------------------------------------------------------------------
MALFORMED = ['<tool_call>{"name": "get_order", "arguments": {</tool_call>', '<tool_call>{"name": "refund"}</tool_call>',
             '<tool_call>{"name": "get_order", "arguments": {"id": 1}}</tool_call>', "<tool_call>[]</tool_call>"]


def test_malformed_call_is_an_error_observation_by_default() -> None:
    task = build_task(9)
    _, results = run(play({"seed": 9}, [*MALFORMED, *solution(task)]))
    kinds = [r.info["tool_error"] for r in results[:4]]
    assert kinds == ["malformed_json", "unknown_tool", "invalid_arguments", "not_an_object"]
    for r in results[:4]:
        assert r.observation[0]["role"] == "tool" and r.observation[0]["content"].startswith("Error: malformed")
        assert not r.terminated and not r.aborted
    assert results[-1].reward == 1.0 and results[-1].info["malformed_calls"] == 4
    assert results[-1].info["tool_calls"] == len(solution(task))


@pytest.mark.parametrize("bad", MALFORMED)
def test_malformed_call_aborts_with_abort_on_error(bad: str) -> None:
    task = build_task(9)
    _, results = run(play({"seed": 9, "abort_on_error": True}, [solution(task)[0], bad, *solution(task)]))
    assert len(results) == 2
    last = results[-1]
    assert last.aborted and not last.terminated and last.observation == [] and last.reward == 0.0
    assert last.info["tool_error"] and last.info["error"]


def test_extra_calls_are_ignored_and_counted() -> None:
    task = build_task(9)
    both = solution(task)[0] + " " + format_call("done", {})
    _, results = run(play({"seed": 9}, [both]))
    assert results[0].info["ignored_calls"] == 1 and not results[0].terminated
    assert results[0].observation[0]["name"] == "find_user_by_email"


# --- tokenisation with the tool-aware template ----------------------------------------------------------
@pytest.fixture(scope="module")
def tok(model_dir: str) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def test_smollm2_needs_the_shipped_tool_template(tok: ChatTokenizer) -> None:
    assert not renders_tools(tok.template_source)
    assert renders_tools(TOOLS_TEMPLATE.read_text())
    base = TurnTemplate(tok)
    tools = RetailEnv().tools()
    with_tools = base.with_tools(tools)
    assert base.with_tools(None) is base and base.with_tools([]) is base
    assert base.with_tools(RetailEnv().tools()) is with_tools  # cached per tool list
    assert with_tools.tokenizer is not tok and with_tools.tokenizer.template_source == TOOLS_TEMPLATE.read_text()
    assert with_tools.tools == tools and with_tools.with_tools(tools).tokenizer is with_tools.tokenizer
    assert "<tools>" in with_tools.anchor_prefix and '"name": "cancel_order"' in with_tools.anchor_prefix


def test_non_chatml_template_without_tools_is_refused(model_dir: str) -> None:
    plain = ChatTokenizer(model_dir, chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(TokenizationError):
        TurnTemplate(plain).with_tools(RetailEnv().tools())


def test_tool_template_without_tools_renders_like_smollm2(tok: ChatTokenizer, model_dir: str) -> None:
    tools_tok = ChatTokenizer(model_dir, chat_template=TOOLS_TEMPLATE.read_text())
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        [{"role": "user", "content": " ünï 🎲 "}, {"role": "assistant", "content": "a"},
         {"role": "user", "content": ""}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert tools_tok.render(messages, gen) == tok.render(messages, gen)


def test_tool_template_is_prefix_stable(model_dir: str) -> None:
    tools_tok = ChatTokenizer(model_dir, chat_template=TOOLS_TEMPLATE.read_text())
    tools = RetailEnv().tools()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": format_call("get_order", {"order_id": "#W1"})},
                {"role": "tool", "content": '{"x": 1}'}, {"role": "assistant", "content": "text"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "<tool_call>{bad"},
                {"role": "tool", "content": "Error: malformed"}, {"role": "tool", "content": "second"}]
    for k in range(2, len(messages)):
        shorter = tools_tok.render(messages[:k], False, tools=tools)
        assert tools_tok.render(messages[:k + 1], False, tools=tools).startswith(shorter)
        assert tools_tok.render(messages[:k], True, tools=tools).startswith(shorter)
    rendered = tools_tok.render(messages, False, tools=tools)
    assert "<|im_start|>tool\n<tool_response>\n{\"x\": 1}\n</tool_response><|im_end|>\n" in rendered
    assert rendered.count("<tools>\n") == 1 and all(json.dumps(t) in rendered for t in tools)


async def drive(template: TurnTemplate, task: dict[str, Any], answers: Sequence[str],
                cut: int | None = None) -> tuple[Transcript, list[tuple[int, int]], list[StepResult]]:
    """Run ``answers`` through the env and a transcript as the driver does (turn ``cut`` ends without eos)."""
    env = RetailEnv()
    messages = await env.reset(task)
    tr = Transcript(template.with_tools(env.tools()), messages)
    spans, results = [], []
    for t, answer in enumerate(answers):
        ids = sample(tr.tokenizer, answer, eos=t != cut)
        spans.append((len(tr), len(tr) + len(ids)))
        action = tr.add_sampled(ids)
        assert action == answer
        result = await env.step(action)
        results.append(result)
        final = result.terminated or result.aborted or t + 1 == len(answers)
        tr.add_observation(result.observation, final)
        if final:
            break
    return tr, spans, results


@pytest.mark.parametrize("cut", [None, 1])
def test_transcript_is_token_exact_across_tool_turns(tok: ChatTokenizer, cut: int | None) -> None:
    task = build_task(12, 2)
    answers = ["Let me look you up.", *MALFORMED[:1], *solution(task)[:-1], "All done, anything else?"]
    tr, spans, results = run(drive(TurnTemplate(tok), {"seed": 12, "num_requests": 2}, answers, cut))
    assert results[-1].info["end"] == "user_satisfied" and results[-1].reward == 1.0
    assert tr.verify() and not tr.drifts
    tools_tok, tools = tr.tokenizer, tr.template.tools
    roles = [m["role"] for m in tr.messages]
    assert roles[:3] == ["system", "user", "assistant"] and roles.count("tool") == len(answers) - 2
    rendered = tools_tok.render(tr.messages, add_generation_prompt=False, tools=tools)
    assert tools_tok.decode(tr.ids) + tr.closing_text == rendered
    assert tools_tok.decode(tr.prompt_ids) == tools_tok.render(tr.messages[:2], True, tools=tools)
    expected_mask = np.zeros(len(tr), dtype=np.int8)
    for start, end in spans:
        expected_mask[start:end] = 1
    assert np.array_equal(tr.mask, expected_mask)
    assert spans[-1][1] == len(tr)  # the sequence ends with the last sampled ids
    for (start, end), answer in zip(spans, answers, strict=True):
        assert tools_tok.decode(tr.ids[start:end], skip_special_tokens=True) == answer


def test_transcript_with_aborted_episode_is_exact(tok: ChatTokenizer) -> None:
    task = build_task(12)
    answers = [solution(task)[0], MALFORMED[1]]
    tr, spans, results = run(drive(TurnTemplate(tok), {"seed": 12, "abort_on_error": True}, answers))
    assert results[-1].aborted and tr.verify() and spans[-1][1] == len(tr)
