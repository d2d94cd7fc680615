"""The server's actors: one environment instance per ``(env, env_id)``, its conversation, answers and journal.

An actor is created by ``reset`` and keeps the whole conversation (what ``get_task_prompt`` returns) and the
answer to every step, so a step retried with the same index (``Rollout-Step``) gets the recorded answer
instead of stepping the environment twice.

Journal: with a state directory, each actor appends its task and every applied action to
``{state_dir}/{env}/{env_id}.jsonl`` before answering. A server restarted after a crash rebuilds an actor it
does not hold from its journal (``reset`` with the task, then the recorded actions replayed through ``step``),
so an episode whose server was killed mid-way continues where it was. The built-in environments are
deterministic given the task and the actions, which is what makes the replay exact.

When the environment's ``step`` raises, the actor is rebuilt from its journal (its state is unknown after a
partial step) and the error is reported; a retry then meets the same state and, for a deterministic fault,
the same error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rollout_ledger.services.envs.base import Env, Message, StepResult
from rollout_ledger.services.envs.registry import EnvRegistry


class ActorNotFound(LookupError):
    """No actor of that id (and no journal to rebuild it from)."""


class ActorConflict(ValueError):
    """The request does not fit the actor's state (a step after the end, a replayed step with another action,
    a reset of an existing actor with another task)."""


@dataclass
class Actor:
    """One episode's environment on this server."""

    env_name: str
    env_id: str
    task: dict[str, Any]
    env: Env
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    actions: list[str] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


def step_answer(result: StepResult) -> dict[str, Any]:
    """The protocol's step answer (interactor.py's shape, plus ``aborted`` when set)."""
    answer: dict[str, Any] = {"reward": float(result.reward), "terminated": result.terminated,
                              "truncated": result.truncated,
                              "info": orjson.loads(orjson.dumps(result.info, default=str))}
    if result.aborted:
        answer["aborted"] = True
    return answer


class ActorTable:
    """Every live actor of the server, keyed by ``(env, env_id)``."""

    def __init__(self, envs: EnvRegistry, state_dir: Path | None = None, idle_ttl_s: float = 3600.0) -> None:
        self.envs = envs
        self.state_dir = state_dir
        self.idle_ttl_s = idle_ttl_s
        self._actors: dict[tuple[str, str], Actor] = {}
        self._creating: dict[tuple[str, str], asyncio.Lock] = {}

    def __len__(self) -> int:
        return len(self._actors)

    # --- journal -------------------------------------------------------------------------------------
    def _journal(self, env_name: str, env_id: str) -> Path | None:
        if self.state_dir is None:
            return None
        return self.state_dir / env_name / f"{env_id}.jsonl"

    def _append(self, actor: Actor, record: dict[str, Any]) -> None:
        path = self._journal(actor.env_name, actor.env_id)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            f.write(orjson.dumps(record) + b"\n")

    def _read_journal(self, env_name: str, env_id: str) -> tuple[dict[str, Any], list[str]] | None:
        path = self._journal(env_name, env_id)
        if path is None or not path.exists():
            return None
        task: dict[str, Any] | None = None
        actions: list[str] = []
        for line in path.read_bytes().splitlines():
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                break  # a torn last line: the action it held was never answered
            if "task" in rec:
                task = rec["task"]
            elif "action" in rec:
                actions.append(rec["action"])
        return (task, actions) if task is not None else None

    # --- building ------------------------------------------------------------------------------------
    async def _build(self, env_name: str, env_id: str, task: dict[str, Any], actions: list[str]) -> Actor:
        """A fresh actor: ``reset(task)`` then ``actions`` replayed (``TaskError``/env errors propagate)."""
        env = self.envs.create(env_name)
        messages = list(await env.reset(task))
        actor = Actor(env_name, env_id, task, env, messages, env.tools())
        for action in actions:
            result = await env.step(action)
            self._apply(actor, action, result)
        return actor

    @staticmethod
    def _apply(actor: Actor, action: str, result: StepResult) -> dict[str, Any]:
        answer = step_answer(result)
        actor.actions.append(action)
        actor.answers.append(answer)
        actor.messages.append({"role": "assistant", "content": action})
        actor.messages.extend(result.observation)
        actor.done = result.terminated or result.truncated or result.aborted
        return answer

    async def reset(self, env_name: str, env_id: str, task: dict[str, Any]) -> Actor:
        """Create the actor (idempotent for the same task: a retried reset gets the existing actor)."""
        self.envs.get(env_name)  # UnknownEnvError before anything else
        self._expire()
        key = (env_name, env_id)
        lock = self._creating.setdefault(key, asyncio.Lock())
        async with lock:
            existing = self._actors.get(key)
            if existing is None:
                journal = self._read_journal(env_name, env_id)
                if journal is not None:
                    existing = await self._build(env_name, env_id, journal[0], journal[1])
                    self._actors[key] = existing
            if existing is not None:
                if existing.task != task:
                    raise ActorConflict(f"actor {env_id} of {env_name} exists with another task")
                existing.last_used = time.monotonic()
                return existing
            actor = await self._build(env_name, env_id, task, [])
            self._append(actor, {"task": task})
            self._actors[key] = actor
            return actor

    async def get(self, env_name: str, env_id: str) -> Actor:
        """The actor, rebuilt from its journal when this process does not hold it (after a restart)."""
        key = (env_name, env_id)
        actor = self._actors.get(key)
        if actor is None:
            self.envs.get(env_name)  # UnknownEnvError
            lock = self._creating.setdefault(key, asyncio.Lock())
            async with lock:
                actor = self._actors.get(key)
                if actor is None:
                    journal = self._read_journal(env_name, env_id)
                    if journal is None:
                        raise ActorNotFound(f"no actor {env_id} of env {env_name} (reset it first)")
                    actor = await self._build(env_name, env_id, journal[0], journal[1])
                    self._actors[key] = actor
        actor.last_used = time.monotonic()
        return actor

    async def step(self, actor: Actor, action: str, index: int | None) -> dict[str, Any]:
        """Apply ``action`` as step ``index`` (the next one when None); a recorded step answers from the record."""
        async with actor.lock:
            if index is not None and index < len(actor.answers):
                if actor.actions[index] != action:
                    raise ActorConflict(f"step {index} was already taken with another action")
                return actor.answers[index]
            if index is not None and index > len(actor.answers):
                raise ActorConflict(f"step {index} requested but only {len(actor.answers)} steps were taken")
            if actor.done:
                raise ActorConflict("the episode has ended; no more steps")
            try:
                result = await actor.env.step(action)
            except BaseException:
                await self._rebuild(actor)
                raise
            answer = self._apply(actor, action, result)
            self._append(actor, {"action": action})
            return answer

    async def _rebuild(self, actor: Actor) -> None:
        """Put a fresh environment with the recorded actions behind ``actor`` (after a failed step)."""
        fresh = await self._build(actor.env_name, actor.env_id, actor.task, list(actor.actions))
        actor.env, actor.messages, actor.answers, actor.done = fresh.env, fresh.messages, fresh.answers, fresh.done

    async def close(self, env_name: str, env_id: str) -> bool:
        """Forget the actor and its journal; False when there was none."""
        actor = self._actors.pop((env_name, env_id), None)
        self._creating.pop((env_name, env_id), None)
        path = self._journal(env_name, env_id)
        had_journal = path is not None and path.exists()
        if path is not None:
            path.unlink(missing_ok=True)
        if actor is not None:
            await actor.env.close()
        return actor is not None or had_journal

    def _expire(self) -> None:
        """Drop actors idle for longer than ``idle_ttl_s`` (clients that never closed them)."""
        now = time.monotonic()
        for key, actor in list(self._actors.items()):
            if now - actor.last_used > self.idle_ttl_s and not actor.lock.locked():
                del self._actors[key]
                self._creating.pop(key, None)
