"""Runs rendered Kubernetes workloads as Docker containers: as close to ``kubectl apply`` as a machine without a
cluster allows.

Each pod of a Deployment, StatefulSet or Job becomes containers on a network the test creates: the image (mapped to
its local stand-in), command and args (ENTRYPOINT / CMD), env and envFrom resolved from the rendered ConfigMaps and
Secrets (``$(VAR)`` expanded, the downward API's pod name and namespace), volumes (emptyDir as tmpfs, ConfigMap and
Secret files bind-mounted read-only, claims as folders owned by the pod's fsGroup), the security context (user,
fsGroup, read-only root filesystem, dropped capabilities, no privilege escalation), memory and CPU limits, and the
Services as network aliases of the pods they select. Init containers run to completion first; the probes are run
as the kubelet would (httpGet through a port published on 127.0.0.1, exec inside the container). What cannot be
run here (NetworkPolicies, HPAs, PDBs, scheduling) is left out.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

POD_KINDS = ("Deployment", "StatefulSet", "Job")


class KubeRunError(AssertionError):
    """A workload did not run as its manifest says (bad image, command, env, probe...)."""


def _docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise KubeRunError(f"docker {' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return proc


def _quantity_bytes(value: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(value))
    if match is None or match.group(2) not in (*units, ""):
        raise KubeRunError(f"unreadable quantity {value!r}")
    return int(float(match.group(1)) * units.get(match.group(2), 1))


def _cpus(value: str) -> str:
    text = str(value)
    return str(int(text[:-1]) / 1000) if text.endswith("m") else text


@dataclass
class Manifests:
    """The rendered objects, by kind and name."""

    objects: list[dict[str, Any]]
    namespace: str

    @classmethod
    def parse(cls, rendered: str) -> Manifests:
        objects = [o for o in yaml.safe_load_all(rendered) if o]
        namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} - {None}
        if len(namespaces) != 1:
            raise KubeRunError(f"expected one namespace, got {namespaces}")
        return cls(objects, namespaces.pop())

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                return o
        raise KubeRunError(f"{kind} {name!r} is referenced but not in the manifests")

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def config_data(self, kind: str, name: str) -> dict[str, str]:
        """A ConfigMap's data or a Secret's data (decoded) and stringData."""
        obj = self.get(kind, name)
        data = dict(obj.get("data") or {})
        if kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(obj.get("stringData") or {})
        return data


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template: dict[str, Any] = spec["template"]
    return template


@dataclass
class Pod:
    """One pod of a workload, run as containers."""

    cluster: Cluster
    workload: dict[str, Any]
    name: str
    containers: list[str] = field(default_factory=list)
    """Docker names of its main containers (by container name: ``container_ids``)."""
    container_ids: dict[str, str] = field(default_factory=dict)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    """(container, containerPort) -> the port published on 127.0.0.1."""

    @property
    def template(self) -> dict[str, Any]:
        return pod_template(self.workload)

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.template["spec"]
        return spec

    def env_of(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it (envFrom first, then env, ``$(VAR)`` expanded)."""
        m = self.cluster.manifests
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = m.config_data("ConfigMap", source["configMapRef"]["name"])
            else:
                data = m.config_data("Secret", source["secretRef"]["name"])
            env.update({prefix + k: v for k, v in data.items()})
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda g: env.get(g.group(1), g.group(0)),
                                           str(item["value"]))
                continue
            ref = item["valueFrom"]
            if "configMapKeyRef" in ref or "secretKeyRef" in ref:
                kind, key_ref = (("ConfigMap", ref["configMapKeyRef"]) if "configMapKeyRef" in ref
                                 else ("Secret", ref["secretKeyRef"]))
                data = m.config_data(kind, key_ref["name"])
                if key_ref["key"] not in data:
                    if key_ref.get("optional"):
                        continue
                    raise KubeRunError(f"{self.name}: {kind} {key_ref['name']} has no key {key_ref['key']!r}")
                env[item["name"]] = data[key_ref["key"]]
            elif "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                values = {"metadata.name": self.name, "metadata.namespace": m.namespace}
                if path not in values:
                    raise KubeRunError(f"{self.name}: downward API field {path} is not emulated")
                env[item["name"]] = values[path]
            elif "resourceFieldRef" in ref:
                resource = ref["resourceFieldRef"]["resource"]
                limits = container.get("resources", {}).get("limits", {})
                kind_, _, which = resource.partition(".")
                raw = container.get("resources", {}).get(kind_, {}).get(which) or limits.get(which, "0")
                env[item["name"]] = str(_quantity_bytes(raw) if which == "memory" else raw)
            else:
                raise KubeRunError(f"{self.name}: env {item['name']} has an unknown source {ref}")
        return env

    def _volume_args(self, container: dict[str, Any]) -> list[str]:
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in self.workload["spec"].get("volumeClaimTemplates", [])}
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        args: list[str] = []
        for mount in container.get("volumeMounts", []):
            name, path = mount["name"], mount["mountPath"]
            ro = ",readonly" if mount.get("readOnly") else ""
            if name in claims:
                host = self.cluster.claim_dir(f"{name}-{self.name}", fs_group)
                args += ["--mount", f"type=bind,src={host},dst={path}{ro}"]
                continue
            if name not in volumes:
                raise KubeRunError(f"{self.name}: volumeMount {name!r} names no volume")
            volume = volumes[name]
            if "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit")
                # an emptyDir allows exec (Docker's tmpfs default is noexec): vLLM's CPU backend loads kernels it
                # compiled into /tmp
                opts = "mode=1777,exec" + (f",size={_quantity_bytes(size)}" if size else "")
                args += ["--tmpfs", f"{path}:{opts}"]
            elif "configMap" in volume or "secret" in volume:
                kind = "ConfigMap" if "configMap" in volume else "Secret"
                source = volume["configMap"] if kind == "ConfigMap" else volume["secret"]
                ref = source.get("name") or source.get("secretName")
                host = self.cluster.files_dir(kind, ref, source.get("items"), source.get("defaultMode", 0o644))
                sub = mount.get("subPath")
                src = host / sub if sub else host
                args += ["--mount", f"type=bind,src={src},dst={path},readonly"]
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                self.cluster.manifests.get("PersistentVolumeClaim", claim)
                host = self.cluster.claim_dir(claim, fs_group)
                args += ["--mount", f"type=bind,src={host},dst={path}{ro}"]
            else:
                raise KubeRunError(f"{self.name}: volume {name} of a kind not emulated: {volume}")
        return args

    def run_args(self, container: dict[str, Any], docker_name: str, detach: bool = True) -> list[str]:
        """``docker run`` arguments for one container of this pod."""
        args = ["run", "--name", docker_name, "--network", self.cluster.network, "--hostname", self.name]
        if detach:
            args.append("--detach")
        for alias in self.cluster.aliases_of(self.template["metadata"].get("labels", {})):
            args += ["--network-alias", alias]
        pod_sc = self.spec.get("securityContext", {})
        sc = {**pod_sc, **container.get("securityContext", {})}
        if "runAsUser" in sc:
            args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
        if pod_sc.get("fsGroup") is not None:
            args += ["--group-add", str(pod_sc["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        if "ALL" in sc.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", "ALL"]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        limits = container.get("resources", {}).get("limits", {})
        if "memory" in limits:
            args += ["--memory", str(_quantity_bytes(limits["memory"]))]
        if "cpu" in limits:
            args += ["--cpus", _cpus(limits["cpu"])]
        for key, value in self.env_of(container).items():
            args += ["--env", f"{key}={value}"]
        for port in container.get("ports", []):
            args += ["--publish", f"127.0.0.1::{port['containerPort']}"]
        args += self._volume_args(container)
        image = self.cluster.local_image(container["image"])
        command = container.get("command")
        if command:
            args += ["--entrypoint", command[0], image, *command[1:]]
        else:
            args.append(image)
        args += [str(a) for a in container.get("args", [])]
        return args

    def start(self) -> None:
        """Init containers to completion, in order, then the main containers (detached, their ports read back)."""
        for init in self.spec.get("initContainers", []):
            docker_name = f"{self.cluster.prefix}-{self.name}-{init['name']}"
            self.cluster.started.append(docker_name)
            _docker(*self.run_args(init, docker_name))
            code = self.cluster.wait_exit(docker_name, timeout_s=300)
            if code != 0:
                raise KubeRunError(f"init container {init['name']} of {self.name} exited {code}:\n"
                                   f"{self.cluster.logs(docker_name)}")
        for container in self.spec["containers"]:
            docker_name = f"{self.cluster.prefix}-{self.name}-{container['name']}"
            self.cluster.started.append(docker_name)
            _docker(*self.run_args(container, docker_name))
            self.container_ids[container["name"]] = docker_name
            for port in container.get("ports", []):
                out = _docker("port", docker_name, f"{port['containerPort']}/tcp").stdout.split()
                self.ports[(container["name"], int(port["containerPort"]))] = int(out[0].rsplit(":", 1)[1])

    def probe(self, container: dict[str, Any], kind: str) -> bool:
        """One try of the container's ``kind`` probe (True when it has none)."""
        probe = container.get(kind)
        if probe is None:
            return True
        docker_name = self.container_ids[container["name"]]
        if "httpGet" in probe:
            port = self.named_port(container, probe["httpGet"]["port"])
            url = f"http://127.0.0.1:{self.ports[(container['name'], port)]}{probe['httpGet'].get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1) + 2) as resp:
                    return 200 <= resp.status < 400
            except (urllib.error.URLError, OSError):
                return False
        if "exec" in probe:
            return _docker("exec", docker_name, *probe["exec"]["command"], check=False, timeout=30).returncode == 0
        if "tcpSocket" in probe:
            port = self.named_port(container, probe["tcpSocket"]["port"])
            try:
                socket.create_connection(("127.0.0.1", self.ports[(container["name"], port)]), timeout=2).close()
                return True
            except OSError:
                return False
        raise KubeRunError(f"{self.name}: a probe of a kind not emulated: {probe}")

    @staticmethod
    def named_port(container: dict[str, Any], port: int | str) -> int:
        if isinstance(port, int):
            return port
        for p in container.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise KubeRunError(f"container {container['name']} has no port named {port!r}")

    def wait_ready(self) -> None:
        """Every container passes its startup probe within its budget, then its readiness and liveness probes."""
        for container in self.spec["containers"]:
            startup = container.get("startupProbe") or container.get("readinessProbe") or {}
            budget = startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10) + startup.get(
                "initialDelaySeconds", 0)
            deadline = time.monotonic() + budget
            docker_name = self.container_ids[container["name"]]
            while not self.probe(container, "startupProbe"):
                if not self.cluster.running(docker_name):
                    raise KubeRunError(f"{docker_name} exited before its startup probe passed:\n"
                                       f"{self.cluster.logs(docker_name)}")
                if time.monotonic() > deadline:
                    raise KubeRunError(f"{docker_name}: startup probe still failing after {budget} s:\n"
                                       f"{self.cluster.logs(docker_name)}")
                time.sleep(1)
            for kind in ("readinessProbe", "livenessProbe"):
                end = time.monotonic() + 60
                while not self.probe(container, kind):
                    if time.monotonic() > end or not self.cluster.running(docker_name):
                        raise KubeRunError(f"{docker_name}: {kind} fails:\n{self.cluster.logs(docker_name)}")
                    time.sleep(1)


@dataclass
class Cluster:
    """The rendered manifests, run on one Docker network of their own; ``close()`` removes every trace."""

    manifests: Manifests
    images: dict[str, str]
    """Image reference without tag (``nats``, ``ghcr.io/rollout-ledger/rollout-ledger``) -> local tag."""
    prefix: str = field(default_factory=lambda: f"rlk8s-{uuid.uuid4().hex[:6]}")
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rl-k8s-")))
    started: list[str] = field(default_factory=list)
    pods: dict[str, Pod] = field(default_factory=dict)

    @property
    def network(self) -> str:
        return f"{self.prefix}-net"

    def __enter__(self) -> Cluster:
        self.root.chmod(0o755)
        _docker("network", "create", self.network)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.started:
            _docker("rm", "--force", "--volumes", *self.started, check=False, timeout=120)
        _docker("network", "rm", self.network, check=False)
        # files the containers wrote under their uids
        subprocess.run(["rm", "-rf", str(self.root)], check=False)

    def local_image(self, reference: str) -> str:
        repository = reference.rsplit(":", 1)[0] if ":" in reference.rsplit("/", 1)[-1] else reference
        if repository not in self.images:
            raise KubeRunError(f"image {reference}: no local stand-in (known: {sorted(self.images)})")
        return self.images[repository]

    def aliases_of(self, labels: dict[str, str]) -> list[str]:
        """The Services selecting these pod labels: their names resolve to the pod on the network."""
        names = []
        for service in self.manifests.of_kind("Service"):
            selector = service["spec"].get("selector") or {}
            if selector and all(labels.get(k) == v for k, v in selector.items()):
                names.append(service["metadata"]["name"])
                names.append(f"{service['metadata']['name']}.{self.manifests.namespace}.svc")
                names.append(f"{service['metadata']['name']}.{self.manifests.namespace}.svc.cluster.local")
        return names

    def check_service_ports(self) -> None:
        """A Service's port must equal its target port: the network alias cannot remap ports."""
        for service in self.manifests.of_kind("Service"):
            selector = service["spec"].get("selector") or {}
            pods = [w for w in self.workloads() if all(
                pod_template(w)["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
            if not pods:
                raise KubeRunError(f"Service {service['metadata']['name']} selects no pod")
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                resolved = {Pod.named_port(c, target) for w in pods for c in pod_template(w)["spec"]["containers"]
                            if isinstance(target, int) or any(p.get("name") == target for p in c.get("ports", []))}
                if resolved != {port["port"]}:
                    raise KubeRunError(f"Service {service['metadata']['name']} port {port['port']} targets "
                                       f"{target} -> {resolved}")

    def workloads(self, kinds: tuple[str, ...] = POD_KINDS) -> list[dict[str, Any]]:
        return [o for o in self.manifests.objects if o["kind"] in kinds]

    def files_dir(self, kind: str, name: str, items: list[dict[str, Any]] | None, mode: int) -> Path:
        """A ConfigMap's or Secret's keys as files (``items`` picks and renames them)."""
        data = self.manifests.config_data(kind, name)
        folder = self.root / f"{kind.lower()}-{name}-{uuid.uuid4().hex[:4]}"
        folder.mkdir()
        folder.chmod(0o755)
        chosen = [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else [
            (k, k, mode) for k in data]
        for key, path, file_mode in chosen:
            if key not in data:
                raise KubeRunError(f"{kind} {name} has no key {key!r}")
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(data[key])
            target.chmod(file_mode)
        return folder

    def claim_dir(self, name: str, fs_group: int | None) -> Path:
        """A persistent volume: a folder kept for the claim's life, group-owned by the pod's fsGroup (setgid)."""
        folder = self.root / f"claim-{name}"
        if not folder.exists():
            folder.mkdir()
            if fs_group is not None:
                os.chown(folder, 0, int(fs_group))
                folder.chmod(0o2775)
            else:
                folder.chmod(0o777)
        return folder

    def pod(self, kind: str, name: str, index: int = 0) -> Pod:
        workload = self.manifests.get(kind, name)
        pod_name = f"{name}-{index}" if kind == "StatefulSet" else f"{name}-{uuid.uuid4().hex[:5]}"
        pod = Pod(self, workload, pod_name)
        self.pods[pod_name] = pod
        return pod

    def run_job(self, kind: str, name: str, timeout_s: float = 300) -> str:
        """A Job (or a CronJob's job) once, to completion within its backoffLimit; returns its last logs."""
        workload = self.manifests.get(kind, name)
        job_spec = workload["spec"]["jobTemplate"]["spec"] if kind == "CronJob" else workload["spec"]
        attempts = int(job_spec.get("backoffLimit", 6)) + 1
        for attempt in range(attempts):
            pod = Pod(self, workload, f"{name}-{uuid.uuid4().hex[:5]}")
            for init in pod.spec.get("initContainers", []):
                docker_name = f"{self.prefix}-{pod.name}-{init['name']}"
                self.started.append(docker_name)
                _docker(*pod.run_args(init, docker_name))
                if self.wait_exit(docker_name, timeout_s) != 0:
                    raise KubeRunError(f"{kind} {name}: init {init['name']} failed:\n{self.logs(docker_name)}")
            (container,) = pod.spec["containers"]
            docker_name = f"{self.prefix}-{pod.name}-{container['name']}"
            self.started.append(docker_name)
            _docker(*pod.run_args(container, docker_name))
            code = self.wait_exit(docker_name, timeout_s)
            if code == 0:
                return self.logs(docker_name)
            if attempt == attempts - 1:
                raise KubeRunError(f"{kind} {name} failed {attempts} times; last exit {code}:\n"
                                   f"{self.logs(docker_name)}")
        raise AssertionError("unreachable")

    def wait_exit(self, docker_name: str, timeout_s: float) -> int:
        proc = _docker("wait", docker_name, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise KubeRunError(f"docker wait {docker_name}: {proc.stderr}")
        return int(proc.stdout.strip())

    def running(self, docker_name: str) -> bool:
        out = _docker("inspect", "--format", "{{json .State}}", docker_name).stdout
        state: dict[str, Any] = json.loads(out)
        return bool(state.get("Running"))

    def restarts(self) -> Iterator[str]:
        """Containers that are not running (a pod's container exiting is a crash here)."""
        for pod in self.pods.values():
            for docker_name in pod.container_ids.values():
                if not self.running(docker_name):
                    yield docker_name

    def logs(self, docker_name: str, tail: int = 60) -> str:
        proc = _docker("logs", "--tail", str(tail), docker_name, check=False)
        return proc.stdout + proc.stderr


def claim_files(cluster: Cluster, claim: str) -> list[Path]:
    folder = cluster.root / f"claim-{claim}"
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def docker_available() -> bool:
    return shutil.which("docker") is not None and _docker("info", check=False, timeout=30).returncode == 0
