"""Remote environment actors: an ``Env`` whose reset and step are HTTP calls to an environment server.

Design note. The wire protocol is the one of interactor.py (``get_task_prompt`` -> policy -> ``step``, until
terminated/truncated or an empty prompt), plus a ``reset`` that hands the server this episode's task and a
best-effort ``DELETE``. One actor is one episode attempt; the adapter names it (``env_id``, a fresh hex id).

    POST   {base}/{env}/{env_id}/reset            body {"task": {...}}
           -> {"tools": [...] | null}              tool schemas the chat template renders (optional)
    GET    {base}/{env}/{env_id}/get_task_prompt
           -> [{"role": ..., "content": ...}, ...] the WHOLE conversation so far; [] ends the episode
    POST   {base}/{env}/{env_id}/step             body {"action": "<assistant text>"}, header Rollout-Step: t
           -> {"reward": float, "terminated": bool, "truncated": bool, "info": {...}}
              (optional: "aborted": bool, and "observation": [messages] to save the next get_task_prompt)
    DELETE {base}/{env}/{env_id}                   best effort when the episode ends; never retried

The step body is exactly interactor.py's; ``Rollout-Step`` (the 0-based step index) lets a server answer a
retried step from its record instead of stepping twice (the reference server in ``services/envserver`` does).
After a step that does not end the episode the adapter reads ``get_task_prompt`` and hands the driver the
messages after the known history (the previous prompt plus the assistant's action); a server that rewrites
earlier messages is an ``env`` failure here (the driver's token accounting needs a prefix-stable history).

Failures: every request has a timeout (``timeout_s``). Transport errors (refused, reset, timeouts) and 5xx
answers are retried with exponential backoff and jitter, up to ``retries`` more requests; then the episode
attempt fails with class ``env``, retryable (the per-class budget decides whether another attempt runs). A 4xx
answer, or a 2xx whose body is not the protocol's shape, is never retried: ``EnvError`` with
``retryable=False`` (the same request would get the same answer).

Actor pool: each remote env (one base URL and env name) has an ``ActorPool``: one HTTP client (keep-alive
connections), a semaphore bounding the actors alive at once (``concurrency``; an episode waits for a free actor
before its reset) and start-up jitter: the first wave of ``concurrency`` actors waits a random
``[0, startup_jitter_s)`` before its reset, so a worker starting with a full queue does not hit the server at
once.

Registration: ``ROLLOUT_REMOTE_ENVS="name=http://host:port,..."`` (env worker setting) registers each as the
env ``remote:<name>`` (a batch's ``env``), served at ``http://host:port/<name>/...``.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_ledger.services.envs.base import Env, EnvSpec, Message, StepResult
from rollout_ledger.shared.errors import EnvError
from rollout_ledger.shared.kit.backoff import backoff_delay
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

REMOTE_PREFIX = "remote:"
"""Registry names of remote envs: ``remote:<name>``."""
BACKOFF_JITTER = 0.5
"""Retry pauses are 50-100 % of the exponential one, so actors that failed together do not retry together."""
STEP_HEADER = "Rollout-Step"
"""Header carrying the 0-based index of a step (a server may use it to answer a retried step idempotently)."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class RemoteEndpoint:
    """Where one remote env is served."""

    name: str
    """The env's name on the server (the ``{env}`` path segment)."""
    base_url: str
    """``http(s)://host:port[/prefix]`` without a trailing slash."""

    @property
    def registry_name(self) -> str:
        return f"{REMOTE_PREFIX}{self.name}"


def parse_remote_envs(spec: str) -> list[RemoteEndpoint]:
    """``"name=http://host:port,..."`` -> endpoints; ``ValueError`` naming the bad entry."""
    out: list[RemoteEndpoint] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, url = entry.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not _NAME_RE.match(name):
            raise ValueError(f"remote env {entry!r}: expected name=http://host:port with a name of letters, "
                             "digits, '_', '.' or '-'")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote env {entry!r}: the URL must start with http:// or https://")
        if any(e.name == name for e in out):
            raise ValueError(f"remote env {name!r} is given twice")
        out.append(RemoteEndpoint(name, url))
    return out


@dataclass(frozen=True)
class RemoteConfig:
    """Timeouts, retries and pool size for remote envs (from ``EnvWorkerSettings``)."""

    timeout_s: float = 10.0
    """Per request (connect, read, write and pool wait)."""
    retries: int = 4
    """Further requests after a transport error or a 5xx answer, before the attempt fails (class ``env``)."""
    backoff_s: float = 0.2
    """Pause before the first retry; doubled before each further one (with jitter: 50-100 % of it)."""
    backoff_max_s: float = 5.0
    """Longest pause between retries."""
    concurrency: int = 64
    """Actors (episodes) alive at once per remote env."""
    startup_jitter_s: float = 0.5
    """The first wave of actors waits a random ``[0, this)`` before its reset."""

    def backoff(self, retry: int, rng: random.Random) -> float:
        """Pause before retry number ``retry`` (0-based): exponential, capped, 50-100 % jitter."""
        return backoff_delay(retry, self.backoff_s, self.backoff_max_s, BACKOFF_JITTER, rng)


class Slots:
    """At most ``concurrency`` holders at once; the first wave of ``concurrency`` waits a random
    ``[0, startup_jitter_s)`` after getting its slot (a worker starting with a full queue does not hit a server at
    once). Shared by the remote env pools (this module's ``ActorPool``, openenv_remote.py's ``SessionPool``)."""

    def __init__(self, concurrency: int, startup_jitter_s: float, rng: random.Random) -> None:
        self.concurrency = concurrency
        self.startup_jitter_s = startup_jitter_s
        self.rng = rng
        self._sem: asyncio.Semaphore | None = None
        """Made on first use (inside the running loop)."""
        self._wave_left = concurrency
        """Holders of the first wave still to come (each waits a random start-up delay)."""
        self.waiting = 0
        """Acquirers waiting for a slot now."""

    async def acquire(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.concurrency)
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        if self._wave_left > 0 and self.startup_jitter_s > 0:
            self._wave_left -= 1
            try:
                await asyncio.sleep(self.rng.uniform(0.0, self.startup_jitter_s))
            except BaseException:
                self.release()
                raise

    def release(self) -> None:
        if self._sem is not None:
            self._sem.release()


class ActorPool:
    """The actors of one remote env: one HTTP client, at most ``concurrency`` actors alive, start-up jitter."""

    def __init__(self, endpoint: RemoteEndpoint, config: RemoteConfig, rng: random.Random | None = None,
                 on_retry: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self.config = config
        self.rng = rng or random.Random()
        self.on_retry = on_retry
        """Called once per retried request (a metric)."""
        self._client: httpx.AsyncClient | None = None
        self.slots = Slots(config.concurrency, config.startup_jitter_s, self.rng)

    def client(self) -> httpx.AsyncClient:
        """The pool's client, made on first use (inside the running loop)."""
        if self._client is None:
            limits = httpx.Limits(max_connections=max(8, self.config.concurrency),
                                  max_keepalive_connections=max(4, self.config.concurrency // 2))
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.timeout_s), limits=limits,
                                             trust_env=False)
        return self._client

    async def acquire(self) -> None:
        """Wait for a free actor slot (and, in the first wave, a random start-up delay)."""
        await self.slots.acquire()

    def release(self) -> None:
        self.slots.release()

    def url(self, env_id: str, suffix: str = "") -> str:
        path = f"{self.endpoint.base_url}/{self.endpoint.name}/{env_id}"
        return f"{path}/{suffix}" if suffix else path

    async def request(self, method: str, env_id: str, suffix: str, what: str, *, body: Any = None,
                      headers: dict[str, str] | None = None) -> Any:
        """One protocol call with retries on transport errors and 5xx; the decoded JSON answer.

        ``EnvError(retryable=False)`` on a 4xx or a body that is not JSON; ``EnvError(retryable=True)`` when the
        retries are spent.
        """
        url = self.url(env_id, suffix)
        client = self.client()
        attempts = 1 + self.config.retries
        last = ""
        for i in range(attempts):
            if i > 0:
                if self.on_retry is not None:
                    self.on_retry()
                await asyncio.sleep(self.config.backoff(i - 1, self.rng))
            try:
                resp = await client.request(method, url, json=body, headers=headers)
            except httpx.TransportError as exc:  # connect/read/write errors and timeouts
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning("remote_env.transport_error", env=self.endpoint.name, request=what, error=last,
                            try_no=i + 1, tries=attempts)
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {_snippet(resp)}"
                log.warning("remote_env.server_error", env=self.endpoint.name, request=what, status=resp.status_code,
                            try_no=i + 1, tries=attempts)
                continue
            if resp.status_code >= 400:
                raise EnvError(f"remote env {self.endpoint.name} {what}: HTTP {resp.status_code}: {_snippet(resp)} "
                               "(a 4xx is not retried)", retryable=False)
            if resp.status_code == 204 or not resp.content:
                return None
            try:
                return resp.json()
            except ValueError as exc:
                raise EnvError(f"remote env {self.endpoint.name} {what}: answer is not JSON: {_snippet(resp)}",
                               retryable=False) from exc
        raise EnvError(f"remote env {self.endpoint.name} {what}: no answer after {attempts} requests to {url}: "
                       f"{last}", retryable=True)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _snippet(resp: httpx.Response, limit: int = 300) -> str:
    text = resp.text.strip().replace("\n", " ")
    return text[:limit] + ("…" if len(text) > limit else "")


def _key(message: Message) -> tuple[Any, Any]:
    return message.get("role"), message.get("content")


def _messages(value: Any, what: str) -> list[Message]:
    """A protocol message list, or a non-retryable ``EnvError`` naming what is wrong."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              for m in value):
        raise EnvError(f"remote env {what}: expected a list of messages with a 'role', got {str(value)[:200]}",
                       retryable=False)
    return value


class RemoteEnv(Env):
    """One episode attempt on a remote actor (single use)."""

    def __init__(self, pool: ActorPool) -> None:
        self.pool = pool
        self.env_id = uuid.uuid4().hex
        self._held = False
        self._created = False
        self._history: list[Message] = []
        self._tools: list[dict[str, Any]] | None = None
        self._steps = 0

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        await self.pool.acquire()
        self._held = True
        answer = await self.pool.request("POST", self.env_id, "reset", "reset", body={"task": task})
        self._created = True
        tools = answer.get("tools") if isinstance(answer, dict) else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EnvError(f"remote env reset: 'tools' must be a list of objects, got {str(tools)[:200]}",
                           retryable=False)
        self._tools = tools
        prompt = _messages(await self.pool.request("GET", self.env_id, "get_task_prompt", "get_task_prompt"),
                           "get_task_prompt")
        if not prompt:
            raise EnvError("remote env get_task_prompt: empty prompt right after reset", retryable=False)
        self._history = prompt
        return list(prompt)

    async def step(self, action: str) -> StepResult:
        t = self._steps
        self._steps += 1
        answer = await self.pool.request("POST", self.env_id, "step", f"step {t}", body={"action": action},
                                         headers={STEP_HEADER: str(t)})
        if not isinstance(answer, dict):
            raise EnvError(f"remote env step {t}: expected an object, got {str(answer)[:200]}", retryable=False)
        try:
            reward = float(answer.get("reward", 0.0) or 0.0)
        except (TypeError, ValueError, OverflowError) as exc:
            raise EnvError(f"remote env step {t}: reward {str(answer.get('reward'))[:100]!r} is not a number",
                           retryable=False) from exc
        if not math.isfinite(reward):  # JSON NaN / Infinity / 1e999 (httpx parses them), or the string "nan"
            raise EnvError(f"remote env step {t}: reward {reward!r} is not a finite number", retryable=False)
        terminated = bool(answer.get("terminated", False))
        truncated = bool(answer.get("truncated", False))
        aborted = bool(answer.get("aborted", False))
        raw_info = answer.get("info")
        info: dict[str, Any] = dict(raw_info) if isinstance(raw_info, dict) else {}
        known = [*self._history, {"role": "assistant", "content": action}]
        if terminated or truncated or aborted:
            observation = _messages(answer.get("observation", []), f"step {t} observation")
            self._history = [*known, *observation]
            return StepResult(observation, reward, terminated, truncated, aborted, info)
        if "observation" in answer:
            observation = _messages(answer["observation"], f"step {t} observation")
        else:
            prompt = _messages(await self.pool.request("GET", self.env_id, "get_task_prompt",
                                                       f"get_task_prompt after step {t}"), "get_task_prompt")
            if not prompt:  # interactor.py: an empty prompt ends the episode
                info["empty_prompt"] = True
                self._history = known
                return StepResult([], reward, True, False, False, info)
            observation = self._new_messages(prompt, known, t)
        self._history = [*known, *observation]
        return StepResult(observation, reward, terminated, truncated, aborted, info)

    def _new_messages(self, prompt: list[Message], known: list[Message], t: int) -> list[Message]:
        """The messages of ``prompt`` after the known history (with or without the server echoing the action)."""
        keys = [_key(m) for m in prompt]
        for prefix in (known, self._history):
            if keys[:len(prefix)] == [_key(m) for m in prefix]:
                return prompt[len(prefix):]
        raise EnvError(f"remote env step {t}: get_task_prompt does not extend the conversation (the server "
                       "rewrote earlier messages)", retryable=False)

    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools

    async def close(self) -> None:
        if self._held:
            self._held = False
            self.pool.release()
        if self._created:
            self._created = False
            try:
                await asyncio.wait_for(self.pool.client().delete(self.pool.url(self.env_id)),
                                       self.pool.config.timeout_s)
            except Exception as exc:  # best effort: the server may be gone; its actor expires there
                log.info("remote_env.close_failed", env=self.pool.endpoint.name, error=f"{type(exc).__name__}")


@dataclass
class RemoteEnvs:
    """The remote envs of one worker: their registry specs and pools (closed when the worker stops)."""

    pools: list[ActorPool]

    @classmethod
    def build(cls, endpoints: list[RemoteEndpoint], config: RemoteConfig,
              on_retry: Callable[[], None] | None = None) -> RemoteEnvs:
        return cls([ActorPool(e, config, on_retry=on_retry) for e in endpoints])

    def specs(self) -> list[EnvSpec]:
        return [_spec(pool) for pool in self.pools]

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


def _spec(pool: ActorPool) -> EnvSpec:
    e = pool.endpoint
    return EnvSpec(name=e.registry_name, factory=lambda: RemoteEnv(pool),
                   description=f"Remote environment actor {e.name!r} at {e.base_url} (interactor protocol).",
                   multi_turn=True)
