"""Every overlay renders with ``kubectl kustomize``, validates with ``kubernetes-validate --strict`` and agrees
with the code: settings names and values, images, ports, probe paths, streams, security and network flows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from rollout_ledger.services import catalog
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.shared import deploy
from rollout_ledger.shared.kit.settings import BaseServiceSettings
from rollout_ledger.shared.subjects import STREAMS, WORK_CONSUMER, WORK_STREAM, work_consumer
from tests.deploy.crd_schemas import CRD_SCHEMAS, validate_custom
from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    Container,
    Rendered,
    base_name,
    kustomize,
    render,
    settings_env_names,
    validate,
)

SERVICES = [w for w in catalog.WORKLOADS.values() if w.serves_http]
BUS_SERVICES = [w for w in SERVICES if w.uses_nats]
"""The services on the bus (the exporter serves HTTP but reads only Postgres)."""
SECRET_EXAMPLE = K8S / "overlays" / "prod" / "secret.example.yaml"


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(str(request.param))


@pytest.fixture(scope="module")
def prod() -> Rendered:
    return render("prod")


@pytest.fixture(scope="module")
def dev() -> Rendered:
    return render("dev")


def secret_keys(r: Rendered, name: str) -> set[str]:
    """Keys of Secret ``name``: generated in the overlay, or (prod) those of the checked-in example."""
    for secret in r.of_kind("Secret"):
        if base_name(secret["metadata"]["name"]) == name:
            return set(secret.get("data") or {}) | set(secret.get("stringData") or {})
    example = yaml.safe_load(SECRET_EXAMPLE.read_text())
    assert example["metadata"]["name"] == name, f"{r.overlay}: Secret {name} is neither generated nor exemplified"
    return set(example["stringData"])


# --- validation ----------------------------------------------------------------------------------------------


def test_overlay_validates_strictly(rendered: Rendered) -> None:
    proc = validate(rendered.text)
    assert proc.returncode == 0, f"{rendered.overlay}:\n{proc.stdout}\n{proc.stderr}"
    unknown = {m for m in re.findall(r"find schema for kind (\w+)", proc.stdout + proc.stderr)}
    assert unknown <= {"ScaledObject", *CRD_SCHEMAS}, (
        f"only KEDA's CRD and the monitoring CRDs of tests/deploy/crd_schemas.py may lack a schema, not {unknown}")


def test_monitoring_objects_fit_their_strict_schemas(rendered: Rendered) -> None:
    """The Prometheus Operator's objects, which kubernetes-validate cannot check, against tests/deploy/crd_schemas.py
    (an unknown field fails, as --strict makes it fail for built-in kinds)."""
    for obj in rendered.objects:
        if obj["kind"] in CRD_SCHEMAS:
            validate_custom(obj)


def test_base_renders_and_validates() -> None:
    proc = validate(kustomize(K8S / "base"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_workload_is_deployed(rendered: Rendered) -> None:
    kinds = {"scheduler": "Deployment", "env-worker": "Deployment", "inference-worker": "Deployment",
             "recorder": "Deployment", "migrate": "Job", "db-logins": "Job", "exporter": "Deployment",
             "export-batches": "CronJob", "feed-prune": "CronJob"}
    for name, workload in catalog.WORKLOADS.items():
        obj = rendered.get(kinds[name], name)
        c = rendered.container(name)
        assert tuple(c.spec.get("command") or deploy.IMAGE_ENTRYPOINT) == (workload.command or deploy.IMAGE_ENTRYPOINT)
        assert tuple(c.spec.get("args") or ()) == workload.args, f"{name}: args"
        assert obj["metadata"]["namespace"] == "rollout-ledger"
    assert rendered.has("Namespace", "rollout-ledger")


# --- one source of truth: settings ---------------------------------------------------------------------------


@pytest.mark.parametrize("workload", list(catalog.WORKLOADS))
def test_settings_each_workload_needs_are_provided(rendered: Rendered, workload: str) -> None:
    c = rendered.container(workload)
    missing = catalog.WORKLOADS[workload].required_env - set(c.env)
    assert not missing, f"{rendered.overlay}: {workload} is not given {sorted(missing)}"


def test_every_env_var_is_a_real_setting(rendered: Rendered) -> None:
    for c in rendered.containers():
        if c.workload not in catalog.WORKLOADS:
            continue  # nats, postgres: third-party images
        workload = catalog.WORKLOADS[c.workload]
        known = settings_env_names(workload.settings if not c.init else
                                   "rollout_ledger.shared.kit.settings:BaseServiceSettings")
        unknown = set(c.env) - known
        assert not unknown, f"{rendered.overlay}: {c.workload}/{c.name} sets {sorted(unknown)}: no such setting"


def test_setting_values_parse(rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConfigMap values are valid for the settings classes (a typo in a number or a boolean fails here)."""
    import importlib

    for workload in SERVICES:
        c = rendered.container(workload.name)
        module, _, cls_name = workload.settings.partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        with monkeypatch.context() as m:
            for name, value in c.env.items():
                m.setenv(name, value if value is not None else _stand_in(name))
            settings = cls()
        assert settings.http_port == deploy.HTTP_PORT
        if "ROLLOUT_MODEL" in workload.required_env:
            assert settings.model == deploy.MODEL_DIR


def _stand_in(name: str) -> str:
    """A valid value for a variable filled from a Secret or the downward API."""
    return {"DATABASE_URL": "postgresql://rollout@postgres:5432/rollout",
            "ROLLOUT_API_TOKEN": "a-real-looking-token-0123456789"}.get(name, "pod-name-0")


def test_secret_references_exist(rendered: Rendered) -> None:
    for c in rendered.containers():
        for name, key, optional in c.secret_refs:
            keys = secret_keys(rendered, base_name(name))
            assert optional or key in keys, f"{rendered.overlay}: {c.workload} needs {name}/{key}"


def test_secret_example_holds_no_secret() -> None:
    example = yaml.safe_load(SECRET_EXAMPLE.read_text())
    for key, value in example["stringData"].items():
        assert re.search(r"<[a-z-]+>", value), f"secret.example.yaml {key} must be a <placeholder>"
    from pydantic import ValidationError

    from rollout_ledger.services.scheduler.settings import SchedulerSettings

    with pytest.raises(ValidationError):
        SchedulerSettings(api_token=example["stringData"]["api-token"])


def test_drain_fits_in_the_grace_period(rendered: Rendered) -> None:
    for workload in SERVICES:
        c = rendered.container(workload.name)
        drain = float(c.env.get("ROLLOUT_DRAIN_TIMEOUT_S") or BaseServiceSettings().drain_timeout_s)
        grace = c.pod.get("terminationGracePeriodSeconds", 30)
        assert grace >= drain + 10, f"{rendered.overlay}: {workload.name} grace {grace}s < drain {drain}s + 10"


def test_context_length_agrees(rendered: Rendered) -> None:
    env_worker = int(rendered.container("env-worker").env["ROLLOUT_MAX_MODEL_LEN"])
    vllm = rendered.container("inference-worker").env.get("ROLLOUT_VLLM_MAX_MODEL_LEN")
    assert vllm is None or env_worker <= int(vllm), "env workers plan for more context than vLLM serves"


# --- one source of truth: images, ports, probes --------------------------------------------------------------


def _image_name(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def test_images_agree_with_the_code(rendered: Rendered) -> None:
    for name, workload in catalog.WORKLOADS.items():
        for c in rendered.containers(name):
            image = c.spec["image"]
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), f"{name}: pin {image}"
            engine = c.env.get("ROLLOUT_ENGINE")
            expected = deploy.SERVICE_IMAGE if (c.init or engine == "fake") else workload.image
            assert _image_name(image) == expected, f"{rendered.overlay}: {name}/{c.name} runs {image}"


def _probe(c: Container, kind: str) -> dict[str, Any]:
    probe = c.spec.get(kind)
    assert probe is not None, f"{c.workload}: no {kind}"
    return dict(probe["httpGet"])


def test_ports_and_probe_paths_agree_with_the_code(rendered: Rendered) -> None:
    for workload in SERVICES:
        c = rendered.container(workload.name)
        ports = {p["name"]: p["containerPort"] for p in c.spec["ports"]}
        assert ports == {"http": deploy.HTTP_PORT}
        assert int(c.env["ROLLOUT_HTTP_PORT"]) == deploy.HTTP_PORT == BaseServiceSettings().http_port
        assert _probe(c, "livenessProbe") == {"path": deploy.LIVENESS_PATH, "port": "http"}
        assert _probe(c, "readinessProbe") == {"path": deploy.READINESS_PATH, "port": "http"}
        assert _probe(c, "startupProbe") == {"path": deploy.LIVENESS_PATH, "port": "http"}
        annotations = rendered.pod_template(rendered.get("Deployment", workload.name))["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(deploy.HTTP_PORT)
        assert annotations["prometheus.io/path"] == deploy.METRICS_PATH


def test_runtime_serves_the_probe_paths() -> None:
    from prometheus_client import CollectorRegistry

    from rollout_ledger.shared.kit.runtime import Health, ops_app

    paths = {getattr(route, "path", None) for route in ops_app("x", Health(), CollectorRegistry()).routes}
    assert {deploy.LIVENESS_PATH, deploy.READINESS_PATH, deploy.METRICS_PATH} <= paths


def test_scheduler_service_and_ingress(rendered: Rendered, prod: Rendered) -> None:
    svc = rendered.get("Service", "scheduler")
    assert svc["spec"]["ports"] == [{"name": "http", "port": deploy.HTTP_PORT, "targetPort": "http"}]
    ingress = prod.get("Ingress", "scheduler")
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    assert path["path"] == deploy.API_PREFIX
    assert path["backend"]["service"] == {"name": "scheduler", "port": {"name": "http"}}


# --- NATS and streams ----------------------------------------------------------------------------------------


def _nats_conf(r: Rendered) -> str:
    return r.config_map("nats-config")["nats.conf"]


def _size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*([KMG]?B?)", text.strip()).groups()  # type: ignore[union-attr]
    return int(number) * {"": 1, "B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}[unit.upper() or ""]


def test_nats_config_fits_the_streams(rendered: Rendered) -> None:
    conf = _nats_conf(rendered)
    max_payload = _size(re.search(r"^max_payload:\s*(\S+)", conf, re.M).group(1))  # type: ignore[union-attr]
    assert max_payload >= max(s.max_msg_size for s in STREAMS), "NATS would refuse the largest stream message"
    assert re.search(r"^listen:\s*0\.0\.0\.0:(\d+)", conf, re.M).group(1) == str(deploy.NATS_CLIENT_PORT)  # type: ignore[union-attr]
    assert re.search(r"^http:\s*0\.0\.0\.0:(\d+)", conf, re.M).group(1) == str(deploy.NATS_MONITOR_PORT)  # type: ignore[union-attr]
    assert "store_dir: /data/jetstream" in conf
    nats = rendered.container("nats")
    ports = {p["name"]: p["containerPort"] for p in nats.spec["ports"]}
    assert ports == {"client": deploy.NATS_CLIENT_PORT, "cluster": deploy.NATS_CLUSTER_PORT,
                     "monitor": deploy.NATS_MONITOR_PORT}
    svc = {p["name"]: p["port"] for p in rendered.get("Service", "nats")["spec"]["ports"]}
    assert svc["client"] == deploy.NATS_CLIENT_PORT
    for workload in BUS_SERVICES:
        url = rendered.container(workload.name).env["NATS_URL"]
        assert url == f"nats://nats:{deploy.NATS_CLIENT_PORT}", url


def test_stream_replicas_match_the_nats_cluster(rendered: Rendered) -> None:
    servers = rendered.get("StatefulSet", "nats")["spec"]["replicas"]
    replicas = {int(rendered.container(w.name).env["ROLLOUT_STREAM_REPLICAS"]) for w in BUS_SERVICES}
    assert replicas == {1 if servers == 1 else 3}, f"{rendered.overlay}: {servers} servers, replicas {replicas}"
    conf = _nats_conf(rendered)
    routes = re.findall(r"nats://(nats-\d+)\.nats-headless:(\d+)", conf)
    if servers == 1:
        assert "cluster {" not in conf
    else:
        assert sorted(r[0] for r in routes) == [f"nats-{i}" for i in range(servers)]
        assert {int(r[1]) for r in routes} == {deploy.NATS_CLUSTER_PORT}


def test_prod_is_a_three_node_cluster(prod: Rendered) -> None:
    nats = prod.get("StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    anti = nats["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"], "one NATS server per node"
    assert not prod.has("StatefulSet", "postgres"), "prod runs the CloudNativePG Cluster, not the dev StatefulSet"


def test_env_workers_scale_on_the_work_queue(dev: Rendered, prod: Rendered) -> None:
    assert dev.get("HorizontalPodAutoscaler", "env-worker")["spec"]["scaleTargetRef"]["name"] == "env-worker"
    assert not prod.has("HorizontalPodAutoscaler", "env-worker"), "KEDA owns the HPA in prod"
    scaled = prod.get("ScaledObject", "env-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "env-worker"
    assert scaled["spec"]["fallback"]["replicas"] >= 1
    lags = [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "nats-jetstream"]
    # one trigger per route consumer of the built-in envs the base Deployment runs, and the legacy consumer
    expected = {WORK_CONSUMER, *(work_consumer(spec.route) for spec in builtin_registry().specs())}
    assert {meta["consumer"] for meta in lags} == expected
    for meta in lags:
        assert meta["stream"] == WORK_STREAM
        assert meta["natsServerMonitoringEndpoint"].endswith(f":{deploy.NATS_MONITOR_PORT}")
        assert meta["natsServerMonitoringEndpoint"].split(".")[0] == "nats-headless"


# --- tiers ---------------------------------------------------------------------------------------------------


def test_recorder_has_at_least_two_replicas(rendered: Rendered) -> None:
    assert rendered.get("Deployment", "recorder")["spec"]["replicas"] >= 2


def test_inference_on_gpu_nodes_in_prod(prod: Rendered) -> None:
    c = prod.container("inference-worker")
    assert c.env["ROLLOUT_ENGINE"] == "vllm"
    assert c.spec["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c.pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in c.pod["tolerations"]
    shm = next(v for v in c.pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c.spec["volumeMounts"]
    assert _probe(c, "readinessProbe")["path"] == deploy.READINESS_PATH


def test_dev_runs_without_gpus(dev: Rendered) -> None:
    c = dev.container("inference-worker")
    assert c.env["ROLLOUT_ENGINE"] == "fake"
    assert "nvidia.com/gpu" not in str(c.pod) + str(c.spec["resources"])
    assert dev.has("StatefulSet", "postgres")


def test_migrations_run_before_the_services(rendered: Rendered) -> None:
    assert rendered.get("Job", "migrate")
    for workload in SERVICES:
        inits = [c for c in rendered.containers(workload.name) if c.init]
        if workload.uses_database:
            (init,) = inits
            assert "command" not in init.spec, "the image entrypoint (rollout) runs it"
            assert tuple(init.spec["args"][:2]) == deploy.WAIT_SCHEMA_ARGS
            assert "DATABASE_URL" in init.env
        else:
            assert not inits, f"{workload.name} does not use Postgres and need not wait for it"


def test_every_long_running_workload_has_a_pdb(rendered: Rendered) -> None:
    pdbs = {tuple(sorted(p["spec"]["selector"]["matchLabels"].items()))
            for p in rendered.of_kind("PodDisruptionBudget")}
    for obj in rendered.workloads():
        if obj["kind"] in ("Deployment", "StatefulSet") and obj["metadata"]["name"] != "postgres":
            labels = tuple(sorted(obj["spec"]["selector"]["matchLabels"].items()))
            assert labels in pdbs, f"{rendered.overlay}: no PodDisruptionBudget for {obj['metadata']['name']}"


# --- the exporter: one consumer, followed ---------------------------------------------------------------------


def _parses(args: list[str]) -> None:
    """``rollout ARGS`` is accepted by the real CLI (subcommands resolved, every option known)."""
    import click
    import typer

    from rollout_ledger.cli.main import app

    cmd: click.Command = typer.main.get_command(app)
    rest = list(args)
    while isinstance(cmd, click.Group):  # the manifests put no group options before a subcommand
        assert rest, f"rollout {' '.join(args)}: names a group, not a command"
        with click.Context(cmd, info_name=cmd.name) as ctx:
            sub = cmd.get_command(ctx, rest[0])
        assert sub is not None, f"rollout {' '.join(args)}: no command {rest[0]!r}"
        cmd, rest = sub, rest[1:]
    cmd.make_context(cmd.name, rest)  # raises on an unknown option or a bad value


def test_exporter_follows_one_consumer(rendered: Rendered) -> None:
    obj = rendered.get("Deployment", "exporter")
    assert obj["spec"]["replicas"] == 1, "the consumer's advisory lock lets one process read it"
    assert obj["spec"]["strategy"] == {"type": "Recreate"}, "the old reader must stop before the new one claims"
    c = rendered.container("exporter")
    args = list(c.spec["args"])
    assert args[:4] == ["export", "--consumer", deploy.EXPORT_CONSUMER, "--follow"]
    _parses(args)
    out = args[args.index("--out") + 1]
    mounts = {m["name"]: m["mountPath"] for m in c.spec["volumeMounts"]}
    volumes = {v["name"]: v for v in c.pod["volumes"]}
    assert mounts["exports"] == deploy.EXPORTS_DIR and out.startswith(deploy.EXPORTS_DIR + "/")
    assert volumes["exports"]["persistentVolumeClaim"]["claimName"] == "exports"
    assert rendered.has("PersistentVolumeClaim", "exports")
    assert mounts["tmp"] == "/tmp" and "emptyDir" in volumes["tmp"]
    refs = {(v["name"], (v.get("valueFrom") or {}).get("secretKeyRef", {}).get("key")) for v in c.spec["env"]}
    assert ("DATABASE_URL", "exporter-database-url") in refs  # its own login: read-only plus its cursors
    assert c.pod.get("terminationGracePeriodSeconds", 30) >= 30, "time to finish the read in flight on SIGTERM"
    (init,) = [i for i in rendered.containers("exporter") if i.init]
    assert "command" not in init.spec, "the image entrypoint (rollout) runs it"
    assert tuple(init.spec["args"][:2]) == deploy.WAIT_SCHEMA_ARGS
    readers = [w for w in rendered.containers() if not w.init and "--consumer" in (w.spec.get("args") or [])
               and w.spec["args"][w.spec["args"].index("--consumer") + 1] == deploy.EXPORT_CONSUMER]
    assert [w.workload for w in readers] == ["exporter"], "one workload per consumer"
    pdb = rendered.get("PodDisruptionBudget", "exporter")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "exporter"}}}


def test_batch_export_and_feed_retention_stay_available(rendered: Rendered) -> None:
    batches = rendered.get("CronJob", "export-batches")
    assert batches["spec"]["suspend"] is True and batches["spec"]["concurrencyPolicy"] == "Forbid"
    c = rendered.container("export-batches")
    assert {m["name"]: m["mountPath"] for m in c.spec["volumeMounts"]}["exports"] == deploy.EXPORTS_DIR
    assert c.pod["affinity"]["podAffinity"], "the ReadWriteOnce exports volume is on the exporter's node"
    prune = rendered.get("CronJob", "feed-prune")
    assert prune["spec"]["concurrencyPolicy"] == "Forbid"
    p = rendered.container("feed-prune")
    _parses(list(p.spec["args"]))
    assert [(base_name(n), key) for n, key, _ in p.secret_refs] == [("rollout-secrets", "feed-prune-database-url")], \
        "pruning deletes: rollout_pruner's login, not the exporter's read-only one"
    assert "ROLLOUT_EXPORT_DATABASE_URL" not in p.env


# --- security ------------------------------------------------------------------------------------------------


DB_LOGIN_KEYS = {"scheduler": "scheduler-database-url", "recorder": "recorder-database-url",
                 "exporter": "exporter-database-url", "export-batches": "exporter-database-url",
                 "feed-prune": "feed-prune-database-url", "migrate": "database-url", "db-logins": "database-url"}
"""The Secret key of each workload's DATABASE_URL: the owner's only where the schema or the logins are made."""


def test_each_workload_uses_postgres_as_its_own_login(rendered: Rendered) -> None:
    for c in rendered.containers():
        refs = {v["name"]: (v.get("valueFrom") or {}).get("secretKeyRef", {}).get("key") for v in c.spec.get("env", [])}
        if "DATABASE_URL" in refs and c.workload in catalog.WORKLOADS:
            assert refs["DATABASE_URL"] == DB_LOGIN_KEYS[c.workload], f"{c.workload}/{c.name}"
    logins = rendered.container("db-logins")
    assert {k for k in logins.env if k.endswith("_DATABASE_URL")} == {
        "ROLLOUT_SCHEDULER_DATABASE_URL", "ROLLOUT_RECORDER_DATABASE_URL", "ROLLOUT_EXPORTER_DATABASE_URL",
        "ROLLOUT_FEED_PRUNE_DATABASE_URL", "ROLLOUT_SCORER_DATABASE_URL"}


def test_dev_postgres_takes_passwords(dev: Rendered) -> None:
    (pg,) = [c for c in dev.containers() if c.name == "postgres"]
    assert "POSTGRES_HOST_AUTH_METHOD" not in pg.env and "POSTGRES_PASSWORD" in pg.env
    secret = next(o for o in dev.of_kind("Secret") if base_name(o["metadata"]["name"]) == "rollout-secrets")
    import base64

    urls = {k: base64.b64decode(v).decode() for k, v in secret["data"].items() if k.endswith("database-url")}
    users = {k: (make_url(u).username, make_url(u).password) for k, u in urls.items()}
    assert all(password for _, password in users.values()), "every DSN carries a password"
    assert len({user for user, _ in users.values()}) == len(users), "one login per workload"


def test_pods_are_locked_down(rendered: Rendered) -> None:
    for obj in rendered.workloads():
        name = obj["metadata"]["name"]
        pod = rendered.pod_template(obj)["spec"]
        assert pod.get("automountServiceAccountToken") is False, f"{name}: no service-account token needed"
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0, name
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
    for c in rendered.containers():
        sc = c.spec["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c.workload
        assert sc["readOnlyRootFilesystem"] is True, c.workload
        assert sc["capabilities"] == {"drop": ["ALL"]}, c.workload
        resources = c.spec["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), f"{c.workload}/{c.name}: {kind}"
        serves_http = c.workload not in catalog.WORKLOADS or catalog.WORKLOADS[c.workload].serves_http
        if not c.init and c.kind in ("Deployment", "StatefulSet") and serves_http:
            assert "livenessProbe" in c.spec and "readinessProbe" in c.spec, c.workload
    for c in rendered.containers():
        if c.workload in catalog.WORKLOADS:
            assert c.pod["securityContext"]["runAsUser"] == deploy.RUN_AS_USER


def test_network_policies_allow_only_the_flows_used(rendered: Rendered) -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of_kind("NetworkPolicy")}
    deny = policies["default-deny"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    for name, workload in catalog.WORKLOADS.items():
        obj = next(o for o in rendered.workloads() if o["metadata"]["name"] == name)
        labels = rendered.pod_template(obj)["metadata"]["labels"]
        assert (labels.get("rollout-ledger/nats-client") == "true") == workload.uses_nats, f"{name}: NATS flow"
        assert (labels.get("rollout-ledger/db-client") == "true") == workload.uses_database, f"{name}: DB flow"
    nats_ports = {p["port"] for rule in policies["nats-clients"]["egress"] for p in rule["ports"]}
    assert nats_ports == {deploy.NATS_CLIENT_PORT}
    db_ports = {p["port"] for rule in policies["db-clients"]["egress"] for p in rule["ports"]}
    assert db_ports == {deploy.POSTGRES_PORT}
    api_ports = {p["port"] for rule in policies["scheduler-api"]["ingress"] for p in rule["ports"]}
    assert api_ports == {deploy.HTTP_PORT}


def test_kustomize_sources_are_plain_yaml() -> None:
    for path in Path(K8S).rglob("*.yaml"):
        list(yaml.safe_load_all(path.read_text()))
