"""deploy/k8s/overlays/dev run as containers from the locally built images, as close to ``kubectl apply`` as this
machine allows (tests/containers/kube.py): every StatefulSet, Deployment and Job starts from its own container spec
and passes its probes; a batch submitted to the scheduler container ends as token-exact trajectories in the
Postgres container; the exporter CronJob's job writes them out; nothing crashed on the way."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pyarrow.parquet as pq
import pytest

from rollout_ledger.shared import deploy
from rollout_ledger.shared.db import SCHEMA_REVISION
from tests.containers.kube import Cluster, KubeRunError, Manifests, claim_files
from tests.deploy.manifests import K8S, kustomize
from tests.helpers import wait_for

EPISODES = 8


@pytest.fixture(scope="module")
def cluster(service_image: str, local_images: Any) -> Iterator[Cluster]:
    manifests = Manifests.parse(kustomize(K8S / "overlays" / "dev"))
    images = {
        "ghcr.io/rollout-ledger/rollout-ledger": service_image,
        "nats": local_images.nats,
        "postgres": local_images.postgres,
    }
    with Cluster(manifests, images) as c:
        c.check_service_ports()
        try:
            yield c
        except BaseException:
            raise
        finally:
            for name in c.started:
                print(f"\n===== {name} =====\n{c.logs(name, tail=30)}")


def _secret(cluster: Cluster, key: str) -> str:
    (secret,) = [s for s in cluster.manifests.of_kind("Secret") if s["metadata"]["name"].startswith("rollout-secrets")]
    return cluster.manifests.config_data("Secret", secret["metadata"]["name"])[key]


def test_the_service_image_runs_as_its_non_root_user(service_image: str) -> None:
    user = subprocess.run(["docker", "image", "inspect", "--format", "{{.Config.User}}", service_image],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert user == f"{deploy.RUN_AS_USER}:{deploy.RUN_AS_USER}"
    whoami = subprocess.run(["docker", "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python3",
                             service_image, "-c", "import os, rollout_ledger.services.env_worker.main as m; "
                             "import tau2, reasoning_gym; print(os.getuid(), os.getgid())"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert whoami.returncode == 0, whoami.stderr[-2000:]  # the envs extra is in the image, importable read-only
    assert whoami.stdout.split() == [str(deploy.RUN_AS_USER)] * 2


def test_the_dev_overlay_runs_a_batch_end_to_end(cluster: Cluster) -> None:
    started = time.monotonic()
    # the servers first, as their StatefulSets would come up; then the Jobs and Deployments (their init containers
    # wait for the schema, as in the cluster)
    servers = [cluster.pod("StatefulSet", name) for name in ("postgres", "nats")]
    for pod in servers:
        pod.start()
    for pod in servers:
        pod.wait_ready()
    migrate = cluster.run_job("Job", "migrate")
    # a new database goes all the way (the Job stops at the expand revision only below it: deploy.md, "Upgrading")
    assert f"database at revision {SCHEMA_REVISION}" in migrate, migrate
    cluster.run_job("Job", "db-logins")
    deployments = [o["metadata"]["name"] for o in cluster.manifests.of_kind("Deployment")]
    assert set(deployments) == {"scheduler", "env-worker", "inference-worker", "recorder", "exporter"}
    pods = []
    for name in deployments:
        replicas = int(cluster.manifests.get("Deployment", name)["spec"].get("replicas", 1))
        for _ in range(replicas):
            pod = cluster.pod("Deployment", name)
            pod.start()
            pods.append(pod)
    for pod in pods:
        pod.wait_ready()
    ready_s = time.monotonic() - started

    # a batch through the scheduler container, with the dev overlay's write token
    (scheduler,) = [p for p in pods if p.workload["metadata"]["name"] == "scheduler"]
    url = f"http://127.0.0.1:{scheduler.ports[('scheduler', 8000)]}"
    auth = {"Authorization": f"Bearer {_secret(cluster, 'api-token')}"}
    body = {"env": "arithmetic", "tasks": [{"seed": i} for i in range(EPISODES // 2)], "group_size": 2,
            "batch_id": "k8s-dev", "sampling": {"max_tokens": 16, "seed": 7}}
    r = httpx.post(f"{url}/v1/batches", headers=auth, json=body, timeout=30)
    assert r.status_code in (200, 201, 202), r.text
    assert httpx.post(f"{url}/v1/batches", json=body, timeout=30).status_code == 401  # the token is enforced

    def finished() -> dict[str, Any] | None:
        info: dict[str, Any] = httpx.get(f"{url}/v1/batches/k8s-dev", headers=auth, timeout=10).json()
        return info if info["done"] else None

    wait_for(finished, 240, "the batch to finish in the containers", interval_s=1)

    # the trajectories, read from the Postgres container as its owner
    (postgres,) = [p for p in servers if p.name == "postgres-0"]
    dsn = (f"postgresql://rollout:{_secret(cluster, 'postgres-password')}@127.0.0.1:"
           f"{postgres.ports[('postgres', 5432)]}/rollout")
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("select e.status, count(t.*) from episodes e left join turns t on t.episode_id = e.id"
                            " where e.batch_id = 'k8s-dev' group by e.id, e.status").fetchall()
        assert len(rows) == EPISODES and all(status == "completed" and turns >= 1 for status, turns in rows), rows
        exact = conn.execute(
            "select count(*) from turns t join episodes e on t.episode_id = e.id where e.batch_id = 'k8s-dev' and "
            "cardinality(t.token_ids) > 0 and cardinality(t.token_ids) = cardinality(t.logprobs)"
        ).fetchone()
        assert exact is not None and exact[0] == sum(turns for _, turns in rows)

    # the exporter CronJob's job, once: a parquet file of the batch on the exports claim
    cluster.run_job("CronJob", "export-batches")
    files = [f for f in claim_files(cluster, "exports") if f.name == "k8s-dev.parquet"]
    assert files, [str(f) for f in claim_files(cluster, "exports")]
    assert pq.read_table(files[0]).num_rows == EPISODES
    cluster.run_job("CronJob", "feed-prune")

    crashed = list(cluster.restarts())
    assert not crashed, "containers exited: " + ", ".join(f"{n}:\n{cluster.logs(n)}" for n in crashed)
    print(f"dev overlay: {len(cluster.started)} containers, ready in {ready_s:.0f} s")


def test_a_broken_spec_is_caught(cluster: Cluster) -> None:
    """The runner fails on what would fail in a cluster: an unknown image, a missing Secret key, a bad command."""
    workload = cluster.manifests.get("Deployment", "scheduler")
    container = workload["spec"]["template"]["spec"]["containers"][0]
    saved = dict(container)
    try:
        container["image"] = "ghcr.io/rollout-ledger/not-built:0.1.0"
        with pytest.raises(KubeRunError, match="no local stand-in"):
            cluster.pod("Deployment", "scheduler").run_args(container, "x")
        container["image"] = saved["image"]
        container["env"] = [*saved.get("env", []), {"name": "X", "valueFrom": {
            "secretKeyRef": {"name": next(s["metadata"]["name"] for s in cluster.manifests.of_kind("Secret")),
                             "key": "no-such-key"}}}]
        with pytest.raises(KubeRunError, match="no key 'no-such-key'"):
            cluster.pod("Deployment", "scheduler").run_args(container, "x")
        container["env"] = saved.get("env", [])
        container["args"] = ["serve", "no-such-service"]
        pod = cluster.pod("Deployment", "scheduler")
        pod.start()
        with pytest.raises(KubeRunError, match="exited before its startup probe passed"):
            pod.wait_ready()
    finally:
        container.clear()
        container.update(saved)
        cluster.pods = {k: v for k, v in cluster.pods.items() if v.workload is not workload or v.container_ids}
