"""Which engine an inference worker runs: the factory over the ``Engine`` implementations (fake, vLLM)."""

from __future__ import annotations

from rollout_ledger.services.inference_worker.engine import Engine
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.shared.errors import InferenceError


def build_engine(settings: InferenceSettings) -> Engine:
    """The engine named by ``settings.engine``; vllm is imported only when it is asked for."""
    if settings.engine == "fake":
        from rollout_ledger.services.inference_worker.fake_engine import FakeEngine

        return FakeEngine(
            settings.model,
            delay_s=settings.fake_delay_s,
            delay_jitter_s=settings.fake_delay_jitter_s,
            tokens_per_s=settings.fake_tokens_per_s,
            load_s=settings.fake_load_s,
        )
    if settings.engine == "vllm":
        try:
            from rollout_ledger.services.inference_worker import vllm_engine  # type: ignore[attr-defined,unused-ignore]
        except ImportError as exc:
            raise InferenceError(f"the vllm engine is not available here: {exc}", retryable=False) from exc
        engine: Engine = vllm_engine.VllmEngine(settings)
        return engine
    raise InferenceError(f"unknown engine {settings.engine!r} (known: fake, vllm)", retryable=False)
