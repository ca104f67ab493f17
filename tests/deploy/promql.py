"""A small PromQL reader: which metrics and labels an expression of our dashboard and alert rules
uses, checked against the metrics the worker exports (docs/architecture.md)."""

from __future__ import annotations

import re

from tests.deploy.artefacts import exported_metrics

# Labels Prometheus / the Operator attach to every scraped series (not exported by the worker).
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}

_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "offset", "bool", "inf", "nan"}


def promql_usage(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """([(metric name, label names in its matchers)], grouping label names) of a PromQL expression.

    A deliberately small tokenizer, enough for the expressions in our artefacts: strings are
    blanked, selectors ``name{...}`` read, ranges/subqueries and grouping clauses removed; every
    remaining identifier that is not a function call or a keyword is a metric name.
    """
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    selectors: list[tuple[str, set[str]]] = []
    for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        selectors.append((name, set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))))
    bare_matchers = re.findall(r"(?<![\w:])\{([^}]*)\}", expr)
    assert not bare_matchers, f"selector without metric name in {expr!r}"
    grouping: set[str] = set()
    for _, labels in _GROUPING.findall(expr):
        grouping |= {label.strip() for label in labels.split(",") if label.strip()}
    stripped = re.sub(r"\{[^}]*\}", " ", expr)
    stripped = re.sub(r"\[[^\]]*\]", " ", stripped)
    stripped = _GROUPING.sub(" ", stripped)
    seen_with_matchers = {name for name, _ in selectors}
    for m in re.finditer(r"(?<![\w$.:])([a-zA-Z_:][\w:]*)", stripped):
        name = m.group(1)
        if name in _KEYWORDS or re.match(r"\s*\(", stripped[m.end():]):
            continue
        if name not in seen_with_matchers:
            selectors.append((name, set()))
    return selectors, grouping


def check_promql(expr: str, where: str) -> set[str]:
    """Assert every metric/label of ``expr`` is exported; return the exported base names used."""
    metrics = exported_metrics()
    all_labels = set().union(*(m["labels"] for m in metrics.values())) | TARGET_LABELS | {"le"}
    selectors, grouping = promql_usage(expr)
    assert selectors, f"{where}: no metric in {expr!r}"
    used = set()
    for name, labels in selectors:
        base, suffix = name, ""
        if name not in metrics:
            for sfx in ("_bucket", "_sum", "_count"):
                if name.endswith(sfx) and metrics.get(name[: -len(sfx)], {}).get("type") == "histogram":
                    base, suffix = name[: -len(sfx)], sfx
                    break
        assert base in metrics, f"{where}: metric {name!r} is not exported by the worker (docs/architecture.md)"
        allowed = metrics[base]["labels"] | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        assert labels <= allowed, f"{where}: {name} has no label(s) {sorted(labels - allowed)}"
        used.add(base)
    assert grouping <= all_labels, f"{where}: unknown grouping label(s) {sorted(grouping - all_labels)}"
    return used
