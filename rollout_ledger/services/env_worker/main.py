"""Entry point of ``rollout serve env-worker``: settings, logging, ops HTTP server, NATS, the worker loop."""

from __future__ import annotations

import os
from pathlib import Path

from rollout_ledger.services.env_worker.agents.agent_runtime import AgentRuntime
from rollout_ledger.services.env_worker.env_llm import ServedEnvLLM
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.env_worker.tokenization import TurnTemplate
from rollout_ledger.services.env_worker.worker import EnvWorker
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envs.library import library_specs
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.services.envs.remote import RemoteEnvs
from rollout_ledger.shared.kit.chat import ChatTokenizer, ModelNotFoundError, load_chat_tokenizer
from rollout_ledger.shared.kit.logging import get_logger
from rollout_ledger.shared.kit.runtime import Health, Shutdown
from rollout_ledger.shared.kit.service import ServiceScope, run_main

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
    async with ServiceScope(SERVICE, settings, health, metrics.registry) as scope:
        remote = RemoteEnvs.build(settings.remote_endpoints(), settings.remote_config(),
                                  on_retry=metrics.remote_env_retries.inc)
        scope.on_close(remote.aclose)
        envs = build_envs(settings, remote)
        template = TurnTemplate(policy_tokenizer(settings))
        agents = await AgentRuntime.start(settings)
        if agents is not None:
            scope.on_close(agents.stop)
        nc = await scope.connect(topology=False)  # the worker declares its topology and consumers itself
        env_llm = ServedEnvLLM.from_settings(settings, nc, template.tokenizer)  # a simulated user's LLM (tau2 envs)
        await env_llm.start()
        scope.on_close(env_llm.stop)
        await EnvWorker(settings, nc, envs, template, metrics, health, agents=agents, env_llm=env_llm,
                        tracing=scope.tracing).run(shutdown)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(SERVICE, EnvWorkerSettings, run)
