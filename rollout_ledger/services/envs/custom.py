"""User environment classes: ``ROLLOUT_ENV_CLASSES="name=module:Class,..."`` and the ``rollout_ledger.envs`` entry
points, loaded and checked at start-up, each registered as the env ``name``; a gymnasium-style class (``reset(seed,
options) -> (observation, info)``, ``step(action) -> (observation, reward, terminated, truncated, info)``, sync or
async) runs through the ``GymEnv`` adapter, a subclass of our ``Env`` as it is."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_ledger.services.envs.base import (
    REPLAY,
    RESTART,
    RESUME_MODES,
    SNAPSHOT,
    Env,
    EnvContext,
    EnvSpec,
    Message,
    StepResult,
)
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.shared.errors import EnvError
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

SETTING = "ROLLOUT_ENV_CLASSES"
ENTRY_POINT_GROUP = "rollout_ledger.envs"
"""Entry points of this group register env classes: the entry point's name is the env name, its value
``module:Class``."""
RESERVED_PREFIXES = ("rg:", "tau2:", "openenv:", "remote:")
"""Names of the library env families; a user env cannot take one."""


class CustomSettings(Protocol):
    """What ``specs`` reads of the env worker's settings (``EnvWorkerSettings``; a protocol, so that the settings
    module can import this one to check its values)."""

    env_classes: str


class EnvClassError(ValueError):
    """A user env class cannot be imported or does not fit the env protocol (the worker refuses to start); the
    message names the setting entry or the entry point."""


@dataclass(frozen=True)
class UserClass:
    """A user env class, loaded and checked."""

    name: str
    """The env name batches use."""
    target: str
    """``module:Class``."""
    origin: str
    """Where it was declared, for errors and the advert (``ROLLOUT_ENV_CLASSES`` or the entry point)."""
    cls: type
    native: bool
    """A subclass of our ``Env`` (used as it is) rather than a gymnasium-style class (adapted by ``GymEnv``)."""


def parse_env_classes(value: str) -> dict[str, str]:
    """``"a=pkg.mod:Cls, b=other:Env"`` -> ``{"a": "pkg.mod:Cls", "b": "other:Env"}``; ``EnvClassError`` when an
    entry is malformed or a name repeats."""
    out: dict[str, str] = {}
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, target = (part.strip() for part in entry.partition("="))
        module, colon, attr = target.partition(":")
        if not sep or not name or not colon or not module.strip() or not attr.strip():
            raise EnvClassError(f"{SETTING} entry {entry!r}: expected name=module:Class")
        if name in out:
            raise EnvClassError(f"{SETTING} lists the env {name!r} twice")
        out[name] = target
    return out


def load_class(target: str, origin: str) -> type:
    """Import ``module:Class`` (modules of the worker's working directory import, as for agents)."""
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name.strip())
    except Exception as exc:
        raise EnvClassError(f"{origin}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    found: Any = module
    for part in attr.strip().split("."):
        found = getattr(found, part, None)
        if found is None:
            raise EnvClassError(f"{origin}: {module_name} has no {attr}")
    if not inspect.isclass(found):
        raise EnvClassError(f"{origin}: {target} is a {type(found).__name__}, not a class")
    return found


def _binds(cls: type, method: str, *args: Any, **kwargs: Any) -> bool:
    """Whether ``instance.method(*args, **kwargs)`` matches the method's signature."""
    fn = getattr(cls, method)
    bound = isinstance(inspect.getattr_static(cls, method), staticmethod | classmethod)
    try:
        inspect.signature(fn).bind(*(() if bound else (None,)), *args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): trust it
        return True
    return True


def _signature(cls: type, method: str) -> str:
    try:
        return str(inspect.signature(getattr(cls, method)))
    except ValueError:
        return "(...)"


def check_class(cls: type, origin: str) -> bool:
    """``EnvClassError`` unless ``cls`` is an ``Env`` subclass or a gymnasium-style class, constructible without
    arguments; True for an ``Env`` subclass."""
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise EnvClassError(f"{origin}: {cls.__qualname__}() needs arguments; an env class is built without "
                            "any (read the task in reset)") from None
    except ValueError:
        pass
    if issubclass(cls, Env):
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
            raise EnvClassError(f"{origin}: {cls.__qualname__} is abstract (implement {missing})")
        return True
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise EnvClassError(f"{origin}: {cls.__qualname__} has no {method}() (a gymnasium-style env has "
                                "reset(seed=None, options=None) and step(action))")
    if not _binds(cls, "reset", seed=None, options={}):
        raise EnvClassError(f"{origin}: {cls.__qualname__}.reset{_signature(cls, 'reset')} cannot be called "
                            "as reset(seed=..., options=...)")
    if not _binds(cls, "step", "action"):
        raise EnvClassError(f"{origin}: {cls.__qualname__}.step{_signature(cls, 'step')} cannot be called "
                            "as step(action)")
    close = getattr(cls, "close", None)
    if close is not None and (not callable(close) or not _binds(cls, "close")):
        raise EnvClassError(f"{origin}: {cls.__qualname__}.close cannot be called as close()")
    return False


async def _resolve(value: Any) -> Any:
    """``value``, awaited when the user's method was async (or returned an awaitable)."""
    return await value if inspect.isawaitable(value) else value


def observation_messages(observation: Any, where: str) -> list[Message]:
    """A user observation as chat messages: a str is one user message (empty: none), a message dict or a list of
    them as they are, None no message."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}] if observation else []
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             for m in observation):
        return [dict(m) for m in observation]
    raise EnvError(f"{where}: the observation must be a str or chat messages ({{'role': ..., 'content': ...}}), "
                   f"got {type(observation).__name__}: {str(observation)[:100]!r}")


def _info(info: Any, where: str) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise EnvError(f"{where}: info must be a dict, got {type(info).__name__}")
    return dict(info)


class GymEnv(Env):
    """Our ``Env`` around a gymnasium-style user class: one instance per episode, built at ``reset``; the task is
    ``options`` and its integer ``seed`` the seed."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls = cls
        self.name = name
        self.resume = gym_resume_mode(cls)
        self.env: Any = None
        self._context: EnvContext | None = None
        self._tools: list[dict[str, Any]] | None = None

    def bind(self, context: EnvContext) -> None:
        self._context = context

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.env = env = self.cls()
        if self._context is not None and callable(getattr(env, "bind", None)):
            await _resolve(env.bind(self._context))  # optional: ids and the worker's chat LLM
        seed = task.get("seed")
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
        result = await _resolve(env.reset(seed=seed, options=dict(task)))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise EnvError(f"{self.name}: reset must return (observation, info), got {type(result).__name__}")
        _info(result[1], f"{self.name}: reset")
        messages = observation_messages(result[0], f"{self.name}: reset")
        if not messages:
            raise EnvError(f"{self.name}: reset returned an empty observation (the prompt)")
        tools = getattr(env, "tools", None)
        tools = await _resolve(tools()) if callable(tools) else tools
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EnvError(f"{self.name}: tools must be a list of tool schemas (dicts), got {type(tools).__name__}")
        self._tools = tools or None
        return messages

    async def step(self, action: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("step() before reset()")
        result = await _resolve(self.env.step(action))
        if not (isinstance(result, tuple) and len(result) == 5):
            raise EnvError(f"{self.name}: step must return (observation, reward, terminated, truncated, info), "
                           f"got {type(result).__name__}{f' of {len(result)}' if isinstance(result, tuple) else ''}")
        observation, reward, terminated, truncated, info = result
        where = f"{self.name}: step"
        return StepResult(observation=observation_messages(observation, where), reward=reward,
                          terminated=bool(terminated), truncated=bool(truncated), info=_info(info, where))

    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools

    def snapshot(self) -> Any:
        return self.env.snapshot()

    async def restore(self, state: Any) -> None:
        await _resolve(self.env.restore(state))

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            await _resolve(close())


def gym_resume_mode(cls: type) -> str:
    """A gymnasium-style class's resume capability: its ``resume`` attribute when it names one (``snapshot`` needs
    ``snapshot()`` and ``restore(state)`` methods), ``replay`` when it declares itself ``deterministic = True``,
    else ``restart``."""
    declared = getattr(cls, "resume", None)
    if declared in RESUME_MODES:
        if declared == SNAPSHOT and not (callable(getattr(cls, "snapshot", None))
                                         and callable(getattr(cls, "restore", None))):
            return RESTART
        return str(declared)
    return REPLAY if getattr(cls, "deterministic", False) is True else RESTART


def user_spec(user: UserClass) -> EnvSpec:
    """The env of a loaded user class; ``description``, ``multi_turn`` and ``example_task`` class attributes are
    used when present."""
    cls = user.cls
    doc = (cls.__doc__ or "").strip().split("\n", 1)[0]
    description = getattr(cls, "description", None)
    example = getattr(cls, "example_task", None)
    multi_turn = getattr(cls, "multi_turn", True)

    def factory() -> Env:
        return cls() if user.native else GymEnv(cls, user.name)

    return EnvSpec(
        name=user.name,
        factory=factory,
        description=description if isinstance(description, str) and description else
        (doc or f"user env class {user.target}"),
        multi_turn=multi_turn if isinstance(multi_turn, bool) else True,
        example_task=dict(example) if isinstance(example, dict) else {},
    )


def _check_name(name: str, origin: str, taken: set[str]) -> None:
    if not name or any(c.isspace() or c in ",=" for c in name):
        raise EnvClassError(f"{origin}: {name!r} is not a usable env name")
    if name in taken:
        raise EnvClassError(f"{origin}: the env {name!r} clashes with a built-in env of that name")
    if name.startswith(RESERVED_PREFIXES):
        raise EnvClassError(f"{origin}: the env {name!r} takes the prefix of a library env family "
                            f"({', '.join(RESERVED_PREFIXES)})")


def entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed ``rollout_ledger.envs`` entry points (the same one seen twice on sys.path counts once)."""
    seen: dict[tuple[str, str], importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault((ep.name, ep.value), ep)
    return list(seen.values())


def _entry_origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    source = f", distribution {dist.name}" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP}{source})"


def load_user_classes(value: str) -> list[UserClass]:
    """Every user env class of ``ROLLOUT_ENV_CLASSES`` (``value``) and of the entry points, loaded and checked; a
    name in both is the setting's (logged); ``EnvClassError`` names the first that does not fit."""
    taken = set(builtin_registry().names())
    declared: dict[str, tuple[str, str]] = {}
    for ep in entry_points():
        origin = _entry_origin(ep)
        if ep.name in declared:
            raise EnvClassError(f"{origin}: the env {ep.name!r} is also declared by {declared[ep.name][1]}")
        declared[ep.name] = (ep.value, origin)
    for name, target in parse_env_classes(value).items():
        if name in declared:
            log.info("envs.class_overrides_entry_point", env=name, target=target, entry_point=declared[name][1])
        declared[name] = (target, f"{SETTING} entry {name}={target}")
    loaded = []
    for name, (target, origin) in declared.items():
        _check_name(name, origin, taken)
        cls = load_class(target, origin)
        loaded.append(UserClass(name=name, target=target, origin=origin, cls=cls, native=check_class(cls, origin)))
    return loaded


def specs(settings: CustomSettings) -> list[EnvSpec]:
    """The envs of ``settings.env_classes`` and of the ``rollout_ledger.envs`` entry points."""
    users = load_user_classes(settings.env_classes)
    if users:
        log.info("envs.user_classes", envs={u.name: u.target for u in users})
    return [user_spec(u) for u in users]
