"""Strict JSON schemas of the CloudNativePG objects the prod overlay renders (components/cnpg): ``Cluster`` and
``ScheduledBackup`` (postgresql.cnpg.io/v1) from the operator's own CRDs, vendored in ``schemas/``, and the Barman
Cloud plugin's ``ObjectStore`` (barmancloud.cnpg.io/v1).

A CRD's ``openAPIV3Schema`` leaves unknown fields to the API server, which prunes them silently; here every object
schema that does not preserve unknown fields gets ``additionalProperties: false``, so a misspelt field fails as
``kubernetes-validate --strict`` makes it fail for built-in kinds. The ObjectStore's CRD is not vendored: its
``spec.configuration`` is the same barman-cloud type as the Cluster's ``spec.backup.barmanObjectStore`` (the plugin
moved it out of the Cluster), so that subschema checks it; its other fields are written here from the plugin's CRD
(config/crd/bases/barmancloud.cnpg.io_objectstores.yaml of cloudnative-pg/plugin-barman-cloud).

Regenerate a vendored file from a CRD (``git show HEAD:config/crd/bases/postgresql.cnpg.io_clusters.yaml`` of the
operator's repository):

    python -m tests.deploy.cnpg_schemas CRD.yaml SOURCE-NOTE > tests/deploy/schemas/cnpg-cluster-v1.json
"""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"
FILES = {"Cluster": "cnpg-cluster-v1.json", "ScheduledBackup": "cnpg-scheduledbackup-v1.json"}
"""Kind -> its vendored ``openAPIV3Schema`` (descriptions removed), with its source in ``$comment``."""

_METADATA = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
    "name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}


def _strict(node: Any) -> Any:
    """``node`` with ``additionalProperties: false`` on every object schema that lists its properties and does
    not keep unknown fields (``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _strict(sub) for name, sub in value.items()}  # names, not keywords
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = _strict(value)  # a schema or a list of them (``additionalProperties: true`` stays)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _as_object(schema: dict[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    """A vendored root schema as the strict schema of one rendered object of ``kind``."""
    root = _strict(copy.deepcopy(schema))
    root.pop("$comment", None)
    props = root["properties"]
    props["apiVersion"] = {"const": api_version}
    props["kind"] = {"const": kind}
    props["metadata"] = _METADATA
    root["required"] = sorted({"apiVersion", "kind", "metadata", "spec", *root.get("required", [])})
    return root


@cache
def vendored(kind: str) -> dict[str, Any]:
    """The vendored ``openAPIV3Schema`` of ``kind`` as stored (``$comment`` says where it comes from)."""
    loaded: dict[str, Any] = json.loads((SCHEMAS / FILES[kind]).read_text())
    return loaded


def _object_store() -> dict[str, Any]:
    barman = vendored("Cluster")["properties"]["spec"]["properties"]["backup"]["properties"]["barmanObjectStore"]
    spec = {"type": "object", "required": ["configuration"], "properties": {
        "configuration": barman,
        "retentionPolicy": {"type": "string", "pattern": "^[1-9][0-9]*[dwm]$"},
        "instanceSidecarConfiguration": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    }}
    return _as_object({"type": "object", "properties": {"spec": spec}}, "barmancloud.cnpg.io/v1", "ObjectStore")


CNPG_SCHEMAS: dict[str, dict[str, Any]] = {
    "Cluster": _as_object(vendored("Cluster"), "postgresql.cnpg.io/v1", "Cluster"),
    "ScheduledBackup": _as_object(vendored("ScheduledBackup"), "postgresql.cnpg.io/v1", "ScheduledBackup"),
    "ObjectStore": _object_store(),
}
"""Kind -> the strict schema a rendered object of it must fit."""


def vendor(crd_text: str, source: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of version v1 of a CRD (YAML text) without descriptions, ``source`` as its
    ``$comment``."""
    crd = yaml.safe_load(crd_text)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return {"$comment": source, **strip(version["schema"]["openAPIV3Schema"])}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} CRD.yaml SOURCE-NOTE")
    json.dump(vendor(Path(sys.argv[1]).read_text(), sys.argv[2]), sys.stdout, indent=1)
