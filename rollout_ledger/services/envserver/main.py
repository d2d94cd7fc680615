"""Entry point of ``rollout envserver``: the built-in environments (or some of them) served over HTTP."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.envserver.actors import ActorTable
from rollout_ledger.services.envserver.app import create_app
from rollout_ledger.shared.kit.logging import configure_logging, get_logger

log = get_logger(__name__)


def serve(host: str, port: int, envs: list[str], state_dir: Path | None, idle_ttl_s: float = 3600.0,
          log_level: str = "INFO") -> None:
    """Serve until SIGTERM/SIGINT (uvicorn's own handling: a graceful stop)."""
    configure_logging(log_level, "auto", service="envserver")
    registry = builtin_registry()
    if envs:
        registry = registry.only(envs)
    if state_dir is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(ActorTable(registry, state_dir, idle_ttl_s))
    log.info("envserver.start", host=host, port=port, envs=registry.names(),
             state_dir=str(state_dir) if state_dir else None)
    uvicorn.run(app, host=host, port=port, log_level="warning", log_config=None, access_log=False)
