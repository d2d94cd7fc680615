"""One call of an agent and what came of it: loading ``name=module:attr`` entries (an agent function, or a
``command.CommandAgent``), running one against its session URL (in the env worker or in an agent process), and the
outcome as plain data.

Kept free of the worker's bus, driver and tokenizer imports: agent processes (``process``) import it, and
their start-up cost is what they import.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from rollout_ledger.services.env_worker.agents.outcome import (
    REASON_CHARS,
    AgentResult,
    AgentRun,
    RunEnd,
    RunOutcome,
    agent_result,
    jsonable,
)

if TYPE_CHECKING:
    from rollout_ledger.services.env_worker.agents.command import CommandAgent

__all__ = ["REASON_CHARS", "AgentLoadError", "AgentResult", "AgentRun", "AgentSpec", "RunEnd", "RunOutcome",
           "agent_result", "jsonable", "load_agent", "load_agents", "parse_agents", "run_agent", "shared_http_client"]

AgentFunction = Callable[[dict[str, Any], Any], Awaitable[Any]]
"""``async def run(task: dict, client: openai.AsyncOpenAI) -> float | dict``."""

class AgentLoadError(ValueError):
    """An agent entry cannot be parsed or its function or command imported (the worker refuses to start)."""


@dataclass(frozen=True)
class AgentSpec:
    """A registered agent: a function, or a command line (``command``)."""

    name: str
    """The env name batches use."""
    target: str
    """``module:attr``."""
    function: AgentFunction | None
    """The agent function (None for a command)."""
    description: str = ""
    command: CommandAgent | None = None
    """The harness process run per episode, when the entry names a ``CommandAgent``."""

    def advert(self, registered_by: str) -> dict[str, Any]:
        """The ``rl_envs`` bucket value (the scheduler accepts the name as an env)."""
        kind = "agent command" if self.command is not None else "agent function"
        return {"name": self.name, "description": self.description or f"{kind} {self.target}",
                "multi_turn": True, "example_task": {}, "registered_by": registered_by, "kind": "agent",
                "agent": self.target}


def parse_agents(value: str) -> dict[str, str]:
    """``"a=pkg.mod:fn, b=other:run"`` -> ``{"a": "pkg.mod:fn", "b": "other:run"}`` (``AgentLoadError`` when
    an entry is malformed or a name repeats)."""
    out: dict[str, str] = {}
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, target = entry.partition("=")
        name, target = name.strip(), target.strip()
        module, colon, attr = target.partition(":")
        if not sep or not name or not colon or not module or not attr:
            raise AgentLoadError(f"agent entry {entry!r}: expected name=module:function")
        if name in out:
            raise AgentLoadError(f"agent {name!r} is listed twice")
        out[name] = target
    return out


def load_agent(name: str, target: str) -> AgentSpec:
    """Import ``module:attr``: an ``async def`` taking ``(task, client)``, or a ``CommandAgent``."""
    from rollout_ledger.services.env_worker.agents.command import CommandAgent

    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:  # as uvicorn does: modules of the directory the worker runs in import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AgentLoadError(f"agent {name!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    function: Any = module
    for part in attr.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise AgentLoadError(f"agent {name!r}: {module_name} has no {attr}")
    if isinstance(function, CommandAgent):
        return AgentSpec(name=name, target=target, function=None, description=function.summary(), command=function)
    if not inspect.iscoroutinefunction(function):
        raise AgentLoadError(f"agent {name!r}: {target} must be an async function run(task, client) or a "
                             "CommandAgent")
    doc = inspect.getdoc(function) or ""
    return AgentSpec(name=name, target=target, function=function, description=doc.split("\n", 1)[0])


def load_agents(value: str) -> dict[str, AgentSpec]:
    """Every agent of a ``ROLLOUT_AGENTS`` value, imported."""
    return {name: load_agent(name, target) for name, target in parse_agents(value).items()}


def failure_reason(agent: AgentSpec, exc: BaseException) -> str:
    """The exception and the end of its traceback (the frames nearest the error matter most)."""
    head = f"agent {agent.name} ({agent.target}) raised {type(exc).__name__}: {exc}"[:400]
    tb = "".join(traceback.format_exception(exc))
    room = REASON_CHARS - len(head) - 1
    return f"{head}\n{tb[-room:]}" if room > 0 else head


class SharedHttpClient(Protocol):
    """The one HTTP client of every episode's ``AsyncOpenAI`` in a process (``shared_http_client``)."""

    async def aclose(self) -> None: ...

    async def shutdown(self) -> None: ...


def shared_http_client() -> SharedHttpClient:
    """The one HTTP client every episode's ``AsyncOpenAI`` of a process uses (``http_client=``): a fresh
    ``AsyncOpenAI`` costs ~20-26 ms of CPU building its SSL context, one on this client ~0.04 ms. It is the
    SDK's own client class (``httpx2`` or ``httpx``, whichever this ``openai`` speaks) with keep-alive for many
    sessions; an agent that closes its client (``await client.close()``, ``async with client``) leaves this
    one open for the others (``shutdown`` closes it)."""
    from openai import DefaultAsyncHttpxClient

    base = next(c for c in DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    module = importlib.import_module(base.__module__.split(".")[0])

    class _Shared(DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            """Ignored: the client is shared."""

        async def shutdown(self) -> None:
            await super().aclose()

    shared: SharedHttpClient = _Shared(limits=module.Limits(max_connections=None, max_keepalive_connections=1024))
    return shared


def openai_client(run: AgentRun, http: SharedHttpClient) -> Any:
    """The ``openai.AsyncOpenAI`` an agent gets: its session's URL and secret, no SDK retries (a retried call
    would be another turn), the call's deadline as the request timeout."""
    from openai import AsyncOpenAI  # the SDK only where agents run

    return AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0, timeout=run.timeout_s or None,
                       http_client=cast(Any, http))


async def run_agent(spec: AgentSpec, run: AgentRun, http: SharedHttpClient) -> RunOutcome:
    """Call ``spec``'s function on ``run`` (or run its command) within its deadline; cancellation from outside
    propagates (a command's process group is killed first)."""
    if spec.command is not None:
        return await spec.command.run(spec.name, run)
    assert spec.function is not None  # an AgentSpec is a function or a command (load_agent)
    client = openai_client(run, http)
    timeout = asyncio.timeout(run.timeout_s or None)
    try:
        async with timeout:
            value = await spec.function(run.task, client)
    except TimeoutError as exc:
        if timeout.expired():
            return RunOutcome(RunEnd.TIMEOUT)
        return _raised(spec, exc)
    except Exception as exc:  # user code: any exception is the agent's failure
        return _raised(spec, exc)
    try:
        return RunOutcome(RunEnd.RETURNED, agent_result(value))
    except ValueError as exc:
        return RunOutcome(RunEnd.INVALID, message=f"agent {spec.name}: {exc}")


def _raised(spec: AgentSpec, exc: BaseException) -> RunOutcome:
    return RunOutcome(RunEnd.RAISED, message=failure_reason(spec, exc), error=f"{type(exc).__name__}: {exc}"[:500])
