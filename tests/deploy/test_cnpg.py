"""The prod overlay's Postgres (components/cnpg): the CloudNativePG Cluster, its backups and flows, validated offline
against the operator's own CRD schema (vendored, made strict: tests/deploy/cnpg_schemas.py), and agreeing with the
services: three instances with synchronous replication, every workload's DSN on the ``-rw`` Service of that
Cluster's database with the Cluster's CA mounted where the DSN reads it, and the owner the migrations need."""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import pytest
import yaml

from tests.deploy.cnpg_schemas import CNPG_SCHEMAS, vendored
from tests.deploy.manifests import Rendered, render
from tests.deploy.test_manifests import DB_LOGIN_KEYS, SECRET_EXAMPLE


@pytest.fixture(scope="module")
def prod() -> Rendered:
    return render("prod")


@pytest.fixture(scope="module")
def cluster(prod: Rendered) -> dict[str, Any]:
    clusters = prod.of_kind("Cluster")
    assert len(clusters) == 1, "prod runs one CloudNativePG Cluster"
    return clusters[0]


def check(obj: dict[str, Any]) -> None:
    jsonschema.validate(obj, CNPG_SCHEMAS[obj["kind"]], cls=jsonschema.Draft202012Validator)


def test_cnpg_objects_fit_the_operators_schema(prod: Rendered) -> None:
    kinds = [o["kind"] for o in prod.objects if o["kind"] in CNPG_SCHEMAS]
    assert sorted(kinds) == ["Cluster", "ObjectStore", "ScheduledBackup"]
    for obj in prod.objects:
        if obj["kind"] in CNPG_SCHEMAS:
            check(obj)
    assert "a95a534dbe0854495b863bbc1b7651f74d310916" in vendored("Cluster")["$comment"]


@pytest.mark.parametrize(("path", "value", "error"), [
    (("spec", "instancess"), 3, "Additional properties"),  # a misspelt field the API server would drop
    (("spec", "instances"), "3", "is not of type"),
    (("spec", "postgresql", "synchronous", "method"), "all", "is not one of"),
    (("spec", "postgresql", "synchronous", "dataDurabilty"), "required", "Additional properties"),
    (("spec", "storage", "sizee"), "1Gi", "Additional properties"),
])
def test_the_schema_refuses_what_the_operator_would_not_take(cluster: dict[str, Any], path: tuple[str, ...],
                                                             value: object, error: str) -> None:
    bad = copy.deepcopy(cluster)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError, match=error):
        check(bad)


def test_three_instances_replicate_synchronously(cluster: dict[str, Any]) -> None:
    spec = cluster["spec"]
    assert spec["instances"] == 3
    sync = spec["postgresql"]["synchronous"]
    # a commit waits for one of the two standbys: acknowledged writes survive the primary, one standby may be down
    assert sync["method"] == "any" and sync["number"] == 1 and sync["number"] <= spec["instances"] - 2
    assert sync["dataDurability"] == "required" and sync["failoverQuorum"] is True
    assert "synchronous_commit" not in spec["postgresql"].get("parameters", {}), "on (the default) or stronger"
    assert spec["affinity"]["podAntiAffinityType"] == "required"
    assert spec["storage"]["size"] and spec["walStorage"]["size"]
    assert spec["enableSuperuserAccess"] is False


def _dsns() -> dict[str, str]:
    data: dict[str, str] = yaml.safe_load(SECRET_EXAMPLE.read_text())["stringData"]
    return {k: v for k, v in data.items() if k.endswith("database-url")}


def test_every_dsn_is_the_clusters_rw_service(prod: Rendered, cluster: dict[str, Any]) -> None:
    name = cluster["metadata"]["name"]
    initdb = cluster["spec"]["bootstrap"]["initdb"]
    dsns = _dsns()
    assert set(DB_LOGIN_KEYS.values()) <= set(dsns)
    ca_paths = set()
    for key, dsn in dsns.items():
        parts = urlsplit(dsn)
        assert parts.hostname == f"{name}-rw", f"{key}: the primary, wherever it is, is {name}-rw"
        assert parts.port == 5432 and parts.path == f"/{initdb['database']}", key
        query = parse_qs(parts.query)
        assert query["sslmode"] == ["verify-full"], key
        # a failover on a lost node: neither a connect nor a query in flight waits for TCP's own timeout
        assert query["connect_timeout"] == ["10"] and query["tcp_user_timeout"] == ["30000"], key
        ca_paths.update(query["sslrootcert"])
    assert urlsplit(dsns["database-url"]).username == initdb["owner"]
    assert any("CREATEROLE" in sql for sql in initdb["postInitApplicationSQL"]), "migration 0012 creates roles"
    # the CA file every DSN names is mounted, from the operator's CA Secret, in every container with a DSN
    (ca_path,) = ca_paths
    mount_dir = ca_path.rsplit("/", 1)[0]
    with_dsn = [c for c in prod.containers() if any(ref[0] == "rollout-secrets" and ref[1] in dsns
                                                     for ref in c.secret_refs)]
    assert {c.workload for c in with_dsn} == set(DB_LOGIN_KEYS)
    for c in with_dsn:
        mounts = {m["mountPath"]: m["name"] for m in c.spec.get("volumeMounts", [])}
        assert mount_dir in mounts, f"{c.workload}/{c.name} does not mount {mount_dir}"
        volume = next(v for v in c.pod["volumes"] if v["name"] == mounts[mount_dir])
        assert volume["secret"]["secretName"] == f"{name}-ca"
        assert {i["path"] for i in volume["secret"]["items"]} == {ca_path.rsplit("/", 1)[1]}


def test_postgres_flows(prod: Rendered, cluster: dict[str, Any]) -> None:
    instances = {"cnpg.io/cluster": cluster["metadata"]["name"]}
    policies = {p["metadata"]["name"]: p["spec"] for p in prod.of_kind("NetworkPolicy")}
    (egress,) = policies["db-clients"]["egress"]
    assert egress["to"] == [{"podSelector": {"matchLabels": instances}}]
    own = policies["postgres-instances"]
    assert own["podSelector"] == {"matchLabels": instances}
    clients = own["ingress"][0]
    assert {"podSelector": {"matchLabels": {"rollout-ledger/db-client": "true"}}} in clients["from"]
    assert {"podSelector": {"matchLabels": instances}} in clients["from"]  # replication
    assert [p["port"] for p in clients["ports"]] == [5432]


def test_backups_reach_the_object_store(prod: Rendered, cluster: dict[str, Any]) -> None:
    (plugin,) = cluster["spec"]["plugins"]
    (store,) = prod.of_kind("ObjectStore")
    (scheduled,) = prod.of_kind("ScheduledBackup")
    assert plugin["isWALArchiver"] is True and plugin["parameters"]["barmanObjectName"] == store["metadata"]["name"]
    assert store["spec"]["retentionPolicy"] and store["spec"]["configuration"]["destinationPath"].startswith("s3://")
    assert scheduled["spec"]["cluster"]["name"] == cluster["metadata"]["name"]
    assert scheduled["spec"]["method"] == "plugin"
    assert scheduled["spec"]["pluginConfiguration"]["name"] == plugin["name"]
