"""OpenEnv environment servers as envs ``openenv:<name>``: one WebSocket session per episode attempt on the
server's ``/ws``, the observation rendered as the user message, the policy's text as the env's typed action.

Design note. OpenEnv's HTTP ``/reset`` and ``/step`` build a fresh environment per request, so a multi-step
episode must hold a WebSocket session: the server makes one environment per connection and destroys it when
the connection ends. The wire format (openenv 0.10.0, ``openenv.core.env_server.http_server``; JSON text frames):

    -> {"type": "reset", "data": {reset kwargs: seed, episode_id, env-specific}}
    -> {"type": "step",  "data": {the env's typed Action as JSON}}
    -> {"type": "state"}                                   <- {"type": "state", "data": {...}}   (not used here)
    -> {"type": "close"}                                   (the server ends the session and the connection)
    <- {"type": "observation", "data": {"observation": {fields, "metadata"}, "reward": number | null,
                                        "done": bool, "metadata"?: {...}}}
    <- {"type": "error", "data": {"message": str, "code": INVALID_JSON | UNKNOWN_TYPE | VALIDATION_ERROR |
                                  EXECUTION_ERROR | CAPACITY_REACHED | FACTORY_ERROR | SESSION_ERROR}}

A server at capacity (or failing to build its env) sends an ``error`` frame when the connection opens and closes.

Mapping to our chat episode:
- The task is ``{"reset": {...kwargs}, "seed": int, "system": str}`` (all optional): ``reset`` is sent as the
  reset message's data, ``seed`` is a shortcut for ``reset.seed``, ``episode_id`` defaults to our episode id;
  ``system`` becomes a system message before the first observation.
- An observation becomes one ``user`` message: the value of its field ``observation=<field>`` (a string as is,
  anything else as JSON) when the env sets one, else the observation's fields (without ``metadata``) as JSON.
- The policy's text becomes the action ``{"<field>": text}`` with ``action=<field>`` (default ``message``, the
  field of OpenEnv's echo env), or, with ``action=json``, the text parsed as a JSON object (the outermost
  ``{...}`` of the text): actions with several or non-string fields. Text that is no JSON object, or an action
  the server refuses (``VALIDATION_ERROR``) in json mode, is the policy's mistake: the step is ``aborted``
  (reward 0, the episode ends); in field mode a refused action means the field is wrong: a non-retryable
  ``EnvError``.
- ``reward`` (null: 0) is the step's reward; ``done`` ends the episode: ``truncated`` when the observation or
  its metadata says ``truncated: true``, else ``terminated``. The final observation is not sent to the policy;
  it is kept in the step's info (``final_observation``) with the observation's ``metadata``. The reset
  observation's reward is not counted (OpenEnv servers answer 0 or null there).

Failures (the classes of remote.py). Every frame waits at most ``timeout_s``. Opening a session (connect and
``reset``) is retried with backoff and jitter up to ``retries`` more times after a transport error (refused,
reset, timeout, a 5xx handshake) or a server-side error frame (``CAPACITY_REACHED``, ``FACTORY_ERROR``,
``SESSION_ERROR``, ``EXECUTION_ERROR``); then the attempt fails with class ``env``, retryable. After the reset
the session's state lives in the connection, so a lost connection, a timed-out step or a step the env failed
(``EXECUTION_ERROR``, ``SESSION_ERROR``) cannot be retried in place: the attempt fails at once, ``EnvError``
retryable (the per-class budget decides whether another attempt runs from a new session). Protocol violations
(a frame that is no JSON object of the shapes above, a non-finite reward, ``INVALID_JSON``/``UNKNOWN_TYPE``, a 4xx
handshake, a reset refused as invalid: ``VALIDATION_ERROR``) are ``EnvError`` with ``retryable=False``.

Session pool: each server has a ``SessionPool`` bounding the sessions open at once (``concurrency``; an episode
waits for a free one before it connects; set it to the server's ``max_concurrent_envs``), with the start-up
jitter of remote.py's ``ActorPool``.

Registration: ``ROLLOUT_OPENENV_ENVS="name=url[;option=value...],..."`` (env worker setting), the URL ``ws(s)://``
or ``http(s)://`` (converted to ``ws(s)://``; ``/ws`` appended unless the path ends with it); options ``action``,
``observation`` and ``concurrency`` (default ``ROLLOUT_OPENENV_CONCURRENCY``). Timeouts, retries and backoff
are the remote envs' (``ROLLOUT_REMOTE_TIMEOUT_S``, ``ROLLOUT_REMOTE_RETRIES``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from rollout_ledger.services.envs.base import Env, EnvContext, EnvSpec, Message, StepResult, TaskError
from rollout_ledger.services.envs.remote import RemoteConfig, Slots
from rollout_ledger.shared.errors import EnvError
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

OPENENV_PREFIX = "openenv:"
"""Registry names of OpenEnv envs: ``openenv:<name>``."""
JSON_ACTION = "json"
"""``action=json``: the policy's text is the action's JSON object."""
DEFAULT_ACTION_FIELD = "message"
"""The action field of OpenEnv's echo env (and of its ``openenv init`` template)."""
MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame accepted from a server."""

TRANSIENT_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR", "EXECUTION_ERROR"})
"""Error codes of the server's own trouble (the 5xx of the WebSocket protocol): a new session may pass."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OPTIONS = ("action", "observation", "concurrency")


@dataclass(frozen=True)
class OpenEnvEndpoint:
    """One OpenEnv server and how its observations and actions map to chat messages."""

    name: str
    """Our name for the env (registered as ``openenv:<name>``)."""
    ws_url: str
    """The session endpoint, ``ws(s)://host:port[/prefix]/ws``."""
    action: str = DEFAULT_ACTION_FIELD
    """The action field that carries the policy's text, or ``json`` (the text is the action's JSON object)."""
    observation: str = ""
    """The observation field rendered as the user message; empty: every field (but ``metadata``) as JSON."""
    concurrency: int | None = None
    """Sessions open at once on this server; None: ``ROLLOUT_OPENENV_CONCURRENCY``."""

    @property
    def registry_name(self) -> str:
        return f"{OPENENV_PREFIX}{self.name}"


def ws_url(url: str) -> str:
    """``http(s)://`` or ``ws(s)://`` base URL -> the session endpoint ``ws(s)://.../ws``."""
    url = url.strip().rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError("the URL must start with ws://, wss://, http:// or https://")
    if "?" in url or "#" in url:
        raise ValueError("the URL must not have a query or fragment")
    return url if url.endswith("/ws") else f"{url}/ws"


def parse_openenv_envs(spec: str) -> list[OpenEnvEndpoint]:
    """``"name=url[;option=value...],..."`` -> endpoints; ``ValueError`` naming the bad entry."""
    out: list[OpenEnvEndpoint] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        head, *opts = (part.strip() for part in entry.split(";"))
        name, sep, url = head.partition("=")
        name = name.strip()
        if not sep or not _NAME_RE.match(name):
            raise ValueError(f"OpenEnv env {entry!r}: expected name=url with a name of letters, digits, '_', '.' "
                             "or '-'")
        try:
            endpoint = OpenEnvEndpoint(name, ws_url(url))
        except ValueError as exc:
            raise ValueError(f"OpenEnv env {entry!r}: {exc}") from exc
        endpoint = _with_options(endpoint, opts, entry)
        if any(e.name == name for e in out):
            raise ValueError(f"OpenEnv env {name!r} is given twice")
        out.append(endpoint)
    return out


def _with_options(endpoint: OpenEnvEndpoint, opts: list[str], entry: str) -> OpenEnvEndpoint:
    seen: set[str] = set()
    for opt in opts:
        key, sep, value = (s.strip() for s in opt.partition("="))
        if not sep or key not in _OPTIONS:
            raise ValueError(f"OpenEnv env {entry!r}: option {opt!r} is not one of "
                             f"{', '.join(k + '=...' for k in _OPTIONS)}")
        if key in seen:
            raise ValueError(f"OpenEnv env {entry!r}: option {key!r} is given twice")
        seen.add(key)
        if key == "concurrency":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"OpenEnv env {entry!r}: concurrency must be an integer >= 1")
            endpoint = replace(endpoint, concurrency=int(value))
        elif not _FIELD_RE.match(value):
            raise ValueError(f"OpenEnv env {entry!r}: {key} must be a field name (letters, digits, '_')")
        elif key == "action":
            endpoint = replace(endpoint, action=value)
        else:
            endpoint = replace(endpoint, observation=value)
    return endpoint


# --- one session -------------------------------------------------------------------------------------------
class _Transient(Exception):
    """The server or the network failed in a way a new session may not (retried at reset, else retryable)."""


class _Refused(Exception):
    """The server answered an error frame about our message."""

    def __init__(self, code: str, message: str, detail: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = detail


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Session:
    """One open WebSocket session: request/answer frames, each with a timeout."""

    def __init__(self, ws: ClientConnection, timeout_s: float) -> None:
        self.ws = ws
        self.timeout_s = timeout_s

    @classmethod
    async def connect(cls, url: str, timeout_s: float) -> Session:
        """Open the connection; ``_Transient`` on network trouble or a 5xx handshake, ``EnvError`` on a 4xx."""
        try:
            ws = await websockets.connect(url, open_timeout=timeout_s, close_timeout=min(timeout_s, 2.0),
                                          max_size=MAX_FRAME_BYTES, proxy=None)
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status >= 500:
                raise _Transient(f"handshake HTTP {status}") from exc
            raise EnvError(f"handshake answered HTTP {status} (is {url} an OpenEnv server?)",
                           retryable=False) from exc
        except InvalidURI as exc:
            raise EnvError(f"bad URL {url}: {exc}", retryable=False) from exc
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
            raise _Transient(_describe(exc)) from exc
        return cls(ws, timeout_s)

    async def call(self, message: dict[str, Any], expect: str) -> dict[str, Any]:
        """Send ``message``, return the answer's ``data`` (a frame of type ``expect``).

        ``_Transient`` when the connection fails, closes or times out; ``_Refused`` on an error frame;
        ``EnvError(retryable=False)`` on a frame that is not the protocol's.
        """
        # A server refusing the session (at capacity) sends its error frame and closes as the connection opens:
        # the send may then fail while the frame waits to be read, so a failed send still reads.
        try:
            with contextlib.suppress(ConnectionClosed):
                await asyncio.wait_for(self.ws.send(json.dumps(message)), self.timeout_s)
            raw = await asyncio.wait_for(self.ws.recv(), self.timeout_s)
        except TimeoutError as exc:
            raise _Transient(f"no answer within {self.timeout_s:g}s") from exc
        except ConnectionClosed as exc:
            raise _Transient(f"connection closed ({_describe(exc)})") from exc
        except OSError as exc:
            raise _Transient(_describe(exc)) from exc
        return _answer(raw, expect)

    async def close(self) -> None:
        """Best effort: the ``close`` message, then the connection's close handshake (bounded by the timeout)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.send(json.dumps({"type": "close"})), self.timeout_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), self.timeout_s)


def _answer(raw: str | bytes, expect: str) -> dict[str, Any]:
    """A frame's ``data`` if it is of type ``expect``; ``_Refused`` for an error frame; else a protocol error."""
    try:
        frame = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EnvError(f"frame is not JSON: {str(raw)[:200]!r}", retryable=False) from exc
    if not isinstance(frame, dict) or not isinstance(frame.get("data", {}), dict):
        raise EnvError(f"frame is not an object with an object 'data': {str(raw)[:200]}", retryable=False)
    kind, data = frame.get("type"), frame.get("data", {})
    if kind == "error":
        raise _Refused(str(data.get("code", "UNKNOWN")), str(data.get("message", ""))[:500], data.get("errors"))
    if kind != expect:
        raise EnvError(f"expected a frame of type {expect!r}, got {str(kind)[:50]!r}", retryable=False)
    return data


# --- the pool ----------------------------------------------------------------------------------------------
class SessionPool:
    """The sessions of one OpenEnv server: at most ``concurrency`` open at once, start-up jitter, retried opens."""

    def __init__(self, endpoint: OpenEnvEndpoint, config: RemoteConfig, rng: random.Random | None = None,
                 on_retry: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self.config = config
        self.rng = rng or random.Random()
        self.on_retry = on_retry
        """Called once per retried session open (a metric)."""
        self.slots = Slots(config.concurrency, config.startup_jitter_s, self.rng)

    async def acquire(self) -> None:
        """Wait for a free session slot (and, in the first wave, a random start-up delay)."""
        await self.slots.acquire()

    def release(self) -> None:
        self.slots.release()

    async def open(self, reset_data: dict[str, Any]) -> tuple[Session, dict[str, Any]]:
        """Connect and reset, retried on transient failures; the session and the reset observation's data."""
        name, url = self.endpoint.name, self.endpoint.ws_url
        tries = 1 + self.config.retries
        last = ""
        for i in range(tries):
            if i > 0:
                if self.on_retry is not None:
                    self.on_retry()
                await asyncio.sleep(self.config.backoff(i - 1, self.rng))
            session: Session | None = None
            try:
                session = await Session.connect(url, self.config.timeout_s)
                data = await session.call({"type": "reset", "data": reset_data}, "observation")
                return session, data
            except (_Transient, _Refused) as exc:
                if session is not None:
                    await session.close()
                if isinstance(exc, _Refused) and exc.code not in TRANSIENT_CODES:
                    raise EnvError(f"OpenEnv env {name} reset refused: {exc}{_errors(exc)}",
                                   retryable=False) from exc
                last = str(exc)
            except BaseException:
                if session is not None:
                    await session.close()
                raise
            log.warning("openenv.session_retry", env=name, error=last, try_no=i + 1, tries=tries)
        raise EnvError(f"OpenEnv env {name} reset: no session after {tries} tries at {url}: {last}",
                       retryable=True)


def _errors(exc: _Refused) -> str:
    return f" ({json.dumps(exc.detail, default=str)[:300]})" if exc.detail else ""


# --- observations ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observed:
    """One decoded observation frame."""

    fields: dict[str, Any]
    reward: float
    done: bool
    truncated: bool
    metadata: dict[str, Any]


def decode_observation(data: dict[str, Any], what: str) -> Observed:
    """The ``data`` of an ``observation`` frame, checked; ``EnvError(retryable=False)`` naming what is wrong."""
    obs = data.get("observation")
    if not isinstance(obs, dict):
        raise EnvError(f"{what}: 'observation' must be an object, got {str(obs)[:200]}", retryable=False)
    raw_reward = data.get("reward")
    if raw_reward is None:
        reward = 0.0
    elif isinstance(raw_reward, (bool, int, float)):
        try:
            reward = float(raw_reward)
        except OverflowError:  # an integer past float's range
            reward = math.inf
    else:
        raise EnvError(f"{what}: reward {str(raw_reward)[:100]!r} is not a number", retryable=False)
    if not math.isfinite(reward):  # Python's json reads NaN, Infinity and 1e999
        raise EnvError(f"{what}: reward {reward!r} is not a finite number", retryable=False)
    done = data.get("done", False)
    if not isinstance(done, bool):
        raise EnvError(f"{what}: 'done' must be a boolean, got {str(done)[:100]!r}", retryable=False)
    meta = data.get("metadata", obs.get("metadata"))
    metadata: dict[str, Any] = dict(meta) if isinstance(meta, dict) else {}
    fields = {k: v for k, v in obs.items() if k != "metadata"}
    truncated = done and (fields.get("truncated") is True or metadata.get("truncated") is True)
    return Observed(fields, reward, done, truncated, metadata)


def render_observation(observed: Observed, field: str, what: str) -> str:
    """The user message's text: the field ``field`` (a string as is, else JSON), or every field as JSON."""
    if not field:
        return json.dumps(observed.fields, ensure_ascii=False, default=str)
    if field not in observed.fields:
        raise EnvError(f"{what}: the observation has no field {field!r} (its fields: "
                       f"{', '.join(sorted(observed.fields))}); fix the env's observation= option", retryable=False)
    value = observed.fields[field]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def action_json(text: str) -> dict[str, Any] | None:
    """The JSON object in the policy's text (the whole text, else its outermost ``{...}``); None if there is none."""
    candidates = [text.strip()]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    for candidate in candidates:
        with contextlib.suppress(ValueError):
            value = json.loads(candidate)
            if isinstance(value, dict):
                return value
    return None


def reset_data(task: dict[str, Any], episode_id: str) -> tuple[dict[str, Any], str]:
    """A task -> the reset message's data and the system prompt; ``TaskError`` for a malformed task."""
    unknown = sorted(set(task) - {"reset", "seed", "system"})
    if unknown:
        raise TaskError(f"OpenEnv task: unknown keys {unknown} (expected reset, seed, system)")
    data = task.get("reset", {})
    if not isinstance(data, dict):
        raise TaskError("OpenEnv task: 'reset' must be an object (the reset kwargs)")
    data = dict(data)
    if "seed" in task:
        if not isinstance(task["seed"], int) or isinstance(task["seed"], bool):
            raise TaskError("OpenEnv task: 'seed' must be an integer")
        data.setdefault("seed", task["seed"])
    if episode_id:
        data.setdefault("episode_id", episode_id)
    system = task.get("system", "")
    if not isinstance(system, str):
        raise TaskError("OpenEnv task: 'system' must be a string")
    return data, system


# --- the env -----------------------------------------------------------------------------------------------
class OpenEnvEnv(Env):
    """One episode attempt in one WebSocket session of an OpenEnv server (single use)."""

    def __init__(self, pool: SessionPool) -> None:
        self.pool = pool
        self.endpoint = pool.endpoint
        self._episode_id = ""
        self._held = False
        self._session: Session | None = None
        self._steps = 0

    def bind(self, context: EnvContext) -> None:
        self._episode_id = context.episode_id

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        data, system = reset_data(task, self._episode_id)
        await self.pool.acquire()
        self._held = True
        self._session, answer = await self.pool.open(data)
        observed = decode_observation(answer, f"OpenEnv env {self.endpoint.name} reset")
        if observed.done:
            raise EnvError(f"OpenEnv env {self.endpoint.name} reset: the episode is done at reset",
                           retryable=False)
        text = render_observation(observed, self.endpoint.observation, f"OpenEnv env {self.endpoint.name} reset")
        messages: list[Message] = [{"role": "system", "content": system}] if system else []
        return [*messages, {"role": "user", "content": text}]

    async def step(self, action: str) -> StepResult:
        if self._session is None:
            raise EnvError(f"OpenEnv env {self.endpoint.name}: step before reset", retryable=False)
        t = self._steps
        self._steps += 1
        what = f"OpenEnv env {self.endpoint.name} step {t}"
        json_mode = self.endpoint.action == JSON_ACTION
        if json_mode:
            payload = action_json(action)
            if payload is None:
                return StepResult([], 0.0, aborted=True, info={"invalid_action": "the reply holds no JSON object"})
        else:
            payload = {self.endpoint.action: action}
        try:
            answer = await self._session.call({"type": "step", "data": payload}, "observation")
        except _Transient as exc:
            raise EnvError(f"{what}: {exc}; the session is lost (an OpenEnv session lives in its connection)",
                           retryable=True) from exc
        except _Refused as exc:
            if exc.code == "VALIDATION_ERROR" and json_mode:
                return StepResult([], 0.0, aborted=True, info={"invalid_action": f"{exc}{_errors(exc)}"[:1000]})
            if exc.code == "VALIDATION_ERROR":
                raise EnvError(f"{what}: the server refused the action {{{self.endpoint.action!r}: text}}: {exc}"
                               f"{_errors(exc)}; set the env's action= option to its action field (or json)",
                               retryable=False) from exc
            raise EnvError(f"{what}: {exc}", retryable=exc.code in TRANSIENT_CODES) from exc
        observed = decode_observation(answer, what)
        info: dict[str, Any] = {"metadata": observed.metadata} if observed.metadata else {}
        text = render_observation(observed, self.endpoint.observation, what)
        if observed.done:
            info["final_observation"] = text
            return StepResult([], observed.reward, terminated=not observed.truncated, truncated=observed.truncated,
                              info=info)
        return StepResult([{"role": "user", "content": text}], observed.reward, info=info)

    async def close(self) -> None:
        session, self._session = self._session, None
        try:
            if session is not None:
                await session.close()
        finally:
            if self._held:
                self._held = False
                self.pool.release()


class OpenEnvSettings(Protocol):
    """What ``specs`` reads of the env worker's settings (``EnvWorkerSettings``; a protocol, so that the settings
    module, which imports the parser above, is not imported back)."""

    openenv_concurrency: int

    def openenv_endpoints(self) -> list[OpenEnvEndpoint]: ...

    def remote_config(self) -> RemoteConfig: ...


def specs(settings: OpenEnvSettings) -> list[EnvSpec]:
    """The envs ``openenv:<name>`` of ``ROLLOUT_OPENENV_ENVS``, each with its session pool."""
    base = settings.remote_config()
    out: list[EnvSpec] = []
    for endpoint in settings.openenv_endpoints():
        config = replace(base, concurrency=endpoint.concurrency or settings.openenv_concurrency)
        out.append(_spec(SessionPool(endpoint, config)))
    return out


def _spec(pool: SessionPool) -> EnvSpec:
    e = pool.endpoint
    action = "the reply as a JSON action" if e.action == JSON_ACTION else f"the reply as action field {e.action!r}"
    return EnvSpec(name=e.registry_name, factory=lambda: OpenEnvEnv(pool),
                   description=f"OpenEnv server {e.name!r} at {e.ws_url} (a WebSocket session per episode; "
                               f"{action}).",
                   multi_turn=True, example_task={"seed": 0})
