"""The ``EnvLLM`` of the env worker: an environment's own chat model (a simulated user) served by the inference
workers, its generations answered but never recorded as the policy's turns.

``chat`` renders the messages with the chat template of the pool's model (the policy's tokenizer unless the pool
has its own), sends one ``InferenceRequested`` with ``record=False`` over NATS and decodes the sampled ids. Pool
``""`` (or ``policy``) goes through the worker's ``InferenceClient`` like a turn: to the worker that served the
episode's previous request while it is live and has room (its prefix cache holds the conversation), else the least
loaded, retried on another. A named pool goes to ``infer_pool_subject(pool)``, whose workers (``ROLLOUT_POOL=<pool>``)
answer it from a queue group, with the same retry budget. The text reaches the trajectory only as the environment's
observation (tokenized by the driver like any env message, loss mask 0).

The request carries the episode's ids for the logs only (it is not stored): they are read from the log context the
driver binds for the episode (``episode_id``, ``batch_id``, ``attempt``), since ``EnvLLM.chat`` takes none.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.client import Client as NATS

from rollout_ledger.services.env_worker.inference_client import InferenceClient, InferenceClientConfig
from rollout_ledger.services.env_worker.stop_strings import cut_at_stop
from rollout_ledger.services.envs.base import Message
from rollout_ledger.shared.events import InferenceRequested, SamplingParams
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.subjects import POLICY_POOL

if TYPE_CHECKING:
    from rollout_ledger.services.env_worker.settings import EnvWorkerSettings

log = get_logger(__name__)

STICKY_EPISODES = 4096
"""Episodes whose last policy worker is remembered, so that their next request goes to the same worker."""


class ServedEnvLLM:
    """``EnvLLM`` over NATS: the policy's workers through ``client``, or a named model pool."""

    def __init__(self, client: InferenceClient, tokenizer: ChatTokenizer, *,
                 pool_tokenizers: Mapping[str, ChatTokenizer] | None = None, produced_by: str = "env-llm") -> None:
        self.client = client
        self.tokenizer = tokenizer
        """Renders and decodes for the policy's pool, and for any pool without its own entry."""
        self.pool_tokenizers = dict(pool_tokenizers or {})
        self.produced_by = produced_by
        self._run = uuid.uuid4().hex[:8]
        self._count = itertools.count()
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        """Episode id -> the policy worker that served its previous request (its prefix cache holds the user's
        conversation so far); the ``STICKY_EPISODES`` most recent episodes."""

    @classmethod
    def from_settings(cls, settings: EnvWorkerSettings, nc: NATS, tokenizer: ChatTokenizer) -> ServedEnvLLM:
        """The worker's env LLM: a client of its own (its own heartbeat registry and reply inbox, the worker's
        inference budgets), ``tokenizer`` for the policy's pool and ``tau2_user_model``'s for the tau2 user pool."""
        client = InferenceClient(nc, InferenceClientConfig(
            request_timeout_s=settings.inference_request_timeout_s, max_tries=settings.inference_max_tries,
            backoff_initial_s=settings.inference_backoff_s, backoff_max_s=settings.inference_backoff_max_s,
            heartbeat_timeout_s=settings.heartbeat_timeout_s))
        pools: dict[str, ChatTokenizer] = {}
        if settings.tau2_user_pool and settings.tau2_user_model:
            pools[settings.tau2_user_pool] = load_chat_tokenizer(settings.tau2_user_model)
        return cls(client, tokenizer, pool_tokenizers=pools, produced_by=f"env-worker/{settings.worker_id}")

    async def start(self) -> None:
        await self.client.start()

    async def stop(self) -> None:
        await self.client.stop()

    def tokenizer_of(self, pool: str) -> ChatTokenizer:
        return self.pool_tokenizers.get(pool, self.tokenizer)

    async def chat(self, messages: list[Message], *, pool: str = "", max_tokens: int = 256,
                   temperature: float = 1.0, stop: list[str] | None = None) -> str:
        """The assistant reply to ``messages`` from the pool ``pool`` (``""``: the policy's workers);
        ``InferenceError`` when no worker answered within the client's budget or one refused the request."""
        tok = self.tokenizer_of(pool)
        prompt = tok.encode(tok.render(messages, add_generation_prompt=True))
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=list(stop or []))
        labels = structlog.contextvars.get_contextvars()
        episode_id = str(labels.get("episode_id") or "env-llm")
        batch_id = str(labels.get("batch_id") or "env-llm")
        common: dict[str, Any] = {"episode_id": episode_id[:128], "batch_id": batch_id[:128],
                                  "attempt": max(1, _int(labels.get("attempt"))), "seq": 0,
                                  "produced_by": self.produced_by}
        base = f"{episode_id}:envllm:{self._run}.{next(self._count)}"

        def build(try_no: int) -> InferenceRequested:
            rid = f"{base}:r{try_no}"
            return InferenceRequested(event_id=rid, request_id=rid, turn_index=0, prompt_token_ids=prompt,
                                      sampling=sampling, max_tokens=max_tokens, reply_seq=0, record=False, **common)

        if pool in ("", POLICY_POOL):
            turn = await self.client.generate(build, prefer=self._last_worker.get(episode_id))
            self._last_worker[episode_id] = turn.worker_id
            self._last_worker.move_to_end(episode_id)
            if len(self._last_worker) > STICKY_EPISODES:
                self._last_worker.popitem(last=False)
        else:
            turn = await self.client.generate(build, pool=pool)
        text = tok.decode(turn.token_ids, skip_special_tokens=True)
        return cut_at_stop(text, sampling.stop)[0].strip()

def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1
