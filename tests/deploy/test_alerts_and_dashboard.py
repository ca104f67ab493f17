"""Prometheus alert rules (deploy/prometheus, mirrored by the PrometheusRule) and the Grafana
dashboard (deploy/grafana): every metric and label they use is exported by the worker, the
required alerts and panels are there, the dashboard covers every exported metric."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from tests.deploy.artefacts import ALERTS, DASHBOARD, alert_rules, duration_seconds, exported_metrics, k8s_one
from tests.deploy.manifest_schemas import RULE_FILE_SCHEMA
from tests.deploy.promql import check_promql, promql_usage


def test_promql_checker_rejects_unknown_names():
    sel, grouping = promql_usage(
        'sum by (task) (rate(alpamayo_results_total{task="vqa", instance=~"$i"}[5m])) / up'
        ' and on (job) histogram_quantile(0.9, rate(alpamayo_batch_size_bucket[1m])) > 1e3'
    )
    assert sorted(n for n, _ in sel) == ["alpamayo_batch_size_bucket", "alpamayo_results_total", "up"]
    assert dict(sel)["alpamayo_results_total"] == {"task", "instance"}
    assert grouping == {"task", "job"}
    with pytest.raises(AssertionError, match="not exported"):
        check_promql("rate(alpamayo_results_total[5m]) / up", "self-test")
    with pytest.raises(AssertionError, match="no label"):
        check_promql('alpamayo_queue_depth{task="x"}', "self-test")
    with pytest.raises(AssertionError, match="not exported"):
        check_promql("alpamayo_queue_depth_bucket", "self-test")  # a gauge has no buckets
    with pytest.raises(AssertionError, match="grouping"):
        check_promql("sum by (tsk) (alpamayo_results_total)", "self-test")
    assert check_promql("alpamayo_stage_latency_seconds_count", "self-test") == {"alpamayo_stage_latency_seconds"}


def test_alert_rule_file_schema():
    jsonschema.Draft202012Validator(RULE_FILE_SCHEMA).validate(yaml.safe_load(ALERTS.read_text()))


def test_prometheusrule_mirrors_alert_file():
    assert k8s_one("PrometheusRule")["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_alert_metrics_are_exported():
    used = set()
    for rule in alert_rules():
        used |= check_promql(rule["expr"], f"alert {rule.get('alert')}")
    assert {"alpamayo_spec_decode_accepted_tokens_total", "alpamayo_spec_decode_draft_tokens_total",
            "alpamayo_consumer_lag", "alpamayo_dead_letters_total", "alpamayo_requests_total",
            "alpamayo_ready"} <= used


def test_required_alerts_present():
    rules = {r["alert"]: r for r in alert_rules()}
    required = {  # alert -> (metrics it must use, minimum "for")
        "AlpamayoSpecAcceptanceCollapse": ({"alpamayo_spec_decode_accepted_tokens_total",
                                            "alpamayo_spec_decode_draft_tokens_total"}, 15 * 60),
        "AlpamayoConsumerLagGrowing": ({"alpamayo_consumer_lag"}, 5 * 60),
        "AlpamayoDeadLetterRateHigh": ({"alpamayo_dead_letters_total", "alpamayo_requests_total"}, 10 * 60),
        "AlpamayoWorkerNotReady": ({"alpamayo_ready"}, 10 * 60),
        "AlpamayoWorkerMetricsAbsent": ({"alpamayo_ready"}, 5 * 60),
    }
    for name, (metrics, min_for) in required.items():
        assert name in rules, name
        rule = rules[name]
        assert metrics <= check_promql(rule["expr"], name)
        assert duration_seconds(rule["for"]) >= min_for, name
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert "< 0.2" in rules["AlpamayoSpecAcceptanceCollapse"]["expr"]
    assert "> 0.05" in rules["AlpamayoDeadLetterRateHigh"]["expr"]
    assert "deriv(" in rules["AlpamayoConsumerLagGrowing"]["expr"]
    assert "absent(alpamayo_ready)" in rules["AlpamayoWorkerMetricsAbsent"]["expr"]


def dashboard_panels() -> list[dict]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in dashboard_panels():
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]


def test_dashboard_metrics_are_exported_and_all_covered():
    used = set()
    for p in dashboard_panels():
        for t in p.get("targets", []):
            used |= check_promql(t["expr"], f"panel {p['title']!r}")
    dash = json.loads(DASHBOARD.read_text())
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            metric = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            assert metric, query
            used |= check_promql(metric.group(1), f"variable {v['name']}")
    missing = set(exported_metrics()) - used
    assert not missing, f"dashboard has no panel for {sorted(missing)}"


def test_dashboard_required_panels():
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dashboard_panels() if p["type"] != "row"}

    def panel(*needles):
        hits = [t for t, e in exprs.items() if all(n in e for n in needles)]
        assert hits, f"no panel whose expressions contain {needles}"

    panel("rate(alpamayo_spec_decode_accepted_tokens_total", "/", "rate(alpamayo_spec_decode_draft_tokens_total")
    panel("1 +", "rate(alpamayo_spec_decode_accepted_tokens_total", "rate(alpamayo_spec_decode_verify_steps_total")
    panel("histogram_quantile(0.50", "histogram_quantile(0.95", "alpamayo_stage_latency_seconds_bucket",
          'stage="total"', "task")
    panel("sum by (task) (rate(alpamayo_results_total")
    panel("alpamayo_consumer_lag")
    panel("sum by (code) (rate(alpamayo_dead_letters_total")
    panel("alpamayo_batch_size")
    panel("alpamayo_queue_depth")
    panel("alpamayo_gpu_memory_bytes")
    panel("alpamayo_ready")
