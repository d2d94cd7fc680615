"""``VllmEngine``: the ``Engine`` protocol on vLLM V1's ``AsyncLLM`` (the only module of the project that imports vllm,
with ``vllm_extension``, which vLLM imports in its own worker processes).

Design note.

- One ``AsyncLLM`` per worker process. Its engine core runs in a child process (vLLM V1 always does this for
  ``AsyncLLM``); this process tokenises nothing (prompts arrive as ids), sends requests over ZMQ and turns
  outputs into ``Generation``. ``start`` builds the engine in a worker thread so the event loop (and with it
  ``/healthz``) keeps running during the 5-30 s load; vLLM starts its output-handler task lazily on the first
  request, in the loop that makes it. All later calls must come from that one loop.
- Continuous batching: every ``generate`` call awaits its own ``AsyncLLM.generate`` async generator; nothing is
  serialised here, the engine core batches whatever is in flight. Outputs are ``FINAL_ONLY``.
- Logprobs: vLLM is always asked for ``max(1, sampling.logprobs)`` alternatives; it then returns, per position, a
  dict ``{token_id: Logprob}`` holding the sampled id (whatever its rank) and the top-k. The sampled id's logprob
  is read from that dict by id, never by rank. What the numbers mean (before or after temperature/top-k/top-p)
  is ``vllm_logprobs_mode``.
- Abort and timeout: ``abort(request_id)`` makes vLLM finish the request with reason ``abort`` and the ids it had;
  a request running past ``request_timeout_s`` is cancelled (vLLM aborts it) and fails as a retryable
  ``InferenceError``.
- Errors are classified by vLLM's exception types, never by message: a request vLLM rejects (prompt longer than
  the context, bad parameters) is not retryable; an engine that died (``EngineDeadError``) or a failed generate
  is retryable on another worker, and a dead engine fails every later request at once (``healthy`` turns false).
- A forced tool call (``SamplingParams.tool_call``) is vLLM's structured outputs with the EBNF grammar
  ``tool_call_grammar``: exactly one hermes call of an allowed name, laid out as the tool template renders one
  (``<tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>``, ``json.dumps``'s separators, no other
  whitespace), the arguments under the tool's parameter schema (any JSON object for a tool without one, or with a
  schema xgrammar cannot convert), after which only an end-of-turn id is allowed. The grammar is built with xgrammar
  (vLLM's structured-outputs backend, installed with vLLM). The ids are the ones sampled, returned verbatim.
- Weight reloads go through the worker extension (``vllm_extension.RolloutWorkerExtension``, named in the engine
  arguments as ``worker_extension_cls``): vLLM's ``reload_weights`` and then the re-processing of layers tied to a
  reloaded parameter (SmolLM2's lm_head, packed from the embedding on CPU).
- CPU: when vLLM runs on CPU and the variables are not set already, ``VLLM_CPU_KVCACHE_SPACE`` comes from
  settings and, on machines with at most 4 CPUs, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (vLLM otherwise keeps one
  core of two idle for its scheduler). Chunked prefill is off on CPU unless a setting turns it on: vllm-cpu
  kills its engine core when a request with a per-request seed is mid-way through a chunked prefill.
  Nothing here is CPU-only: on GPU nodes the ordinary ``vllm`` package runs
  the same code.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import vllm
import xgrammar as xgr
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError

from rollout_ledger.services.inference_worker.checkpoints import check_compatible
from rollout_ledger.services.inference_worker.engine import Generation
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.shared.errors import InferenceError
from rollout_ledger.shared.events import FinishReason, SamplingParams, ToolCallConstraint
from rollout_ledger.shared.kit.logging import get_logger

try:  # vLLM >= 0.11 names request errors; older versions raise ValueError for them
    from vllm.exceptions import VLLMClientError as _ClientError
except ImportError:  # pragma: no cover - depends on the installed vllm
    _ClientError = ValueError  # type: ignore[assignment,misc,unused-ignore]

log = get_logger(__name__)

FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}
"""vLLM's ``CompletionOutput.finish_reason`` strings we know; any other (``error``, ...) is a failed request."""

WARMUP_PROMPT_LENS = (16, 384)
"""Prompt lengths of the warm-up requests: the first request at a new length is slow (3-6 s on CPU)."""

ABORT_GRACE_S = 2.0
"""After ``abort``, how long vLLM may take to finish the request before its task is cancelled."""

SMALL_MACHINE_CPUS = 4
"""At most this many CPUs: no core is reserved for vLLM's scheduler process."""

WORKER_EXTENSION = "rollout_ledger.services.inference_worker.vllm_extension.RolloutWorkerExtension"
"""Mixed into vLLM's worker class: ``collective_rpc("rl_reload_weights", ...)`` (``vllm_extension.py``)."""


def cpu_env_defaults(settings: InferenceSettings, cpu_count: int) -> dict[str, str]:
    """vLLM CPU variables to set (only those the environment does not set already)."""
    wanted = {"VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_cpu_kvcache_gib)}
    if cpu_count <= SMALL_MACHINE_CPUS:
        wanted["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return {k: v for k, v in wanted.items() if k not in os.environ}


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU feature flags (``/proc/cpuinfo``; x86 ``flags``, Arm ``Features``) of native bf16 arithmetic."""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags ``/proc/cpuinfo`` lists (empty when it lists none)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def resolve_dtype(requested: str, on_cpu: bool, cpuinfo: str | None) -> str:
    """The dtype to load: ``auto`` on a CPU without native bf16 (no AVX512-BF16/AMX/Arm BF16) is ``float32``
    (bf16 is emulated there: SmolLM2's demo ran at 14 tokens/s in bf16 and 59 in float32 on a 2-core EPYC); any
    other request, a GPU, or an unreadable ``/proc/cpuinfo`` keeps ``requested``."""
    if requested != "auto" or not on_cpu or not cpuinfo:
        return requested
    flags = cpu_flags(cpuinfo)
    if not flags or flags & NATIVE_BF16_FLAGS:
        return requested
    return "float32"


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def engine_kwargs(settings: InferenceSettings, on_cpu: bool, cpuinfo: str | None = None) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments from the worker's settings (``cpuinfo``: ``/proc/cpuinfo``'s text,
    read when not given)."""
    if on_cpu and cpuinfo is None:
        cpuinfo = _cpuinfo()
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": resolve_dtype(settings.vllm_dtype, on_cpu, cpuinfo),
        "max_model_len": settings.vllm_max_model_len,
        "gpu_memory_utilization": settings.vllm_gpu_memory_utilization,
        "tensor_parallel_size": settings.vllm_tensor_parallel_size,
        "enable_prefix_caching": settings.vllm_enable_prefix_caching,
        "enforce_eager": on_cpu if settings.vllm_enforce_eager is None else settings.vllm_enforce_eager,
        "seed": settings.vllm_seed,
        "logprobs_mode": settings.vllm_logprobs_mode,
        "max_logprobs": 20,
        "disable_log_stats": True,
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if settings.vllm_max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.vllm_max_num_seqs
    chunked = settings.vllm_enable_chunked_prefill
    if chunked is None and on_cpu:
        chunked = False
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
    return kwargs


CALL_SEPARATORS = (", ", ": ")
"""``json.dumps``'s separators: the forced call is laid out as the tool template renders one (no other whitespace)."""


def _call_grammar(name: str, parameters: dict[str, Any] | None) -> xgr.Grammar:
    """``{"name": NAME, "arguments": ...}`` with the arguments under ``parameters`` (any JSON object when None or a
    schema xgrammar cannot convert)."""
    def call(arguments: dict[str, Any]) -> xgr.Grammar:
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                  "required": ["name", "arguments"]}
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=CALL_SEPARATORS)

    if parameters:
        try:
            return call(parameters)
        except (RuntimeError, ValueError, TypeError) as exc:  # a schema feature xgrammar does not support
            log.warning("vllm.tool_schema_unsupported", tool=name, error=str(exc)[:200])
    return call({"type": "object"})


@lru_cache(maxsize=256)
def _tool_call_ebnf(spec: str) -> str:
    names, parameters = json.loads(spec)
    calls = [_call_grammar(name, parameters.get(name)) for name in dict.fromkeys(names)]
    grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), xgr.Grammar.union(*calls),
                                 xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
    return str(grammar)


def tool_call_grammar(constraint: ToolCallConstraint) -> str:
    """The EBNF grammar of a turn that is exactly one hermes call of an allowed name, its arguments under the
    tool's parameter schema (built with xgrammar, vLLM's structured-outputs backend; kept per constraint)."""
    return _tool_call_ebnf(json.dumps([constraint.names, constraint.parameters], sort_keys=True))


def sampling_params(sampling: SamplingParams, max_tokens: int) -> vllm.SamplingParams:
    """vLLM sampling parameters for one turn (final output only; the sampled id's logprob always returned).

    Stop strings: vLLM detokenises after every id and stops after the id whose text completes a stop string (the
    one ending first). Its ``token_ids`` run through that id, without an end-of-turn id, and are returned verbatim;
    its text (cut before the stop string) is not used: whoever shows the turn as text cuts the decoded ids the same
    way (the session endpoint's ``mapping.cut_at_stop``), so the fake engine, which stops alike, gives the same
    text. A forced tool call is the grammar ``tool_call_grammar`` (structured outputs).
    """
    forced = sampling.tool_call
    structured = StructuredOutputsParams(grammar=tool_call_grammar(forced)) if forced is not None else None
    return vllm.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=max_tokens,
        min_tokens=min(sampling.min_tokens, max_tokens),
        stop=list(sampling.stop) or None,
        seed=sampling.seed,
        logprobs=max(1, sampling.logprobs),
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=bool(sampling.stop),  # text is only needed to match stop strings
        structured_outputs=structured,
    )


def finish_reason(reason: str | None, request_id: str) -> FinishReason:
    """Our finish reason for vLLM's; an unknown or missing one fails the request (retryable)."""
    mapped = FINISH_REASONS.get(reason or "")
    if mapped is None:
        raise InferenceError(f"vLLM finished request {request_id} with reason {reason!r}", retryable=True)
    return mapped


def generation_from_output(
    token_ids: Sequence[int],
    position_logprobs: Sequence[Mapping[int, Any] | None] | None,
    reason: str | None,
    *,
    top_k: int,
    cached_tokens: int | None,
    request_id: str,
) -> Generation:
    """A ``Generation`` from vLLM's ``CompletionOutput`` fields (``position_logprobs`` as vLLM returns them)."""
    ids = np.asarray(token_ids, dtype=np.int32)
    n = int(ids.shape[0])
    positions = list(position_logprobs) if position_logprobs is not None else []
    if len(positions) != n:
        raise InferenceError(
            f"vLLM returned {len(positions)} logprob positions for {n} ids (request {request_id})", retryable=True
        )
    logprobs = np.empty(n, dtype=np.float32)
    top: list[dict[int, float]] | None = [] if top_k > 0 else None
    for i, (tid, alternatives) in enumerate(zip(ids.tolist(), positions, strict=True)):
        entry = alternatives.get(tid) if alternatives is not None else None
        if entry is None:
            raise InferenceError(f"vLLM returned no logprob for sampled id {tid} at position {i} "
                                 f"(request {request_id})", retryable=True)
        logprobs[i] = entry.logprob
        if top is not None and alternatives is not None:
            top.append({int(k): float(v.logprob) for k, v in alternatives.items()})
    return Generation(
        token_ids=ids,
        logprobs=logprobs,
        finish_reason=finish_reason(reason, request_id),
        top_logprobs=top,
        cached_tokens=cached_tokens,
    )


class VllmEngine:
    """The ``Engine`` protocol on one vLLM ``AsyncLLM`` (see the module docstring)."""

    name = "vllm"
    supports_keep = True
    """An aborted request returns the ids it had sampled: a swap in mode ``keep`` continues it from prompt + those
    ids on the new weights (abort and re-submit, as AReaL and PipelineRL do; the kept ids are prefilled again, so
    no KV block of the old weights is reused)."""

    def __init__(self, settings: InferenceSettings) -> None:
        self.settings = settings
        self.request_timeout_s = settings.request_timeout_s
        """A request running longer is aborted and fails (retryable)."""
        self.llm: Any = None
        """The ``vllm.AsyncLLMEngine`` once started (tests and benchmarks may drive it directly)."""
        self.start_s: float | None = None
        """Seconds ``start`` took (build plus warm-up)."""
        self._requests: dict[str, asyncio.Task[Any]] = {}
        self._dead: BaseException | None = None

    @property
    def healthy(self) -> bool:
        """Started and the engine core has not died."""
        return self.llm is not None and self._dead is None and not self.llm.errored

    @property
    def inflight(self) -> frozenset[str]:
        """Request ids being generated now."""
        return frozenset(self._requests)

    def engine_args(self) -> vllm.AsyncEngineArgs:
        """vLLM engine arguments from settings (setting the CPU variables first when on CPU)."""
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            defaults = cpu_env_defaults(self.settings, cpus)
            os.environ.update(defaults)
            if defaults:
                log.info("vllm.cpu_env", **defaults)
        return vllm.AsyncEngineArgs(**engine_kwargs(self.settings, on_cpu))

    async def start(self) -> None:
        """Build the engine (in a thread, so the loop keeps serving health checks) and warm it up."""
        if self.llm is not None:
            return
        began = time.perf_counter()
        args = self.engine_args()
        try:
            self.llm = await asyncio.to_thread(vllm.AsyncLLMEngine.from_engine_args, args)
        except Exception as exc:  # vLLM raises many types while loading; none of them is retryable here
            raise InferenceError(f"vLLM could not load {self.settings.model}: {type(exc).__name__}: {exc}",
                                 retryable=False) from exc
        built = time.perf_counter()
        await self._warm_up()
        self.start_s = time.perf_counter() - began
        log.info("vllm.started", model=self.settings.model, build_s=round(built - began, 2),
                 warmup_s=round(self.start_s - (built - began), 2), device=current_platform.device_type)

    async def _warm_up(self) -> None:
        """One short greedy generation per ``WARMUP_PROMPT_LENS`` (then forget their cached prefixes)."""
        greedy = SamplingParams.model_validate({"temperature": 0.0, "max_tokens": 4})
        limit = self.llm.model_config.max_model_len - greedy.max_tokens
        for n in WARMUP_PROMPT_LENS:
            n = min(n, limit)
            prompt = np.arange(100, 100 + n, dtype=np.int32)
            began = time.perf_counter()
            await self.generate(f"warmup-{n}", prompt, greedy, greedy.max_tokens)
            log.info("vllm.warmup", prompt_len=n, seconds=round(time.perf_counter() - began, 2))
        if self.settings.vllm_enable_prefix_caching:
            await self.llm.reset_prefix_cache()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray,
        sampling: SamplingParams,
        max_tokens: int,
        *,
        session_key: str | None = None,
    ) -> Generation:
        """One turn through vLLM (``session_key`` is not needed: vLLM's prefix cache finds shared prefixes)."""
        llm = self.llm
        if llm is None:
            raise InferenceError("the vLLM engine is not started", retryable=True)
        if self._dead is not None or llm.errored:
            raise InferenceError(f"the vLLM engine is dead: {self._dead or llm.dead_error}", retryable=True)
        if request_id in self._requests:
            raise InferenceError(f"request {request_id} is already in flight", retryable=False)
        prompt = TokensPrompt(prompt_token_ids=np.asarray(prompt_token_ids, dtype=np.int64).tolist())
        params = sampling_params(sampling, max_tokens)
        # The request runs in a task of its own so that ``abort`` can always end it (see ``abort``).
        task = asyncio.create_task(self._final_output(llm, prompt, params, request_id), name=f"vllm:{request_id}")
        self._requests[request_id] = task
        try:
            async with asyncio.timeout(self.request_timeout_s):
                final = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if (current is not None and current.cancelling()) or not task.cancelled():
                raise
            # ``abort`` cancelled a request vLLM had not admitted yet: it ends like any aborted request
            empty = np.zeros(0, dtype=np.int32)
            return Generation(empty, np.zeros(0, dtype=np.float32), FinishReason.ABORT)
        except TimeoutError as exc:
            raise InferenceError(f"request {request_id} ran past {self.request_timeout_s}s and was aborted",
                                 retryable=True) from exc
        except EngineDeadError as exc:
            self._dead = exc
            log.error("vllm.engine_dead", request_id=request_id)
            raise InferenceError(f"the vLLM engine died: {exc}", retryable=True) from exc
        except (_ClientError, ValueError, TypeError) as exc:
            raise InferenceError(f"vLLM rejected request {request_id}: {exc}", retryable=False) from exc
        except Exception as exc:  # EngineGenerateError and anything unforeseen: another try may succeed
            raise InferenceError(f"vLLM failed request {request_id}: {type(exc).__name__}: {exc}",
                                 retryable=True) from exc
        finally:
            self._requests.pop(request_id, None)
        if final is None or not final.outputs:
            raise InferenceError(f"vLLM returned no output for request {request_id}", retryable=True)
        completion = final.outputs[0]
        return generation_from_output(
            completion.token_ids, completion.logprobs, completion.finish_reason,
            top_k=sampling.logprobs, cached_tokens=final.num_cached_tokens, request_id=request_id,
        )

    @staticmethod
    async def _final_output(llm: Any, prompt: TokensPrompt, params: vllm.SamplingParams, request_id: str) -> Any:
        final = None
        async for output in llm.generate(prompt, params, request_id):
            final = output
        return final

    async def load_weights(self, checkpoint: str) -> None:
        """vLLM's RLHF path: every worker of the engine reloads the checkpoint's safetensors into the running model
        in place (``collective_rpc("rl_reload_weights")``, the worker extension: vLLM's ``reload_weights``, the
        model's own ``load_weights``, then the layers tied to a reloaded parameter are processed again; the same
        code on ``vllm`` and ``vllm-cpu``), then the prefix cache is reset. The checkpoint is checked first
        (``checkpoints.check_compatible``); a failure after that leaves the engine unhealthy (half-loaded)."""
        check_compatible(self.settings.model, checkpoint)
        if self.llm is None:
            raise InferenceError("the vLLM engine is not started", retryable=False)
        try:
            results = await self.llm.collective_rpc("rl_reload_weights", kwargs={"weights_path": checkpoint})
            await self.llm.reset_prefix_cache()
        except Exception as exc:  # vLLM raises many types; the model may now be half-loaded
            self._dead = exc
            raise InferenceError(f"vLLM failed loading {checkpoint}: {type(exc).__name__}: {exc}",
                                 retryable=False) from exc
        first = results[0] if results else {}
        log.info("vllm.weights_loaded", checkpoint=checkpoint, reprocessed=first.get("reprocessed"),
                 skipped=first.get("skipped"))

    async def abort(self, request_id: str) -> None:
        """End the request now with reason ``abort`` and the ids it had (no-op when unknown or done).

        vLLM's ``abort`` ignores an id it has not admitted yet; when the request is still running after
        ``ABORT_GRACE_S`` its task is cancelled instead, which makes vLLM drop it.
        """
        task = self._requests.get(request_id)
        if task is None or task.done() or self.llm is None:
            return
        await self.llm.abort(request_id)
        _, pending = await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        if pending:
            task.cancel()

    async def stop(self) -> None:
        """Abort what is still in flight and shut the engine (and its core process) down."""
        llm = self.llm
        if llm is None:
            return
        if self._requests:
            await asyncio.gather(*(self.abort(rid) for rid in list(self._requests)), return_exceptions=True)
        self.llm = None
        await asyncio.to_thread(llm.shutdown)
        log.info("vllm.stopped")
