"""What the deploy artefact tests read: the artefacts under deploy/ (Kubernetes manifests, compose,
Dockerfile, Grafana dashboard, Prometheus alerts) and the worker's documented contract
(docs/architecture.md: the metrics table and the configuration variables; docs/deploy.md: the
request topic partition count).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

from tests import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "alpamayo-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
DEPLOY_DOC = REPO_ROOT / "docs" / "deploy.md"

ARTEFACT_DIRS = ["docker", "compose", "k8s", "grafana", "prometheus"]


def artefact_files(*suffixes: str) -> list[Path]:
    out: list[Path] = []
    for d in ARTEFACT_DIRS:
        for suffix in suffixes:
            out.extend(sorted((DEPLOY / d).rglob(f"*{suffix}")))
    return out


@functools.lru_cache(maxsize=None)
def load_yaml_docs(path: Path) -> list[dict]:
    """Parsed documents of a YAML file (cached: callers must not mutate them)."""
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@functools.lru_cache(maxsize=None)
def k8s_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs.extend((path, d) for d in load_yaml_docs(path))
    return docs


def k8s_find(kind: str, name: str | None = None) -> list[dict]:
    return [d for _, d in k8s_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def k8s_one(kind: str, name: str | None = None) -> dict:
    found = k8s_find(kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def worker_deployment() -> dict:
    return k8s_one("Deployment", "alpamayo-worker")


def worker_container() -> dict:
    containers = worker_deployment()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per worker pod (one process per GPU)"
    return containers[0]


def worker_configmap() -> dict:
    refs = [e["configMapRef"]["name"] for e in worker_container().get("envFrom", []) if "configMapRef" in e]
    assert len(refs) == 1
    return k8s_one("ConfigMap", refs[0])


def compose() -> dict:
    return load_yaml_docs(COMPOSE)[0]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def duration_seconds(text: str | int) -> float:
    """Prometheus / compose durations: '15m', '1h30m', '90s', '10m0s', or plain seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


@functools.lru_cache(maxsize=None)
def exported_metrics() -> dict[str, dict]:
    """name -> {"type": ..., "labels": set} from the metrics table in docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Prometheus metrics exported by the worker", 1)[1].split("\n## ", 1)[0]
    metrics: dict[str, dict] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"`alpamayo_\w+`", cells[0]):
            continue
        labels_cell = re.sub(r"\([^)]*\)", "", cells[2])  # drop "(= `dflash2`)" and value lists
        metrics[cells[0].strip("`")] = {
            "type": cells[1].lower(),
            "labels": set(re.findall(r"`(\w+)`", labels_cell)),
        }
    return metrics


def documented_env_vars() -> set[str]:
    text = ARCHITECTURE.read_text()
    return set(re.findall(r"`((?:NIM|ALPAMAYO)_[A-Z0-9_]+)`", text))


def documented_partitions() -> int:
    match = re.search(r"request topic partitions\W+(\d+)", DEPLOY_DOC.read_text(), re.IGNORECASE)
    assert match, "docs/deploy.md must state the request topic partition count"
    return int(match.group(1))
