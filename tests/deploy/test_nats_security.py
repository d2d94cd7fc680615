"""The manifests give each bus service its own NATS user and password (the users of rollout_ledger/shared/nats_auth.py),
the NATS pods every password and the generated permission file, and make the HTTP servers reachable in the pod (the
code's default bind is loopback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from rollout_ledger.services import catalog
from rollout_ledger.shared import nats_auth
from rollout_ledger.shared.kit.settings import BaseServiceSettings
from tests.deploy.manifests import OVERLAYS, Rendered, base_name, kustomize, render, validate


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(str(request.param))


def _secret_key(rendered: Rendered, workload: str, var: str) -> tuple[str, str] | None:
    c = rendered.container(workload)
    for item in c.spec.get("env") or []:
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if item["name"] == var and ref is not None:
            return base_name(ref["name"]), ref["key"]
    return None


def test_each_bus_service_connects_as_its_own_user(rendered: Rendered) -> None:
    bus_services = [w.name for w in catalog.WORKLOADS.values() if w.uses_nats]
    assert sorted(bus_services) == sorted(nats_auth.USERS)
    keys = set()
    for name in bus_services:
        c = rendered.container(name)
        assert c.env.get("ROLLOUT_NATS_USER") == name, f"{rendered.overlay}: {name} connects as another user"
        ref = _secret_key(rendered, name, "ROLLOUT_NATS_PASSWORD")
        assert ref is not None and ref[1] == f"nats-{name}-password", f"{rendered.overlay}: {name} password"
        keys.add(ref)
    assert len(keys) == len(bus_services), "no two services share a password"


def test_nats_pods_read_every_password_and_the_permissions(rendered: Rendered) -> None:
    nats = rendered.container("nats")
    for user in nats_auth.USERS:
        assert _secret_key(rendered, "nats", nats_auth.password_variable(user)) == (
            "rollout-secrets", f"nats-{user}-password")
    conf = rendered.config_map("nats-config")
    assert conf["nats-auth.conf"] == nats_auth.render_authorization()
    assert "include ./nats-auth.conf" in conf["nats.conf"]
    assert any(m["mountPath"] == "/etc/nats" for m in nats.spec["volumeMounts"])


def test_http_servers_bind_the_pod_address_only_where_configured(rendered: Rendered) -> None:
    assert BaseServiceSettings.model_fields["http_host"].default == "127.0.0.1"
    for workload in (w for w in catalog.WORKLOADS.values() if w.serves_http):
        assert rendered.container(workload.name).env.get("ROLLOUT_HTTP_HOST") == "0.0.0.0", workload.name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_tls_component(overlay: str, tmp_path: Path) -> None:
    """components/nats-tls on an overlay: NATS serves TLS with the Secret's certificate, every bus service
    connects with tls:// and verifies it with the mounted CA; the result validates strictly."""
    root = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(root / 'overlays' / overlay, tmp_path)}]\n"
        f"components: [{os.path.relpath(root / 'components' / 'nats-tls', tmp_path)}]\n")
    text = kustomize(tmp_path)
    proc = validate(text)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = Rendered(overlay, text, [o for o in yaml.safe_load_all(text) if o])
    nats = r.container("nats")
    assert {"--tls", "--tlscert=/etc/nats-tls/tls.crt", "--tlskey=/etc/nats-tls/tls.key"} <= set(nats.spec["args"])
    for name in nats_auth.USERS:
        c = r.container(name)
        assert str(c.env["NATS_URL"]).startswith("tls://"), name
        ca = str(c.env["ROLLOUT_NATS_TLS_CA"])
        mounts = {m["mountPath"] for m in c.spec["volumeMounts"]}
        assert any(ca.startswith(f"{m}/") for m in mounts), f"{name}: {ca} is not mounted"
