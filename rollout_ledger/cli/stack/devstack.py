"""The whole system on one machine: private (or given) NATS and Postgres, migrations, and every service process.

`rollout up` keeps it running until Ctrl-C; `rollout demo` and the benchmarks use it for one run.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from rollout_ledger.cli.client import forget_local_stack, local_stack_file, save_local_stack
from rollout_ledger.cli.modelstore import fetch, is_complete
from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.migrations.runner import upgrade
from rollout_ledger.shared import nats_auth
from rollout_ledger.shared.kit.settings import default_model_dir

ENGINE_HINTS = {
    "vllm": "SmolLM2-135M-Instruct on vLLM (the engine loads in 30-60 s on a CPU; ROLLOUT_ENGINE=fake for the "
            "zero-cost scripted fake)",
    "fake": "the zero-cost scripted fake: real SmolLM2 token ids, NOT a model's answers (ROLLOUT_ENGINE=vllm "
            "for the real model)",
}
"""What each engine means, in the line ``rollout up`` and ``rollout demo`` print first."""


def resolve_engine(requested: str) -> str:
    """``auto``: vLLM when it is installed here and the model's weights are in the cache (what ``make up`` and
    ``make demo`` install), else the fake; ``vllm`` / ``fake`` as given."""
    if requested != "auto":
        return requested
    model = os.environ.get("ROLLOUT_MODEL") or str(default_model_dir())
    if importlib.util.find_spec("vllm") is not None and is_complete(Path(model), True):
        return "vllm"
    return "fake"


class DevStack:
    """Infrastructure plus ``inference_workers`` + ``env_workers`` + recorder + scheduler processes.

    A private NATS server runs with authorization: each service connects as its own user of shared/nats_auth.py
    with a password generated for this run. ``nats_cluster=3`` runs three clustered nodes instead
    (``PrivateNatsCluster`` in servers.py): ``NATS_URL`` lists them and the services keep streams and buckets at 3
    replicas."""

    def __init__(self, scheduler_port: int | None = 8000, env_workers: int = 1, inference_workers: int = 1,
                 engine: str = "fake", echo: Callable[[str], None] = print, extra_env: dict[str, str] | None = None,
                 recorders: int = 1, schedulers: int = 1, nats_cluster: int = 1) -> None:
        self.scheduler_port = scheduler_port
        self.schedulers_count = schedulers
        self.env_workers = env_workers
        self.inference_workers = inference_workers
        self.recorders = recorders
        self.engine = engine
        self.echo = echo
        self.extra_env = dict(extra_env or {})
        self.infra = LocalInfra(nats_auth=True, nats_cluster=nats_cluster)
        self.stack: Stack | None = None
        self.scheduler: ServiceProcess | None = None
        """The first scheduler (on ``scheduler_port``); ``schedulers`` lists every one."""
        self.schedulers: list[ServiceProcess] = []

    def _model(self) -> str:
        given = os.environ.get("ROLLOUT_MODEL")
        if given:
            return given
        out = default_model_dir()
        need_weights = self.engine == "vllm"
        if not is_complete(out, need_weights):
            self.echo(f"fetching the model into {out} (once) ...")
        return str(fetch(out, with_weights=need_weights))

    def start(self) -> DevStack:
        self.infra.start()
        try:
            if self.infra.nats is not None or self.infra.postgres is not None:
                self.echo(f"private infrastructure in {self.infra.root}")
            upgrade(self.infra.database_url)
            env = {"ROLLOUT_MODEL": self._model(), "ROLLOUT_ENGINE": self.engine, **self.extra_env}
            if self.infra.stream_replicas is not None:  # the private NATS: 3 replicas on a cluster
                env.setdefault("ROLLOUT_STREAM_REPLICAS", str(self.infra.stream_replicas))
            # SmolLM2's own context (tau2's prompts are ~5.2k tokens); the env worker's default is 2048
            env.setdefault("ROLLOUT_MAX_MODEL_LEN", os.environ.get("ROLLOUT_MAX_MODEL_LEN", "8192"))
            logins = self.infra.create_database_logins()  # each service on its own Postgres role (0012)
            service_env = {s: self.infra.nats_env(s) for s in nats_auth.USERS}
            for service, url in logins.items():
                service_env.setdefault(service, {})["DATABASE_URL"] = url
            self.stack = Stack(self.infra.nats_url, self.infra.database_url, self.infra.root / "logs", env=env,
                               service_env=service_env)
            procs = [self.stack.start("inference-worker", name=f"inference-worker-{i}", wait=False)
                     for i in range(self.inference_workers)]
            procs += [self.stack.start("env-worker", name=f"env-worker-{i}", wait=False)
                      for i in range(self.env_workers)]
            procs += [self.stack.start("recorder", name=f"recorder-{i}", wait=False) for i in range(self.recorders)]
            for proc in procs:
                proc.wait_ready(timeout_s=600 if self.engine == "vllm" else 60)
            # The schedulers last: env workers have registered their environments by now. Replicas after the
            # first listen on free ports and share everything else (docs/deploy.md, "Replicas").
            self.scheduler = self.stack.start("scheduler", port=self.scheduler_port)
            self.schedulers = [self.scheduler] + [
                self.stack.start("scheduler", name=f"scheduler-{i}") for i in range(1, self.schedulers_count)]
            if self.scheduler_port is not None:  # `rollout up`: the CLI finds this scheduler's token
                save_local_stack(self.scheduler.url, self.stack.api_token)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def api_token(self) -> str:
        """The scheduler's ROLLOUT_API_TOKEN (scopes read and write), generated for this run."""
        if self.stack is None:
            raise RuntimeError("not started")
        return self.stack.api_token

    @property
    def scheduler_url(self) -> str:
        if self.scheduler is None:
            raise RuntimeError("not started")
        return self.scheduler.url

    @property
    def log_dir(self) -> Path:
        return self.infra.root / "logs"

    def describe(self) -> str:
        return "\n".join([
            f"scheduler     {self.scheduler_url}   (OpenAPI docs: {self.scheduler_url}/docs)",
            f"viewer        {self.scheduler_url}/viewer/   (`rollout status BATCH` prints a batch's link)",
            f"API token     {self.api_token[:4]}... (the CLI reads it from {local_stack_file()}; "
            "for other clients: ROLLOUT_API_TOKEN=$(jq -r .token FILE))" if self.scheduler_port is not None else
            f"API token     {self.api_token}",
            f"NATS_URL      {self.infra.nats_url}" + (
                f"   ({self.infra.nats_cluster} clustered nodes, streams at 3 replicas)"
                if self.infra.nats_cluster > 1 and self.infra.nats is not None else "") + (
                f"   (users and passwords: {self.infra.nats.root / 'users.json'}; `admin` may do anything)"
                if self.infra.nats is not None and self.infra.nats.auth else ""),
            f"DATABASE_URL  {self.infra.database_url.replace('postgresql+psycopg://', 'postgresql://')}   (the "
            "owner; each service has a login of its own role)",
            *([f"exporter DSN  {self.infra.database_logins['exporter'].replace('postgresql+psycopg://', 'postgresql://')}"
               "   (read-only plus its cursors: ROLLOUT_EXPORT_DATABASE_URL)"] if self.infra.database_logins else []),
            f"logs          {self.log_dir}",
            "Ctrl-C stops everything.",
        ])

    def wait_forever(self) -> None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            if self.stack is not None:
                for proc in self.stack.procs:
                    if not proc.alive:
                        self.echo(f"{proc.name} exited ({proc.proc.returncode if proc.proc else '?'}); "
                                  f"log: {proc.log_path}")
                        stop.set()

    def stop(self) -> None:
        if self.scheduler is not None and self.scheduler_port is not None:
            forget_local_stack(self.scheduler.url)
        if self.stack is not None:
            self.stack.stop_all()
            self.stack = None
        self.infra.stop()

    def __enter__(self) -> DevStack:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
