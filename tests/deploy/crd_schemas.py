"""Strict JSON schemas of the Prometheus Operator's custom resources the overlays render (``PodMonitor``,
``PrometheusRule``, monitoring.coreos.com/v1), which ``kubernetes-validate`` has no schema for.

Written from the operator's API reference for the fields a manifest here may set, and strict the way
``kubernetes-validate --strict`` is: an unknown or misspelt field is an error (the API server would prune it
silently, so the alert or the scrape setting would just not exist). A field this project starts to use is added
here with its type.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from tests.deploy.cnpg_schemas import CNPG_SCHEMAS

DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
"""A Prometheus duration (``30s``, ``1h30m``)."""
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_METADATA = _strict({"name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"},
                     "labels": STRING_MAP, "annotations": STRING_MAP}, ("name",))
_LABEL_SELECTOR = _strict({
    "matchLabels": STRING_MAP,
    "matchExpressions": {"type": "array", "items": _strict({
        "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": {"type": "array", "items": {"type": "string"}}}, ("key", "operator"))},
})
_RELABEL = _strict({
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
    "separator": {"type": "string"},
    "targetLabel": {"type": "string"},
    "regex": {"type": "string"},
    "modulus": {"type": "integer", "minimum": 0},
    "replacement": {"type": "string"},
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap",
                        "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase",
                        "uppercase", "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
})
_SECRET_KEY = _strict({"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
                      ("key",))
_POD_METRICS_ENDPOINT = _strict({
    "port": {"type": "string", "minLength": 1},
    "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
    "path": {"type": "string"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "params": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "filterRunning": {"type": "boolean"},
    "followRedirects": {"type": "boolean"},
    "enableHttp2": {"type": "boolean"},
    "relabelings": {"type": "array", "items": _RELABEL},
    "metricRelabelings": {"type": "array", "items": _RELABEL},
    "authorization": _strict({"type": {"type": "string"}, "credentials": _SECRET_KEY}),
    "bearerTokenSecret": _SECRET_KEY,
})
_POD_MONITOR = _strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PodMonitor"},
    "metadata": _METADATA,
    "spec": _strict({
        "selector": _LABEL_SELECTOR,
        "namespaceSelector": _strict({"any": {"type": "boolean"},
                                      "matchNames": {"type": "array", "items": {"type": "string"}}}),
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _POD_METRICS_ENDPOINT},
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "sampleLimit": {"type": "integer", "minimum": 0},
        "targetLimit": {"type": "integer", "minimum": 0},
        "labelLimit": {"type": "integer", "minimum": 0},
    }, ("selector",)),
}, ("apiVersion", "kind", "metadata", "spec"))

_RULE = {
    **_strict({
        "record": {"type": "string", "minLength": 1},
        "alert": {"type": "string", "minLength": 1},
        "expr": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    }, ("expr",)),
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
_PROMETHEUS_RULE = _strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PrometheusRule"},
    "metadata": _METADATA,
    "spec": _strict({
        "groups": {"type": "array", "items": _strict({
            "name": {"type": "string", "minLength": 1},
            "interval": DURATION,
            "query_offset": DURATION,
            "limit": {"type": "integer", "minimum": 0},
            "partial_response_strategy": {"type": "string"},
            "labels": STRING_MAP,
            "rules": {"type": "array", "items": _RULE},
        }, ("name",))},
    }),
}, ("apiVersion", "kind", "metadata", "spec"))

CRD_SCHEMAS: dict[str, dict[str, Any]] = {"PodMonitor": _POD_MONITOR, "PrometheusRule": _PROMETHEUS_RULE,
                                           **CNPG_SCHEMAS}  # CloudNativePG's, from its CRDs (cnpg_schemas.py)
"""Kind -> its strict schema (the kinds the overlays may render without a Kubernetes schema, besides KEDA's)."""


def validate_custom(obj: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when ``obj`` (a rendered object of a kind in ``CRD_SCHEMAS``) does not
    fit its schema."""
    jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]], cls=jsonschema.Draft202012Validator)
