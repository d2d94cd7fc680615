"""The Grafana dashboard and the Prometheus alerts of deploy/k8s/components/observability, checked offline: every
PromQL expression parses and names only metrics the services register (built with their own metric factories),
the dashboard covers every panel docs/observability.md lists and reads its data source from ``${datasource}``, the
alerts carry ``for``, a severity, a summary, a description and a runbook section that exists, ``promtool check
rules`` accepts them and ``promtool test rules`` shows each firing when it should and quiet otherwise, and the prod
overlay wires all of it (the dashboard ConfigMap for Grafana's sidecar, the PrometheusRule, the PodMonitor)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from rollout_ledger.services import catalog
from rollout_ledger.services.env_worker.metrics import build_metrics
from rollout_ledger.services.exporter.metrics import ExportMetrics
from rollout_ledger.services.inference_worker.metrics import InferenceMetrics
from rollout_ledger.services.recorder.metrics import RecorderMetrics
from rollout_ledger.services.scheduler.metrics import create_metrics
from rollout_ledger.shared import deploy
from rollout_ledger.shared.kit.runtime import Health, ops_app
from tests.deploy.crd_schemas import validate_custom
from tests.deploy.manifests import K8S, ROOT, Rendered, render

COMPONENT = K8S / "components" / "observability"
DASHBOARD = COMPONENT / "rollout-ledger-dashboard.json"
RULES = COMPONENT / "prometheusrule.yaml"
PODMONITOR = COMPONENT / "podmonitor.yaml"
PROMTOOL_TESTS = Path(__file__).parent / "promtool" / "alerts.test.yaml"
DOC = ROOT / "docs" / "observability.md"

ALERTS = {"RolloutRecorderLag", "RolloutDeadLettersRising", "RolloutConsumerLag", "RolloutWorkersNotReady",
          "RolloutAdmissionStalled"}
"""The alerts the issue asks for (one name may hold several rules)."""
PANELS = {
    "turns/s": {"rollout_events_processed_total"},
    "tokens/s": {"rollout_generated_tokens_total"},
    "queue lag per env route": {"rollout_work_queue_waiting"},
    "recorder lag": {"rollout_recorder_lag_seconds"},
    "dead letters": {"rollout_dead_letters_total"},
    "failures by class": {"rollout_attempt_failures_total"},
    "prefix-cache hit rate": {"rollout_cached_tokens_total", "rollout_prompt_tokens_total"},
    "versions served": {"rollout_weight_version"},
    "staleness": {"rollout_policy_staleness_versions"},
    "admission stalled": {"rollout_admission_stalled_seconds"},
    "workers ready": {"rollout_ready"},
}
"""What the dashboard must show -> the metrics one of its panels must read (all of them in one panel)."""
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
"""Grafana's built-in variables in an expression, with a value PromQL accepts."""


def registered_metric_names() -> set[str]:
    """Every sample name the services can export: their factories' registries (plus ``rollout_ready``, added by
    ``ops_app``), counters as ``_total``/``_created``, histograms as ``_bucket``/``_sum``/``_count``/``_created``."""
    registries = [create_metrics().registry, build_metrics().registry, InferenceMetrics.create().registry,
                  RecorderMetrics.create().registry, ExportMetrics.create("c").registry]
    names: set[str] = set()
    for registry in registries:
        ops_app("x", Health(), registry)
        names |= _sample_names(registry)
    return names


def _sample_names(registry: CollectorRegistry) -> set[str]:
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
                "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "unknown": ("",)}
    return {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana's variables (``$name``, ``${name}``, ``[[name]]``) replaced by sample values."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    for name, value in variables.items():
        expr = re.sub(r"\$\{" + name + r"(:[a-z]+)?\}|\$" + name + r"\b|\[\[" + name + r"\]\]", value, expr)
    assert "$" not in expr, f"an unknown variable in {expr!r}"
    return expr


def selected_metrics(expr: str) -> set[str]:
    """Metric names of every vector selector in ``expr`` (ValueError when it does not parse)."""
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def sample_values(dash: dict[str, Any]) -> dict[str, str]:
    return {name: "x" for name in variables(dash)}


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash["panels"]:
        out += [panel, *panel.get("panels", [])]
    return [p for p in out if p["type"] != "row"]


def rule_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES.read_text())["spec"]["groups"])


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


# --- the dashboard -------------------------------------------------------------------------------------------------


def test_dashboard_reads_the_data_source_variable() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"]
    found = variables(dash)
    assert found["datasource"]["type"] == "datasource" and found["datasource"]["query"] == "prometheus"
    assert {"namespace", "route"} <= set(found)
    for name in ("namespace", "route"):
        assert found[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, name
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dash):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert 'namespace=~"$namespace"' in target["expr"], f"{panel['title']}: follow the namespace variable"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_dashboard_query_parses_and_names_registered_metrics() -> None:
    dash = dashboard()
    known = registered_metric_names()
    values = sample_values(dash)
    exprs = [t["expr"] for p in panels(dash) for t in p["targets"]]
    for var in variables(dash).values():
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert inner is not None, var["query"]
            exprs.append(inner.group(1))
    assert exprs
    for expr in exprs:
        names = selected_metrics(substitute(expr, values))
        assert names, expr
        assert names <= known, f"{expr!r} reads {sorted(names - known)}, which no service registers"


def test_dashboard_has_a_panel_for_each_asked_item() -> None:
    per_panel = [(p["title"], set().union(*(selected_metrics(substitute(t["expr"], sample_values(dashboard())))
                                            for t in p["targets"]))) for p in panels(dashboard())]
    for item, metrics in PANELS.items():
        assert any(metrics <= names for _, names in per_panel), f"no panel shows {item} ({sorted(metrics)})"


def test_a_query_naming_an_unregistered_metric_is_caught() -> None:
    assert selected_metrics('sum(rate(rollout_no_such_metric_total{namespace=~"x"}[5m]))') - registered_metric_names()
    with pytest.raises(ValueError):
        selected_metrics("sum(rate(rollout_ready[$__rate_interval]))")  # an unsubstituted variable does not parse


# --- the alerts ----------------------------------------------------------------------------------------------------


def test_the_asked_alerts_are_complete() -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == ALERTS
    doc = DOC.read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", doc, flags=re.MULTILINE)}
    known = registered_metric_names()
    for rule in rules:
        name = rule["alert"]
        assert rule.get("for"), f"{name}: a `for:` so a blip does not page"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], name
        path, _, anchor = annotations["runbook_url"].partition("#")
        assert path == "docs/observability.md" and anchor == f"runbook-{name.lower()}", name
        assert anchor in anchors, f"{name}: docs/observability.md has no section #{anchor}"
        names = selected_metrics(rule["expr"])
        assert names and names <= known, f"{name} reads {sorted(names - known)}, which no service registers"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def promtool() -> str:
    """Debian's promtool (package ``prometheus``; .ci/run installs it). Required: without it the promtool tests
    fail, saying how to install it."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    pytest.fail("promtool is not installed: apt-get install --no-install-recommends prometheus (see .ci/run); the "
                "alert rule tests need it")


def _rules_file(directory: Path) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    return path


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    proc = subprocess.run([promtool(), "check", "rules", "--lint=all", "--lint-fatal", str(_rules_file(tmp_path))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in proc.stdout


def test_each_alert_fires_when_it_should_and_stays_quiet_otherwise(tmp_path: Path) -> None:
    _rules_file(tmp_path)
    cases = yaml.safe_load(PROMTOOL_TESTS.read_text())
    tested = {t["alertname"] for case in cases["tests"] for t in case["alert_rule_test"]}
    assert tested == ALERTS, "a promtool case for every alert"
    for case in cases["tests"]:
        checks = case["alert_rule_test"]
        assert any(c["exp_alerts"] for c in checks) and any(not c["exp_alerts"] for c in checks), (
            f"{checks[0]['alertname']}: a case where it fires and one where it stays quiet")
    shutil.copy(PROMTOOL_TESTS, tmp_path / PROMTOOL_TESTS.name)
    proc = subprocess.run([promtool(), "test", "rules", PROMTOOL_TESTS.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_test_catches_a_broken_alert(tmp_path: Path) -> None:
    """The promtool cases are not vacuous: an alert whose threshold moved fails them."""
    groups = copy.deepcopy(rule_groups())
    for rule in groups[0]["rules"]:
        if rule.get("alert") == "RolloutRecorderLag":
            rule["expr"] = rule["expr"].replace("> 120", "> 600")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(PROMTOOL_TESTS, tmp_path / PROMTOOL_TESTS.name)
    proc = subprocess.run([promtool(), "test", "rules", PROMTOOL_TESTS.name], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "RolloutRecorderLag" in proc.stdout + proc.stderr


# --- wiring in the prod overlay ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prod() -> Rendered:
    return render("prod")


def test_prod_ships_the_dashboard_rules_and_scrape_config(prod: Rendered) -> None:
    cm = prod.get("ConfigMap", "rollout-ledger-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"][DASHBOARD.name]) == dashboard()
    rule = prod.get("PrometheusRule", "rollout-ledger")
    assert rule["spec"]["groups"] == rule_groups()
    assert rule["metadata"]["namespace"] == prod.get("Deployment", "scheduler")["metadata"]["namespace"]
    monitor = prod.get("PodMonitor", "rollout-ledger")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == deploy.METRICS_PATH
    selected = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    for name, workload in catalog.WORKLOADS.items():
        if not workload.serves_http or not prod.has("Deployment", name):
            continue
        assert name in selected, f"the PodMonitor does not scrape {name}"
        ports = {p["name"]: p["containerPort"] for p in prod.container(name).spec["ports"]}
        assert ports.get(endpoint["port"]) == deploy.HTTP_PORT, name
    relabel = endpoint["relabelings"][0]
    assert relabel["targetLabel"] == "workload", "the dashboard groups rollout_ready by workload"
    admitted = prod.get("NetworkPolicy", "metrics")["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert selected <= set(admitted), "the NetworkPolicy metrics lets Prometheus reach every pod it scrapes"


def test_dev_runs_without_the_monitoring_crds() -> None:
    dev = render("dev")
    assert not dev.of_kind("PodMonitor") and not dev.of_kind("PrometheusRule"), "dev needs no Prometheus Operator"


def test_the_strict_monitoring_schemas_refuse_a_misspelt_field() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    validate_custom(monitor)
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(monitor)
    rule = yaml.safe_load(RULES.read_text())
    validate_custom(rule)
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(rule)
