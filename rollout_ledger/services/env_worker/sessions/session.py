"""One agent episode's conversation with the policy: each model call is one turn, token-exact across calls.

The session speaks no wire protocol: a dialect (``dialects/``: Chat Completions, Responses, Messages) turns each
call into a ``TurnRequest`` of canonical messages and writes the ``TurnResult`` back in its own shape, so calls of
any dialect, even mixed within one episode, extend the same transcript under the same rules.

Design note. An agent sends its whole conversation on every call; the policy must see exactly the ids the
trajectory records. So the session keeps the episode's ``Transcript`` and treats call ``t+1`` as follows:

- if its messages are call ``t``'s messages, plus the assistant message call ``t`` returned (content and
  tool calls as returned; arguments compared as JSON), plus new messages (tool results, the next user
  message), and the tools are the same: the new messages are the observation of turn ``t`` and only the
  template delta after the sampled ids is tokenised (``Transcript.add_observation``), exactly as the driver
  does for an environment's observation;
- otherwise the agent rewrote its history (edited or dropped messages, changed the tools): the conversation is
  re-rendered as a new segment (``Transcript.restart``, drift ``history_rewrite``). Both publish
  ``StepCompleted`` for turn ``t`` (seq ``2t+2``) before turn ``t+1`` is requested, with ``new_segment`` and
  ``drift`` set by the transcript. Never a 500: a rewrite is a segment, not an error.

Tools are part of the prompt: the tool-aware template renders them into the system message, so a call whose
``tools`` differ from the previous call's (added, removed, reordered or edited; ``tool_choice`` does not count)
cannot extend the context and starts a new segment (drift ``history_rewrite``), rendered with the new tools. The
turns before it stay a segment of their own, token-exact against the tools they were sampled with.

``tool_choice`` ``required``, a named function or ``allowed_tools`` in mode ``required`` is enforced by the engine
(``SamplingParams.tool_call``: a grammar admitting exactly one hermes call of an allowed name): the ids sampled under
it are recorded verbatim like any others, and the reply carries the parsed call.

Stop strings follow OpenAI: the turn's ids are appended verbatim (with a stop string they end with it, and
maybe more text in the same token), while the action (the reply's content and tool calls, and
``StepCompleted.action``) is their text cut before the stop string (``stop_strings.stop_hit``; see ``turns``).

The step of the last turn is published when the agent returns (final: no ids, the agent's reward). Calls of
one session are serialised (a conversation is linear). A call that finds the turn budget or the context used
up is refused with a 400 (``max_turns_exceeded`` / ``context_length_exceeded``) and the episode ends
truncated with that stop reason; an inference failure is a 503 and the episode fails with class
``inference``, whatever the agent does with the error.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_ledger.services.env_worker.sessions.turns import (
    ApiError,
    AssistantTurn,
    Message,
    TurnRequest,
    TurnResult,
    assistant_turn,
    clip_texts,
    logprob_entries,
    same_message,
    token_texts,
)
from rollout_ledger.services.env_worker.stop_strings import stop_hit
from rollout_ledger.services.env_worker.tokenization import Delta, Drift, Transcript, TurnTemplate
from rollout_ledger.shared.errors import InferenceError, TokenizationError
from rollout_ledger.shared.events import FailureClass, SamplingParams, TurnGenerated
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)


class EpisodeSink(Protocol):
    """What a session needs from the episode it belongs to (``agents.AgentEpisode``)."""

    @property
    def sampling(self) -> SamplingParams:
        """The batch's sampling parameters (defaults for what a call does not set)."""
        ...

    @property
    def max_turns(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def batch_cancelled(self) -> bool: ...

    async def publish_started(self, transcript: Transcript, messages: list[Message]) -> None: ...

    async def generate_turn(self, t: int, context: Any, sampling: SamplingParams, max_tokens: int) -> TurnGenerated:
        ...

    async def publish_step(self, t: int, turn: TurnGenerated, action: str, observation: list[Message],
                           delta: Delta, *, final: bool, reward: float = 0.0, terminated: bool = False,
                           truncated: bool = False, info: dict[str, Any] | None = None) -> None: ...


@dataclass(frozen=True)
class Ending:
    """Why the session stopped taking calls before the agent returned (set by the call that found out)."""

    status: str
    """``truncated``, ``failed`` or ``cancelled``."""
    reason: str
    """Stop reason (``max_turns``, ``context_length``) or failure reason."""
    failure_class: FailureClass | None = None
    retryable: bool = False


@dataclass
class _Pending:
    """The last sampled turn, whose step waits for the next call (its observation) or the agent's return."""

    turn: TurnGenerated
    action: str
    returned: Message
    """The assistant message as returned, in canonical form (what the next call should send back)."""


class AgentSession:
    """The endpoint's state for one episode attempt."""

    def __init__(self, episode: EpisodeSink, template: TurnTemplate, model_name: str) -> None:
        self.episode = episode
        self.template = template
        self.model_name = model_name
        self.transcript: Transcript | None = None
        self.turns = 0
        """Turns generated (== calls answered)."""
        self.ending: Ending | None = None
        self.closed = False
        self._lock = asyncio.Lock()
        self._sent: list[Message] = []
        self._tools_key: str | None = None
        self._pending: _Pending | None = None
        self._inflight: set[asyncio.Task[TurnGenerated]] = set()
        self.memory: dict[str, Any] = {}
        """What dialects keep between the calls of this session (the Responses API's stored responses)."""

    # --- one call -------------------------------------------------------------------------------------
    async def complete(self, req: TurnRequest) -> TurnResult:
        """Answer one model call as the next turn of the episode (``ApiError`` for refusals)."""
        async with self._lock:
            self._check_open()
            messages = req.messages
            sampling = _sampling(self.episode.sampling, req)  # refused before anything is consumed
            tools = req.tools
            try:
                template = self.template.with_tools(tools)
            except TokenizationError as exc:
                raise ApiError(400, f"tools: {exc}", param="tools") from None
            if self.turns >= self.episode.max_turns:
                self._end(Ending("truncated", "max_turns"))
                raise ApiError(400, f"the episode's turn budget ({self.episode.max_turns} calls) is used up",
                               code="max_turns_exceeded")
            try:
                await self._extend(messages, template, _tools_key(tools))
            except TokenizationError as exc:
                raise ApiError(400, f"messages: the chat template cannot render them: {exc}",
                               param="messages") from None
            transcript = self.transcript
            assert transcript is not None
            room = self.episode.max_model_len - transcript.context_len
            if room <= 0:
                self._end(Ending("truncated", "context_length"))
                raise ApiError(400, f"the conversation ({transcript.context_len} tokens) fills the policy's context "
                               f"({self.episode.max_model_len})", code="context_length_exceeded", param="messages")
            limit = req.max_tokens or self.episode.sampling.max_tokens
            turn = await self._generate(self.turns, transcript, sampling, min(limit, room))
            return self._answer(req, transcript, turn, sampling)

    def count_tokens(self, req: TurnRequest) -> int:
        """The ids the call's conversation and tools render to, generation prompt included (nothing is sampled or
        recorded: Anthropic's ``count_tokens``)."""
        try:
            return Transcript(self.template.with_tools(req.tools), req.messages).context_len
        except TokenizationError as exc:
            raise ApiError(400, f"messages: the chat template cannot render them: {exc}", param="messages") from None

    def _check_open(self) -> None:
        if self.closed:
            raise ApiError(404, "the episode of this session has ended", code="session_closed")
        if self.ending is not None:
            status = 503 if self.ending.status == "failed" else 400
            raise ApiError(status, f"the episode of this session is over ({self.ending.status}: {self.ending.reason})",
                           code="episode_over")
        if self.episode.batch_cancelled():
            self._end(Ending("cancelled", "batch cancelled"))
            raise ApiError(409, "the episode's batch was cancelled", code="batch_cancelled")

    async def _extend(self, messages: list[Message], template: TurnTemplate, tools_key: str) -> None:
        """Make the transcript end with the rendering of ``messages`` and the generation prompt; publish the
        start (first call) or the previous turn's step."""
        if self.transcript is None:
            self.transcript = Transcript(template, messages)
            self._sent, self._tools_key = messages, tools_key
            await self.episode.publish_started(self.transcript, messages)
            return
        pending = self._pending
        if pending is None:  # the previous call sampled nothing (refused or failed): the context is unchanged
            if messages != self._sent or tools_key != self._tools_key:
                raise ApiError(400, "messages: the previous call of this session produced no turn; send the "
                               "same conversation again", param="messages")
            return
        transcript = self.transcript
        n = len(self._sent)
        extends = (tools_key == self._tools_key and len(messages) > n and _same_history(messages[:n], self._sent)
                   and same_message(messages[n], pending.returned))
        observation = messages[n + 1:] if extends else []
        if extends:
            delta = transcript.add_observation(observation, final=False)
        else:
            log.info("session.history_rewrite", turn=self.turns - 1, messages=len(messages), previous=n + 1)
            delta = transcript.restart(messages, Drift.HISTORY_REWRITE,
                                       template=None if template is transcript.template else template)
        self._pending = None
        self._sent, self._tools_key = messages, tools_key
        await self.episode.publish_step(self.turns - 1, pending.turn, pending.action, observation, delta, final=False)

    async def _generate(self, t: int, transcript: Transcript, sampling: SamplingParams,
                        max_tokens: int) -> TurnGenerated:
        task = asyncio.create_task(self.episode.generate_turn(t, transcript.context, sampling, max_tokens))
        self._inflight.add(task)
        try:
            return await task
        except InferenceError as exc:
            self._end(Ending("failed", f"turn {t}: {exc}", FailureClass.INFERENCE, exc.retryable))
            raise ApiError(503, f"the policy produced no turn: {exc}", code="inference_failed") from None
        except asyncio.CancelledError:
            if self.closed and not _current_task_cancelling():
                raise ApiError(404, "the episode of this session has ended", code="session_closed") from None
            raise
        finally:
            self._inflight.discard(task)

    def _answer(self, req: TurnRequest, transcript: Transcript, turn: TurnGenerated,
                sampling: SamplingParams) -> TurnResult:
        """The result of a sampled turn. The ids go into the transcript verbatim; the action (what the agent gets
        and the step records) is their text cut before the stop string that stopped the engine, as the APIs'
        content (``stop_strings.stop_hit``; the transcript keeps the whole decoded text for its renderings)."""
        prompt_ids = transcript.context.tolist()
        action, stop_string = stop_hit(transcript.add_sampled(turn.token_ids), sampling.stop)
        self.turns += 1
        finish = "stop" if stop_string is not None else turn.finish_reason.value
        answer: AssistantTurn = assistant_turn(action, finish, parse_tools=req.parse_tools, id_seed=turn.event_id)
        self._pending = _Pending(turn, action, answer.canonical())
        tok = transcript.tokenizer
        lps = None
        if req.logprobs:
            lps = logprob_entries(tok, turn.token_ids, turn.logprobs, turn.top_logprobs, req.top_logprobs)
        ids = turn.token_ids.tolist()
        return TurnResult(
            turn=answer, stop_string=stop_string, prompt_token_ids=prompt_ids, token_ids=ids, logprobs=lps,
            token_texts=clip_texts(token_texts(tok, ids), len(action)) if req.stream else [],
            event_id=turn.event_id, model=req.model or self.model_name, created=int(time.time()),
            extra={"episode_id": turn.episode_id, "turn_index": turn.turn_index, "turn_event_id": turn.event_id,
                   "segment": len(transcript.segments) - 1},
            temperature=sampling.temperature, top_p=sampling.top_p)

    # --- the end --------------------------------------------------------------------------------------
    def _end(self, ending: Ending) -> None:
        if self.ending is None:
            self.ending = ending
            log.info("session.ending", status=ending.status, reason=ending.reason)

    async def finish(self, reward: float, info: dict[str, Any] | None = None) -> None:
        """Publish the last turn's step (final: no ids), carrying the episode's reward, when a turn is pending."""
        async with self._lock:
            pending, self._pending = self._pending, None
            if pending is None or self.transcript is None:
                return
            delta = self.transcript.add_observation((), final=True)
            await self.episode.publish_step(self.turns - 1, pending.turn, pending.action, [], delta, final=True,
                                            reward=reward, terminated=self.ending is None,
                                            truncated=self.ending is not None and self.ending.status == "truncated",
                                            info=info)

    async def close(self) -> None:
        """Refuse further calls and cancel in-flight generations (the agent is gone or timed out)."""
        self.closed = True
        for task in list(self._inflight):
            task.cancel()
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _same_history(sent: list[Message], before: list[Message]) -> bool:
    if len(sent) != len(before):
        return False
    for a, b in zip(sent, before, strict=True):
        if a.get("role") == "assistant" and b.get("role") == "assistant":
            if not same_message(a, b) or a.get("name") != b.get("name"):
                return False
        elif a != b:
            return False
    return True


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def _sampling(base: SamplingParams, req: TurnRequest) -> SamplingParams:
    """The batch's sampling parameters with what the call sets (temperature, top_p, top_k, stop, seed, top_logprobs,
    and the tool call it forces: the call decides that, whatever the batch's parameters say)."""
    values = base.model_dump()
    values["tool_call"] = req.tool_call
    if req.temperature is not None:
        values["temperature"] = req.temperature
    if req.top_p is not None:
        values["top_p"] = req.top_p
    if req.top_k is not None:
        values["top_k"] = req.top_k
    if req.stop is not None:
        values["stop"] = req.stop
    if req.seed is not None:
        values["seed"] = req.seed
    if req.logprobs and req.top_logprobs:
        values["logprobs"] = max(base.logprobs, req.top_logprobs)
    if req.max_tokens is not None:
        values["max_tokens"] = min(req.max_tokens, 131072)
        values["min_tokens"] = min(base.min_tokens, values["max_tokens"])  # the call's limit wins over a floor
    try:
        return SamplingParams.model_validate(values)
    except ValueError as exc:
        raise ApiError(400, f"sampling parameters: {exc}") from None
