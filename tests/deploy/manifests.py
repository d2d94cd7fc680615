"""Renders the kustomize overlays offline and indexes the objects, containers and environment the tests check."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollout_ledger.shared.kit.settings import BaseServiceSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod")
POD_KINDS = ("Deployment", "StatefulSet", "Job", "CronJob")


def tool(name: str) -> str:
    """A dev tool from this venv's scripts folder (installed by the ``dev`` extra), else from PATH; fails if absent."""
    for candidate in (Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed: `pip install -e '.[dev]'` (or `make install`) provides it")
    return found


def kustomize(directory: Path) -> str:
    """``kubectl kustomize DIRECTORY``: the rendered YAML (offline)."""
    proc = subprocess.run([tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return proc.stdout


def validate(rendered: str) -> subprocess.CompletedProcess[str]:
    """``kubernetes-validate --strict --quiet -`` on rendered YAML."""
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-"], input=rendered,
                          capture_output=True, text=True, check=False, timeout=300)


def settings_env_names(settings_path: str) -> set[str]:
    """Every environment variable a settings class reads (aliases included)."""
    module, _, name = settings_path.partition(":")
    cls: type[BaseServiceSettings] = getattr(importlib.import_module(module), name)
    prefix = str(cls.model_config.get("env_prefix", ""))
    names: set[str] = set()
    for field_name, info in cls.model_fields.items():
        alias: Any = info.validation_alias
        if alias is not None and hasattr(alias, "choices"):
            names.update(str(c) for c in alias.choices)
        else:
            names.add(f"{prefix}{field_name}".upper())
    return names


@dataclass
class Container:
    """One container of a rendered workload with its environment resolved through ConfigMaps."""

    workload: str
    kind: str
    name: str
    spec: dict[str, Any]
    pod: dict[str, Any]
    init: bool
    env: dict[str, str | None] = field(default_factory=dict)
    """Variable -> value (None when it comes from a Secret or the downward API)."""
    secret_refs: list[tuple[str, str, bool]] = field(default_factory=list)
    """(secret name, key, optional) of every ``secretKeyRef``."""


@dataclass
class Rendered:
    """The objects of one overlay."""

    overlay: str
    text: str
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for obj in self.objects:
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                return obj
        raise AssertionError(f"{self.overlay}: no {kind}/{name}")

    def has(self, kind: str, name: str) -> bool:
        return any(o["kind"] == kind and o["metadata"]["name"] == name for o in self.objects)

    def config_map(self, name: str) -> dict[str, str]:
        """A ConfigMap's data by its generated name (``name-<hash>``) or its plain name."""
        for cm in self.of_kind("ConfigMap"):
            cm_name = cm["metadata"]["name"]
            if cm_name == name or cm_name.rsplit("-", 1)[0] == name:
                return dict(cm.get("data") or {})
        raise AssertionError(f"{self.overlay}: no ConfigMap {name}")

    def pod_template(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "CronJob":
            return obj["spec"]["jobTemplate"]["spec"]["template"]
        return obj["spec"]["template"]

    def workloads(self) -> Iterator[dict[str, Any]]:
        for obj in self.objects:
            if obj["kind"] in POD_KINDS:
                yield obj

    def containers(self, workload: str | None = None) -> list[Container]:
        out = []
        for obj in self.workloads():
            name = obj["metadata"]["name"]
            if workload is not None and name != workload:
                continue
            pod = self.pod_template(obj)["spec"]
            for init, key in ((True, "initContainers"), (False, "containers")):
                for spec in pod.get(key) or []:
                    container = Container(name, obj["kind"], spec["name"], spec, pod, init)
                    self._resolve_env(container)
                    out.append(container)
        return out

    def container(self, workload: str) -> Container:
        main = [c for c in self.containers(workload) if not c.init]
        assert len(main) == 1, f"{self.overlay}: {workload} has {len(main)} containers"
        return main[0]

    def _resolve_env(self, c: Container) -> None:
        for source in c.spec.get("envFrom") or []:
            assert "prefix" not in source, f"{c.workload}: envFrom prefixes are not used"
            if "configMapRef" in source:
                c.env.update(self.config_map(source["configMapRef"]["name"]))
            else:
                raise AssertionError(f"{c.workload}: envFrom {source} (secrets are referenced key by key)")
        for var in c.spec.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None:
                c.secret_refs.append((ref["name"], ref["key"], bool(ref.get("optional", False))))
            c.env[var["name"]] = var.get("value")


def render(overlay: str) -> Rendered:
    text = kustomize(K8S / "overlays" / overlay)
    objects = [o for o in yaml.safe_load_all(text) if o]
    return Rendered(overlay, text, objects)


def base_name(generated: str) -> str:
    """``rollout-secrets-8hd7k2`` -> ``rollout-secrets`` (kustomize's generator suffix removed)."""
    head, _, tail = generated.rpartition("-")
    return head if head and len(tail) == 10 and tail.isalnum() else generated
