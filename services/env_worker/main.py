"""Entry point of ``rollout serve env-worker``: settings, logging, ops HTTP server, NATS, the worker loop."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rollout_ledger.services.env_worker.agents.runtime import AgentRuntime
from rollout_ledger.services.env_worker.env_llm import ServedEnvLLM
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.env_worker.worker import EnvWorker
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envs.library import library_specs
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.services.envs.remote import RemoteEnvs
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer, ModelNotFoundError, load_chat_tokenizer
from rollout_ledger.shared.kit.logging import configure_logging, get_logger
from rollout_ledger.shared.kit.runtime import Health, HttpServer, Shutdown, ops_app
from rollout_ledger.shared.kit.tracing import setup_tracing

log = get_logger(__name__)

SERVICE = "env-worker"


def build_envs(settings: EnvWorkerSettings, remote: RemoteEnvs | None = None) -> EnvRegistry:
    """The built-ins, the remote envs (``remote:<name>``) and the library and user envs (envs/library.py),
    restricted to ``settings.envs`` when it names some."""
    envs = builtin_registry()
    for spec in [*(remote.specs() if remote is not None else []), *library_specs(settings)]:
        envs.register(spec)
    names = settings.env_names()
    return envs.only(names) if names else envs


def policy_tokenizer(settings: EnvWorkerSettings) -> ChatTokenizer:
    """The policy's tokenizer with its chat template, or the template file ``settings.chat_template``."""
    if not settings.chat_template:
        return load_chat_tokenizer(settings.model)
    try:
        source = Path(settings.chat_template).read_text()
    except OSError as exc:
        raise ModelNotFoundError(f"ROLLOUT_CHAT_TEMPLATE: cannot read {settings.chat_template}: {exc}") from exc
    return ChatTokenizer(settings.model, chat_template=source)


async def run(settings: EnvWorkerSettings, shutdown: Shutdown) -> None:
    """Serve until ``shutdown`` is set, then drain in-flight episodes and return."""
    metrics = build_metrics()
    health = Health()
    http = HttpServer(ops_app(SERVICE, health, metrics.registry), settings.http_host, settings.http_port)
    await http.start()
    remote = RemoteEnvs.build(settings.remote_endpoints(), settings.remote_config(),
                              on_retry=metrics.remote_env_retries.inc)
    envs = build_envs(settings, remote)
    template = TurnTemplate(policy_tokenizer(settings))
    agents = await AgentRuntime.start(settings)
    nc = await bus.connect(settings.nats_url, name=f"{SERVICE}-{settings.worker_id}",
                           connect_timeout_s=settings.nats_connect_timeout_s)
    env_llm = ServedEnvLLM.from_settings(settings, nc, template.tokenizer)  # a simulated user's LLM (tau2 envs)
    await env_llm.start()
    tracing = setup_tracing(settings, SERVICE)  # off unless a collector is configured (ROLLOUT_TRACING_ENDPOINT)
    try:
        await EnvWorker(settings, nc, envs, template, metrics, health, agents=agents, env_llm=env_llm,
                        tracing=tracing).run(shutdown)
    finally:
        await env_llm.stop()
        await bus.close(nc)
        await asyncio.to_thread(tracing.shutdown)  # exports the spans still buffered
        if agents is not None:
            await agents.stop()
        await remote.aclose()
        await http.stop()
    log.info("env_worker.stopped")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = EnvWorkerSettings()
    configure_logging(settings.log_level, settings.log_format, service=SERVICE)

    async def _main() -> None:
        shutdown = Shutdown()
        shutdown.install()
        await run(settings, shutdown)

    asyncio.run(_main())
