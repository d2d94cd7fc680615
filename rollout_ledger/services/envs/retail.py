"""The ``retail-orders`` environment: a tau-bench-like order desk with tools, a scripted user and a state reward.

It stays beside the real tau2-bench (``tau2:retail``, tau2_bench.py) as the light tool-calling env of the tests,
benchmarks and the fake-engine demo: no optional package, no simulated-user LLM (each of its user turns is a
string, so an episode costs only the policy's turns), deterministic from its seed, and tasks that a scripted
policy solves exactly (tests check state rewards and abort-on-error without a model). For training on retail
customer service use ``tau2:retail``: tau2's data, policy, tools, LLM user and evaluator.

A task ``{"seed": n}`` builds a small store procedurally (users, orders with items, statuses and addresses)
and a customer with one to three requests (cancel a pending order, change a pending order's address, return
items of a delivered order). The goal state is the store after those requests; the reward is 1.0 iff the
store's final state equals it exactly, else 0.0 (given on the step that ends the episode).

Each assistant turn is either one Hermes tool call (``<tool_call>{"name", "arguments"}</tool_call>``; only the
first is taken), answered by a ``tool`` message, or plain text, answered by the scripted user: thanks and
goodbye once every request is done (the episode ends), otherwise a restatement of what is still open; the
user gives up after ``user_patience`` plain-text replies. The agent ends the episode with ``done`` or
``transfer_to_human``. A malformed call (bad JSON, unknown tool, wrong arguments) is answered with an error
``tool`` message, or aborts the episode when the task says ``"abort_on_error": true``. A call the store
refuses (e.g. cancelling a delivered order) is an ordinary tool result starting with ``Error:``.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_ledger.services.envs._parse import task_int
from rollout_ledger.services.envs.base import REPLAY, Env, EnvSpec, Message, StepResult, TaskError
from rollout_ledger.services.envs.tools import (
    Param,
    ToolCall,
    ToolCallError,
    ToolSpec,
    format_call,
    parse_turn,
    validate_call,
)

Store = dict[str, Any]
"""``{"users": {user_id: user}, "orders": {order_id: order}}``; plain JSON so it compares and copies exactly."""

CANCEL_REASONS = ("no longer needed", "ordered by mistake")
PENDING, PROCESSED, DELIVERED, CANCELLED, RETURN_REQUESTED = (
    "pending", "processed", "delivered", "cancelled", "return requested")

_FIRST = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jonas")
_LAST = ("Lopez", "Smith", "Chen", "Okafor", "Novak", "Rossi", "Berg", "Khan")
_STREETS = ("Oak St", "Maple Ave", "Pine Rd", "Cedar Ln", "Elm St", "Birch Way", "Lake Dr")
_CITIES = ("Springfield", "Riverton", "Lakeside", "Fairview", "Hillcrest")
_CATALOG = (("i100", "water bottle", 12), ("i101", "desk lamp", 35), ("i102", "backpack", 60),
            ("i103", "phone case", 15), ("i104", "headphones", 80), ("i105", "notebook", 5),
            ("i106", "coffee mug", 9), ("i107", "umbrella", 22), ("i108", "keyboard", 45), ("i109", "sunglasses", 30))

SYSTEM_PROMPT = (
    "You are a customer service agent of an online store. Help the user with their orders using the tools.\n"
    "Policy:\n"
    "- First find the user with find_user_by_email; only act on that user's orders.\n"
    "- Only pending orders can be cancelled (reason 'no longer needed' or 'ordered by mistake') or have their "
    "shipping address changed.\n"
    "- Only delivered orders can have items returned.\n"
    "- Make at most one tool call per turn. When every request is handled, call done."
)

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("find_user_by_email", "Find a user by email; returns the user's id, name, address and order ids.",
             {"email": Param("string", "The user's email address.")}),
    ToolSpec("list_orders", "List a user's orders with their statuses.",
             {"user_id": Param("string", "The user's id, e.g. 'u1'.")}),
    ToolSpec("get_order", "Get an order's details: status, address, items (id, name, price), returned items.",
             {"order_id": Param("string", "The order id, e.g. '#W1001'.")}),
    ToolSpec("cancel_order", "Cancel a pending order.",
             {"order_id": Param("string", "The order id."),
              "reason": Param("string", "Why the user cancels.", enum=CANCEL_REASONS)}),
    ToolSpec("change_address", "Change the shipping address of a pending order.",
             {"order_id": Param("string", "The order id."),
              "address": Param("string", "The new address, e.g. '12 Oak St, Riverton'.")}),
    ToolSpec("return_items", "Request the return of some items of a delivered order.",
             {"order_id": Param("string", "The order id."),
              "item_ids": Param("array", "Ids of the items to return, e.g. ['i101'].", items="string")}),
    ToolSpec("done", "Call when every request of the user is handled; ends the conversation."),
    ToolSpec("transfer_to_human", "Hand the conversation to a human agent; ends the conversation.",
             {"summary": Param("string", "A short summary of the user's problem.")}),
)
TOOL_SCHEMAS: tuple[dict[str, Any], ...] = tuple(t.schema() for t in TOOLS)


class StoreError(ValueError):
    """The store refuses a well-formed call (unknown id, wrong status, not the user's order)."""


# --- the task -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetailTask:
    """A procedural task: the initial store, the customer, the requests and the goal state."""

    store: Store
    user_id: str
    actions: tuple[ToolCall, ...]
    """The state-changing calls that fulfil the requests (in order)."""
    requests: tuple[str, ...]
    """How the user phrases each request (same order as ``actions``)."""
    goal: Store

    @property
    def email(self) -> str:
        return str(self.store["users"][self.user_id]["email"])

    @property
    def name(self) -> str:
        return str(self.store["users"][self.user_id]["name"])

    def first_message(self) -> str:
        return f"Hi, I'm {self.name} (email {self.email}). " + " ".join(self.requests)


def build_task(seed: int, num_requests: int | None = None) -> RetailTask:
    """The task of ``seed`` (deterministic); ``num_requests`` in 1..3, default drawn from the seed."""
    rng = random.Random(seed)
    store: Store = {"users": {}, "orders": {}}
    next_order = 1000 + rng.randrange(9000 - 64)
    names = rng.sample([f"{f} {n}" for f in _FIRST for n in _LAST], 3)
    for u, name in enumerate(names, start=1):
        user_id = f"u{u}"
        first, last = name.lower().split()
        address = _address(rng)
        order_ids = []
        for status in (PENDING, PENDING, DELIVERED, rng.choice((PROCESSED, DELIVERED, CANCELLED))):
            order_id = f"#W{next_order}"
            next_order += 1
            picked = sorted(rng.sample(_CATALOG, rng.randint(1, 3)))
            items = [{"item_id": i, "name": n, "price": p} for i, n, p in picked]
            store["orders"][order_id] = {"order_id": order_id, "user_id": user_id, "status": status,
                                         "address": address, "items": items, "returned_items": [],
                                         "cancel_reason": None}
            order_ids.append(order_id)
        store["users"][user_id] = {"user_id": user_id, "name": name, "email": f"{first}.{last}{u}@example.com",
                                   "address": address, "order_ids": order_ids}
    user_id = rng.choice(sorted(store["users"]))
    pending = [o for o in store["users"][user_id]["order_ids"] if store["orders"][o]["status"] == PENDING]
    delivered = [o for o in store["users"][user_id]["order_ids"] if store["orders"][o]["status"] == DELIVERED]
    n = num_requests if num_requests is not None else rng.randint(1, 2)
    if not 1 <= n <= 3:
        raise TaskError(f"num_requests must be within 1..3, got {n}")
    kinds = rng.sample(("cancel", "address", "return"), n)
    rng.shuffle(pending)
    actions: list[ToolCall] = []
    requests: list[str] = []
    for kind in kinds:
        if kind == "cancel":
            order_id, reason = pending.pop(), rng.choice(CANCEL_REASONS)
            actions.append(ToolCall("cancel_order", {"order_id": order_id, "reason": reason}))
            requests.append(f"Please cancel order {order_id}, it was {reason}." if reason == "ordered by mistake"
                            else f"Please cancel order {order_id}, I no longer need it.")
        elif kind == "address":
            order_id, address = pending.pop(), _address(rng)
            actions.append(ToolCall("change_address", {"order_id": order_id, "address": address}))
            requests.append(f"Please ship order {order_id} to {address} instead.")
        else:
            order_id = rng.choice(delivered)
            items = store["orders"][order_id]["items"]
            chosen = sorted(rng.sample(items, rng.randint(1, len(items))), key=lambda i: i["item_id"])
            actions.append(ToolCall("return_items", {"order_id": order_id,
                                                     "item_ids": [i["item_id"] for i in chosen]}))
            requests.append(f"I want to return the {_join([i['name'] for i in chosen])} from order {order_id}.")
    goal = copy.deepcopy(store)
    for action in actions:
        _MUTATIONS[action.name](goal, user_id, action.arguments)
    return RetailTask(store=store, user_id=user_id, actions=tuple(actions), requests=tuple(requests), goal=goal)


def solution(task: RetailTask) -> list[str]:
    """A correct agent's turns for ``task``: look the user up, one call per request, then ``done``."""
    calls = [format_call("find_user_by_email", {"email": task.email})]
    calls += [format_call(a.name, a.arguments) for a in task.actions]
    return [*calls, format_call("done", {})]


def _address(rng: random.Random) -> str:
    return f"{rng.randint(1, 99)} {rng.choice(_STREETS)}, {rng.choice(_CITIES)}"


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# --- the store's tools ----------------------------------------------------------------------------------
def _own_order(store: Store, user_id: str | None, order_id: str) -> dict[str, Any]:
    order = store["orders"].get(order_id)
    if order is None:
        raise StoreError(f"order {order_id} not found")
    if user_id is None:
        raise StoreError("no user is identified yet: call find_user_by_email first")
    if order["user_id"] != user_id:
        raise StoreError(f"order {order_id} does not belong to the identified user")
    return dict(order)


def _cancel(store: Store, user_id: str | None, args: dict[str, Any]) -> Any:
    order = _own_order(store, user_id, args["order_id"])
    if order["status"] != PENDING:
        raise StoreError(f"order {order['order_id']} is {order['status']}; only pending orders can be cancelled")
    store["orders"][order["order_id"]].update(status=CANCELLED, cancel_reason=args["reason"])
    return store["orders"][order["order_id"]]


def _change_address(store: Store, user_id: str | None, args: dict[str, Any]) -> Any:
    order = _own_order(store, user_id, args["order_id"])
    if order["status"] != PENDING:
        raise StoreError(f"order {order['order_id']} is {order['status']}; only a pending order's address can change")
    address = args["address"].strip()
    if not address:
        raise StoreError("the address is empty")
    store["orders"][order["order_id"]]["address"] = address
    return store["orders"][order["order_id"]]


def _return_items(store: Store, user_id: str | None, args: dict[str, Any]) -> Any:
    order = _own_order(store, user_id, args["order_id"])
    if order["status"] != DELIVERED:
        raise StoreError(f"order {order['order_id']} is {order['status']}; only delivered orders can be returned")
    wanted = list(args["item_ids"])
    known = {i["item_id"] for i in order["items"]}
    if not wanted or len(set(wanted)) != len(wanted) or not set(wanted) <= known:
        raise StoreError(f"item_ids must be distinct ids of the order's items: {', '.join(sorted(known))}")
    store["orders"][order["order_id"]].update(status=RETURN_REQUESTED, returned_items=sorted(wanted))
    return store["orders"][order["order_id"]]


_MUTATIONS: dict[str, Callable[[Store, str | None, dict[str, Any]], Any]] = {
    "cancel_order": _cancel, "change_address": _change_address, "return_items": _return_items}


def _request_done(store: Store, goal: Store, action: ToolCall) -> bool:
    order_id = action.arguments["order_id"]
    return bool(store["orders"][order_id] == goal["orders"][order_id])


# --- the environment -------------------------------------------------------------------------------------
class RetailEnv(Env):
    """Task ``{"seed": n}``; optional ``"num_requests"`` (1..3), ``"abort_on_error"`` (bool, default false)
    and ``"user_patience"`` (plain-text replies before the user gives up, default 4)."""

    resume = REPLAY
    """Deterministic given the task and the actions: a resumed attempt replays the recorded ones."""

    def __init__(self) -> None:
        self._task: RetailTask | None = None
        self._store: Store = {}
        self._user_id: str | None = None
        self._abort_on_error = False
        self._patience = 4
        self._user_replies = 0
        self._counts = {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0}

    def tools(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(s) for s in TOOL_SCHEMAS]

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        num = task_int(task, "num_requests") if "num_requests" in task else None
        abort = task.get("abort_on_error", False)
        if not isinstance(abort, bool):
            raise TaskError(f"abort_on_error must be a boolean, got {abort!r}")
        self._patience = task_int(task, "user_patience") if "user_patience" in task else 4
        if self._patience < 1:
            raise TaskError(f"user_patience must be >= 1, got {self._patience}")
        self._task = build_task(task_int(task, "seed"), num)
        self._store = copy.deepcopy(self._task.store)
        self._abort_on_error = abort
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": self._task.first_message()}]

    @property
    def store(self) -> Store:
        """The store's current state (a copy)."""
        return copy.deepcopy(self._store)

    async def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        try:
            turn = parse_turn(action)
            if turn.call is None:
                return self._user_turn()
            validate_call(turn.call, TOOLS)
        except ToolCallError as exc:
            self._counts["malformed_calls"] += 1
            info = self._info(tool_error=exc.kind.value, error=str(exc))
            if self._abort_on_error:
                return StepResult([], aborted=True, info=info)
            return StepResult([_tool(f"Error: malformed tool call ({exc.kind.value}): {exc}")], info=info)
        self._counts["tool_calls"] += 1
        call = turn.call
        info = self._info(tool=call.name, ignored_calls=turn.extra_calls)
        if call.name in ("done", "transfer_to_human"):
            return self._end(call.name, info)
        try:
            result = self._execute(call)
        except StoreError as exc:
            self._counts["tool_errors"] += 1
            info["tool_errors"] = self._counts["tool_errors"]
            return StepResult([_tool(f"Error: {exc}", call.name)], info=info)
        return StepResult([_tool(json.dumps(result, sort_keys=True), call.name)], info=info)

    def _execute(self, call: ToolCall) -> Any:
        args, store = call.arguments, self._store
        if call.name == "find_user_by_email":
            found = [u for u in store["users"].values() if u["email"] == args["email"].strip().lower()]
            if not found:
                raise StoreError(f"no user with email {args['email']}")
            self._user_id = found[0]["user_id"]
            return found[0]
        if call.name == "list_orders":
            user = store["users"].get(args["user_id"])
            if user is None:
                raise StoreError(f"user {args['user_id']} not found")
            return [{"order_id": o, "status": store["orders"][o]["status"]} for o in user["order_ids"]]
        if call.name == "get_order":
            order = store["orders"].get(args["order_id"])
            if order is None:
                raise StoreError(f"order {args['order_id']} not found")
            return order
        return _MUTATIONS[call.name](store, self._user_id, args)

    def _user_turn(self) -> StepResult:
        task = self._task
        if task is None:
            raise RuntimeError("step() before reset()")
        self._user_replies += 1
        if self._store == task.goal:
            return self._end("user_satisfied", self._info(), "Thank you, that's everything. Goodbye!")
        if self._user_replies >= self._patience:
            return self._end("user_gave_up", self._info(), "This is not going anywhere. Goodbye.")
        open_requests = [r for a, r in zip(task.actions, task.requests, strict=True)
                         if not _request_done(self._store, task.goal, a)]
        text = "That's not done yet. " + " ".join(open_requests) if open_requests else \
            "Something about my orders is not as I asked. Please check them again."
        return StepResult([{"role": "user", "content": text}], info=self._info())

    def _end(self, how: str, info: dict[str, Any], farewell: str = "") -> StepResult:
        task = self._task
        if task is None:
            raise RuntimeError("step() before reset()")
        reached = self._store == task.goal
        info.update(end=how, goal_reached=reached)
        observation = [{"role": "user", "content": farewell}] if farewell else []
        return StepResult(observation, reward=1.0 if reached else 0.0, terminated=True, info=info)

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {**self._counts, "user_replies": self._user_replies, **extra}


def _tool(content: str, name: str | None = None) -> Message:
    message: Message = {"role": "tool", "content": content}
    if name is not None:
        message["name"] = name
    return message


SPEC = EnvSpec(
    name="retail-orders",
    factory=RetailEnv,
    description=("Tool calling (Hermes <tool_call>): an order desk with a scripted user; cancel, re-address, "
                 "return; reward 1.0 iff the store ends in the goal state."),
    multi_turn=True,
    example_task={"seed": 1},
)
