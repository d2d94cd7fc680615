"""The catalog of what this project runs: every service and job, how it starts, its settings class and image.

One list, read by everything that names services: ``rollout serve`` (which module to run), the local
supervisor (what ``rollout up`` starts and the order it drains them in), the configuration doc generator
(``python -m rollout_ledger.cli.configdoc``) and the deploy checks (``tests/deploy``: every manifest's command,
env and probes against this catalog). Ports, probe paths and images are the deployment contract of
``shared/deploy.py``. Modules are named by string and imported on demand: reading the catalog imports no service.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_ledger.shared.deploy import EXPORT_CONSUMER, EXPORTS_DIR, INFERENCE_IMAGE, SERVICE_IMAGE

if TYPE_CHECKING:
    from rollout_ledger.shared.kit.settings import BaseServiceSettings


@dataclass(frozen=True)
class Workload:
    """One process the project runs: how it is started and which environment it cannot do without."""

    name: str
    """Kubernetes object name (also the ``rollout serve`` name for services)."""
    args: tuple[str, ...]
    """Arguments of the images' entrypoint ``rollout`` (or of ``command`` when that is set)."""
    settings: str
    """``module:Class`` of the settings it reads (every env var given to it must be a field there)."""
    image: str
    required_env: frozenset[str]
    """Variables the manifests must set: their defaults only work on a developer's machine."""
    serves_http: bool = True
    command: tuple[str, ...] = ()
    """Replaces the image's entrypoint when not empty."""
    entry: str = ""
    """For a long-running service: the module whose ``main()`` ``rollout serve <name>`` runs."""

    @property
    def is_service(self) -> bool:
        """A long-running bus service (``rollout serve <name>``), started by the local stack."""
        return bool(self.entry)

    @property
    def uses_nats(self) -> bool:
        return "NATS_URL" in self.required_env

    @property
    def uses_database(self) -> bool:
        return "DATABASE_URL" in self.required_env

    def settings_class(self) -> type[BaseServiceSettings]:
        module, _, cls = self.settings.partition(":")
        settings_cls: type[BaseServiceSettings] = getattr(importlib.import_module(module), cls)
        return settings_cls


_BUS = frozenset({"NATS_URL", "ROLLOUT_STREAM_REPLICAS", "ROLLOUT_HTTP_PORT", "ROLLOUT_LOG_FORMAT"})
_PKG = "rollout_ledger.services"
_BASE_SETTINGS = "rollout_ledger.shared.kit.settings:BaseServiceSettings"

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        # services, in drain order: the API first, then env workers (their episodes still need inference), then
        # inference workers, then the recorder (so every event is recorded)
        Workload("scheduler", ("serve", "scheduler"), f"{_PKG}.scheduler.settings:SchedulerSettings",
                 SERVICE_IMAGE, _BUS | {"DATABASE_URL", "ROLLOUT_MODEL"}, entry=f"{_PKG}.scheduler.main"),
        Workload("env-worker", ("serve", "env-worker"), f"{_PKG}.env_worker.settings:EnvWorkerSettings",
                 SERVICE_IMAGE, _BUS | {"ROLLOUT_MODEL"}, entry=f"{_PKG}.env_worker.main"),
        Workload("inference-worker", ("serve", "inference-worker"),
                 f"{_PKG}.inference_worker.settings:InferenceSettings",
                 INFERENCE_IMAGE, _BUS | {"ROLLOUT_MODEL", "ROLLOUT_ENGINE"}, entry=f"{_PKG}.inference_worker.main"),
        Workload("recorder", ("serve", "recorder"), f"{_PKG}.recorder.settings:RecorderSettings",
                 SERVICE_IMAGE, _BUS | {"DATABASE_URL"}, entry=f"{_PKG}.recorder.main"),
        # jobs and the exporter (CLI commands in the same image)
        Workload("migrate", ("db", "upgrade", "--stop-at-expand"), _BASE_SETTINGS, SERVICE_IMAGE,
                 frozenset({"DATABASE_URL"}), serves_http=False),
        # after the migrations: a login per service (its own DSN's user and password) in its role (migration 0012)
        Workload("db-logins", ("db", "create-logins"), "rollout_ledger.migrations.logins:LoginSettings",
                 SERVICE_IMAGE, frozenset({"DATABASE_URL", "ROLLOUT_SCHEDULER_DATABASE_URL",
                                           "ROLLOUT_RECORDER_DATABASE_URL", "ROLLOUT_EXPORTER_DATABASE_URL"}),
                 serves_http=False),
        Workload("exporter", ("export", "--consumer", EXPORT_CONSUMER, "--follow", "--format", "openrlhf",
                              "--file-type", "parquet", "--out", f"{EXPORTS_DIR}/{EXPORT_CONSUMER}"),
                 f"{_PKG}.exporter.settings:ExporterSettings", SERVICE_IMAGE,
                 frozenset({"DATABASE_URL", "ROLLOUT_HTTP_PORT"})),
        Workload("export-batches", ("/etc/rollout/export_finished.py", EXPORTS_DIR, "parquet"),
                 _BASE_SETTINGS, SERVICE_IMAGE, frozenset({"DATABASE_URL"}), serves_http=False, command=("python",)),
        Workload("feed-prune", ("feed", "prune"), f"{_PKG}.exporter.settings:ExporterSettings",
                 SERVICE_IMAGE, frozenset({"DATABASE_URL"}), serves_http=False),
    )
}
"""Every process the project runs (and the manifests deploy), by object name."""

SERVICES: tuple[str, ...] = tuple(name for name, w in WORKLOADS.items() if w.is_service)
"""The long-running bus services, in the order a stack drains them."""


def service(name: str) -> Workload:
    """The service called ``name``; ``KeyError`` naming the known ones otherwise."""
    workload = WORKLOADS.get(name)
    if workload is None or not workload.is_service:
        raise KeyError(f"unknown service {name!r}; known: {', '.join(SERVICES)}")
    return workload


def settings_classes() -> dict[str, type[BaseServiceSettings]]:
    """Each distinct settings class beside the first workload that reads it (the base class left out)."""
    out: dict[str, type[BaseServiceSettings]] = {}
    seen: set[str] = set()
    for name, workload in WORKLOADS.items():
        if workload.settings == _BASE_SETTINGS or workload.settings in seen:
            continue
        seen.add(workload.settings)
        out[name] = workload.settings_class()
    return out
