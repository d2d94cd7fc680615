"""The engine interface the inference worker drives, shaped after vLLM V1's ``AsyncLLM``.

vLLM's ``AsyncLLM.generate(prompt, sampling_params, request_id)`` is an async generator of ``RequestOutput``;
``abort(request_id)`` cancels a request and ``shutdown()`` stops the engine. An ``Engine`` here is the same
surface with the worker's needs made explicit: one awaitable call per turn that returns the final output only
(vLLM's ``RequestOutputKind.FINAL_ONLY``), token ids in and numpy arrays out, and errors raised as
``InferenceError`` with ``retryable`` set. Many requests are in flight at once: implementations must not
serialise ``generate`` behind a global lock (vLLM batches them continuously).

Implementations: ``fake_engine.FakeEngine`` (tests and benchmarks) and ``vllm_engine`` (the only module that
may import vllm; built lazily by ``engines.build_engine`` so that the fake never needs vllm installed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from rollout_ledger.shared.events import FinishReason, SamplingParams


@dataclass(frozen=True, slots=True)
class Generation:
    """The final output of one request (vLLM: ``RequestOutput.outputs[0]`` plus ``num_cached_tokens``)."""

    token_ids: np.ndarray
    """Sampled ids, int32, in order (the eos id included when the turn ended on it, as vLLM returns it)."""
    logprobs: np.ndarray
    """Logprob of each sampled id under the engine's policy, float32, same length as ``token_ids``."""
    finish_reason: FinishReason
    """``stop`` (eos or a stop string), ``length`` (``max_tokens`` or the context limit), ``abort``."""
    top_logprobs: list[dict[int, float]] | None = None
    """Per position, the top ``sampling.logprobs`` alternatives (id -> logprob); None when not asked for."""
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache (vLLM: ``num_cached_tokens``); None when not known."""


@runtime_checkable
class Engine(Protocol):
    """What the inference worker needs from an inference engine."""

    name: str
    """Short engine name stamped on every turn (``fake``, ``vllm``)."""

    async def start(self) -> None:
        """Load the model and warm it up; the worker reports ready only after this returns."""
        ...

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray,
        sampling: SamplingParams,
        max_tokens: int,
        *,
        session_key: str | None = None,
    ) -> Generation:
        """Sample one turn of at most ``max_tokens`` ids after ``prompt_token_ids``.

        ``request_id`` is unique among in-flight requests (``abort`` names it). ``session_key`` groups the
        requests of one conversation (the worker passes the episode id); an engine may use it for prefix-cache
        accounting or routing and may ignore it. An aborted request returns with ``finish_reason`` ``abort``
        and whatever ids it had. Failures raise ``InferenceError`` (``retryable`` says whether another try,
        possibly on another worker, can succeed).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel an in-flight request (no-op when it is unknown or already done)."""
        ...

    supports_keep: bool
    """Whether the engine can pause generations mid-way and continue them on new weights (swap mode ``keep``)."""

    async def load_weights(self, checkpoint: str) -> None:
        """Replace the running model's weights with ``checkpoint``'s, in place, and drop every cached KV block
        (the prefix cache), so nothing computed with the old weights is reused.

        The caller has stopped or aborted the generations in flight. ``checkpoints.WeightsRefused`` means
        nothing changed (another architecture or tokenizer, unreadable weights): the old weights still serve.
        Any other exception means the model may be half-loaded: the engine must report itself unhealthy.
        """
        ...

    @property
    def healthy(self) -> bool:
        """False once the engine can serve no more requests (its engine process died): the worker then reports
        not ready and exits, so that its supervisor restarts it while requesters fail over to other workers."""
        ...

    async def stop(self) -> None:
        """Release the engine (after in-flight requests have finished or been aborted)."""
        ...
