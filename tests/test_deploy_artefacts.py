"""Static checks of the deployment artefacts under deploy/ (fast, offline, no Docker, no cluster).

- every YAML/JSON artefact parses;
- Kubernetes manifests of built-in kinds validate (strict: unknown fields fail) against the
  OpenAPI-derived JSON schemas bundled in ``kubernetes-validate``; the CRD kinds (KEDA
  ScaledObject/TriggerAuthentication, Prometheus Operator ServiceMonitor/PrometheusRule) against
  the small hand-written schemas below; references between manifests resolve;
- compose: images set or built, named volumes declared, depends_on targets exist, one GPU;
- every metric (and label) used by the Grafana dashboard and the alert rules is exported by the
  worker, read from the metrics table of docs/architecture.md;
- Dockerfile: non-root USER, HEALTHCHECK on /v1/health/ready, ENTRYPOINT alpamayo-worker serve;
- termination grace >= drain timeout; KEDA maxReplicaCount <= documented partition count.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "alpamayo-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ARCHITECTURE = REPO / "docs" / "architecture.md"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

ARTEFACT_DIRS = ["docker", "compose", "k8s", "grafana", "prometheus"]

# Oldest Kubernetes minor we support, and the newest schema set the validator bundles.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]

# Labels Prometheus / the Operator attach to every scraped series (not exported by the worker).
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}

# Environment variables our artefacts may set beyond the documented worker configuration.
EXTRA_ENV = {
    "ALPAMAYO_CACHE",  # cache dir of the embedded demo checkpoint (worker/config.py)
}

CRD_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}


# ----------------------------------------------------------------------------- helpers


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


def duration_seconds(text: str | int) -> float:
    """Prometheus / compose durations: '15m', '1h30m', '90s', '10m0s', or plain seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ------------------------------------------------------------ the worker's documented contract


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


def test_architecture_tables_parse():
    metrics = exported_metrics()
    assert len(metrics) >= 13, sorted(metrics)
    assert metrics["alpamayo_stage_latency_seconds"]["type"] == "histogram"
    assert metrics["alpamayo_stage_latency_seconds"]["labels"] == {"stage", "task"}
    assert metrics["alpamayo_consumer_lag"]["labels"] == {"topic", "partition"}
    env = documented_env_vars()
    assert {"ALPAMAYO_DRAIN_TIMEOUT_S", "ALPAMAYO_GROUP_INSTANCE_ID", "NIM_MODEL_PROFILE"} <= env


# ------------------------------------------------------------------------------ PromQL


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


# ---------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("path", artefact_files(".yaml", ".yml"), ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_artefact_parses(path: Path):
    assert load_yaml_docs(path), f"{path} is empty"


@pytest.mark.parametrize("path", artefact_files(".json"), ids=lambda p: str(p.relative_to(REPO)))
def test_json_artefact_parses(path: Path):
    json.loads(path.read_text())


def test_expected_artefacts_exist():
    for path in [DOCKERFILE, COMPOSE, DASHBOARD, ALERTS, DEPLOY_DOC, DEPLOY / "compose" / "prometheus.yml",
                 K8S / "kustomization.yaml"]:
        assert path.is_file(), path
    assert (REPO / ".dockerignore").is_file() or (DEPLOY / "docker" / ".dockerignore").is_file()


# ------------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_builtin_kinds_validate_against_schema(version: str):
    validated = 0
    for path, doc in k8s_docs():
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
        validated += 1
    assert validated >= 7  # Namespace ConfigMap Secret PVC Deployment Service PDB


def test_k8s_validator_is_strict_and_offline():
    """The bundled schemas reject an unknown field (a typo must not pass silently)."""
    doc = json.loads(json.dumps(worker_deployment()))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_every_k8s_kind_is_known_and_namespaced():
    for path, doc in k8s_docs():
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)  # SchemaNotFoundError
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "alpamayo", f"{path.name}: {doc['kind']} namespace"


_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
    "namespace": {"type": "string"}, "labels": _STR_MAP, "annotations": _STR_MAP}}
_DURATION = {"type": "string", "pattern": r"^((\d+)(ms|s|m|h|d|w))+$"}

CRD_SCHEMAS = {
    "ScaledObject": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "scalingModifiers": {"type": "object"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "name": {"type": "string"},
                            "behavior": {"type": "object", "additionalProperties": False,
                                         "properties": {"scaleUp": {"$ref": "#/$defs/rules"},
                                                        "scaleDown": {"$ref": "#/$defs/rules"}}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"},
                        "metadata": _STR_MAP, "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {"type": "object", "required": ["name"],
                                              "properties": {"name": {"type": "string"},
                                                             "kind": {"enum": ["TriggerAuthentication",
                                                                               "ClusterTriggerAuthentication"]}}}},
                    "if": {"properties": {"type": {"const": "kafka"}}},
                    "then": {"properties": {"metadata": {
                        "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold",
                                     "activationLagThreshold"],
                        "properties": {"lagThreshold": {"pattern": r"^[1-9]\d*$"},
                                       "activationLagThreshold": {"pattern": r"^\d+$"},
                                       "allowIdleConsumers": {"enum": ["true", "false"]},
                                       "offsetResetPolicy": {"enum": ["earliest", "latest"]}}}}}}}}}},
        "$defs": {"rules": {"type": "object", "additionalProperties": False, "properties": {
            "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
            "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
            "policies": {"type": "array", "items": {
                "type": "object", "required": ["type", "value", "periodSeconds"], "additionalProperties": False,
                "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                               "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}}}}},
    },
    "TriggerAuthentication": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "minProperties": 1,
            "properties": {"secretTargetRef": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                               "key": {"type": "string"}}}}}}}},
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": _STR_MAP}},
                "namespaceSelector": {"type": "object"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                   "interval": _DURATION, "scrapeTimeout": _DURATION}}}}}}},
    "PrometheusRule": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "required": ["groups"], "additionalProperties": False,
            "properties": {"groups": {"$ref": "#/$defs/groups"}}}},
        "$defs": {},  # filled below with the rule-file schema
    },
}

RULE_FILE_SCHEMA = {
    "type": "object", "required": ["groups"], "additionalProperties": False,
    "properties": {"groups": {"$ref": "#/$defs/groups"}},
    "$defs": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "interval": _DURATION, "rules": {
            "type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["expr"], "additionalProperties": False,
                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                "properties": {"alert": {"type": "string", "pattern": r"^[A-Za-z_]\w*$"},
                               "record": {"type": "string"}, "expr": {"type": "string", "minLength": 1},
                               "for": _DURATION, "keep_firing_for": _DURATION,
                               "labels": _STR_MAP, "annotations": _STR_MAP}}}}}}},
}
CRD_SCHEMAS["PrometheusRule"]["$defs"] = RULE_FILE_SCHEMA["$defs"]


@pytest.mark.parametrize("kind", sorted(CRD_SCHEMAS))
def test_k8s_crd_kinds_validate_against_handwritten_schema(kind: str):
    docs = k8s_find(kind)
    assert docs, f"no {kind} in deploy/k8s"
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) in CRD_KINDS
        jsonschema.Draft202012Validator(CRD_SCHEMAS[kind]).validate(doc)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    images = {i["name"] for i in kustomization.get("images", [])}
    assert worker_container()["image"].split(":")[0] in images


def test_deployment_gpu_probes_and_identity():
    dep = worker_deployment()
    assert "replicas" not in dep["spec"], "KEDA owns the replica count; re-applying must not reset it"
    pod = dep["spec"]["template"]["spec"]
    c = worker_container()
    # one GPU per pod, never more
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(c["resources"].get("requests", {}).get("nvidia.com/gpu", "1")) == "1"
    # probes on the side port
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    cm = worker_configmap()["data"]
    http_port = int(cm.get("ALPAMAYO_HTTP_PORT", "8000"))
    assert http_port == 8000

    def probe_port(probe):
        port = probe["httpGet"]["port"]
        return ports[port] if isinstance(port, str) else port

    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v1/health/live"
    for name in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert probe_port(c[name]) == http_port, name
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 900, "slow model load needs >= 15 min"
    # static membership id from the pod name (downward API)
    env = {e["name"]: e for e in c["env"]}
    assert env["ALPAMAYO_GROUP_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # non-root
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0


def test_deployment_grace_period_covers_drain_timeout():
    pod = worker_deployment()["spec"]["template"]["spec"]
    drain = float(worker_configmap()["data"].get("ALPAMAYO_DRAIN_TIMEOUT_S", "60"))
    assert pod["terminationGracePeriodSeconds"] >= drain + 15


def test_deployment_config_and_secret_references_resolve():
    c = worker_container()
    secret = k8s_one("Secret", "alpamayo-kafka-credentials")
    secret_keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    env = {e["name"]: e for e in c["env"]}
    for name in ("ALPAMAYO_KAFKA_SASL_USERNAME", "ALPAMAYO_KAFKA_SASL_PASSWORD"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret_keys
    # credentials only from the Secret, never from the ConfigMap
    cm = worker_configmap()["data"]
    assert not {"ALPAMAYO_KAFKA_SASL_USERNAME", "ALPAMAYO_KAFKA_SASL_PASSWORD"} & set(cm)
    # placeholders are clearly marked
    for key in ("username", "password", "ca.crt"):
        assert "REPLACE_ME" in secret["stringData"][key]
    # volumes
    pod = worker_deployment()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) <= set(volumes)
    models = volumes["models"]["persistentVolumeClaim"]
    assert models["readOnly"] is True and mounts["models"]["readOnly"] is True
    assert k8s_one("PersistentVolumeClaim", models["claimName"])
    for v in volumes.values():
        if "secret" in v:
            assert v["secret"]["secretName"] == secret["metadata"]["name"]
            assert {i["key"] for i in v["secret"].get("items", [])} <= secret_keys
    # the CA file path in the ConfigMap lies in the mounted secret
    ca = cm.get("ALPAMAYO_KAFKA_SSL_CAFILE")
    if ca:
        assert ca.startswith(mounts["kafka-ca"]["mountPath"] + "/")
    # model paths lie in the read-only model volume
    for key in ("NIM_FT_CHECKPOINT", "NIM_ALPAMAYO_SPECULATIVE_MODEL"):
        if cm.get(key):
            assert cm[key].startswith(mounts["models"]["mountPath"] + "/")


def _check_model_env(env: dict, where: str):
    set_ = {k for k, v in env.items() if v not in (None, "")}
    assert not {"NIM_FT_CHECKPOINT", "NIM_ALPAMAYO_SPECULATIVE_MODEL"} <= set_, \
        f"{where}: NIM_FT_CHECKPOINT and NIM_ALPAMAYO_SPECULATIVE_MODEL cannot be combined"
    assert not {"NIM_PRECISION", "NIM_MODEL_PROFILE"} <= set_, f"{where}: NIM_PRECISION with NIM_MODEL_PROFILE"
    profile = str(env.get("NIM_MODEL_PROFILE") or "")
    if profile and not profile.startswith("$"):
        assert profile in {"bf16", "fp8", "bf16-dflash2", "fp8-dflash2"}, f"{where}: {profile}"
        if "NIM_ALPAMAYO_SPECULATIVE_MODEL" in set_:
            assert profile.endswith("-dflash2"), f"{where}: custom head needs a dflash2 profile"


def test_configured_env_vars_are_documented():
    documented = documented_env_vars() | EXTRA_ENV
    sources: dict[str, set[str]] = {
        "configmap": set(worker_configmap()["data"]),
        "deployment": {e["name"] for e in worker_container()["env"]},
    }
    for name, svc in compose()["services"].items():
        sources[f"compose:{name}"] = set(svc.get("environment") or {})
    sources["Dockerfile"] = set(re.findall(r"\b((?:NIM|ALPAMAYO)_[A-Z0-9_]+)=", DOCKERFILE.read_text()))
    for where, names in sources.items():
        ours = {n for n in names if n.startswith(("NIM_", "ALPAMAYO_"))}
        assert ours <= documented, f"{where}: undocumented variable(s) {sorted(ours - documented)}"
    _check_model_env(worker_configmap()["data"], "configmap")
    _check_model_env(compose()["services"]["worker"]["environment"], "compose worker")


def test_service_servicemonitor_pdb_select_the_worker():
    pod_labels = worker_deployment()["spec"]["template"]["metadata"]["labels"]
    assert worker_deployment()["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = k8s_one("Service", "alpamayo-worker-metrics")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    sm = k8s_one("ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports
        assert ep["path"] in ("/v1/metrics", "/metrics")
        assert ports[ep["port"]]["port"] == 8000
    pdb = k8s_one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    annotations = worker_deployment()["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/path" in annotations:
        assert annotations["prometheus.io/path"] == "/v1/metrics"


def documented_partitions() -> int:
    match = re.search(r"request topic partitions\W+(\d+)", DEPLOY_DOC.read_text(), re.IGNORECASE)
    assert match, "docs/deploy.md must state the request topic partition count"
    return int(match.group(1))


def test_keda_scaled_object():
    so = k8s_one("ScaledObject")
    spec = so["spec"]
    dep = worker_deployment()
    assert spec["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    partitions = int(so["metadata"]["annotations"]["alpamayo/request-topic-partitions"])
    assert partitions == documented_partitions()
    assert 1 <= spec["maxReplicaCount"] <= partitions
    assert spec.get("minReplicaCount", 0) <= spec["maxReplicaCount"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 600
    cm = worker_configmap()["data"]
    kafka = [t for t in spec["triggers"] if t["type"] == "kafka"]
    assert len(kafka) == 1
    meta = kafka[0]["metadata"]
    assert meta["consumerGroup"] == cm["ALPAMAYO_GROUP_ID"]
    assert meta["topic"] == cm["ALPAMAYO_REQUEST_TOPIC"]
    assert meta["bootstrapServers"] == cm["ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS"]
    assert meta.get("allowIdleConsumers", "false") == "false"
    assert so["metadata"]["annotations"]["alpamayo/request-topic"] == meta["topic"]
    # SASL through a TriggerAuthentication that reads the same Secret as the worker
    auth = k8s_one("TriggerAuthentication", kafka[0]["authenticationRef"]["name"])
    secret = k8s_one("Secret", "alpamayo-kafka-credentials")
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert {"sasl", "username", "password"} <= set(refs)
    for ref in refs.values():
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    mechanism = {"SCRAM-SHA-512": "scram_sha512", "SCRAM-SHA-256": "scram_sha256", "PLAIN": "plaintext"}
    assert secret["stringData"][refs["sasl"]["key"]] == mechanism[cm["ALPAMAYO_KAFKA_SASL_MECHANISM"]]
    if cm.get("ALPAMAYO_KAFKA_SECURITY_PROTOCOL") == "SASL_SSL":
        assert secret["stringData"][refs["tls"]["key"]] == "enable"


def test_compose_topic_partitions_match_documentation():
    cmd = compose()["services"]["topics"]["command"]
    assert cmd[:2] == ["topics", "create"]
    assert int(cmd[cmd.index("--partitions") + 1]) == documented_partitions()


# ---------------------------------------------------------------------------- alerts/dashboard


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


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


# ------------------------------------------------------------------------------------ compose


def _volume_source(entry) -> tuple[str, str]:
    """(source, type) of a service volume entry; type is 'volume' for named volumes."""
    if isinstance(entry, dict):
        return entry.get("source", ""), entry.get("type", "volume")
    if entry.startswith("${"):
        end = entry.index("}")
        return entry[: end + 1], "bind"
    source = entry.split(":")[0]
    if ":" not in entry:
        return "", "anonymous"
    return source, ("bind" if source.startswith((".", "/", "~")) else "volume")


def test_compose_services_images_volumes_dependencies():
    doc = compose()
    services = doc["services"]
    declared_volumes = set(doc.get("volumes") or {})
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"{name}: no image and no build"
        if "build" in svc:
            build = svc["build"]
            context = COMPOSE.parent / (build["context"] if isinstance(build, dict) else build)
            assert context.resolve() == REPO, f"{name}: build context must be the repo root"
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
        for entry in svc.get("volumes", []):
            source, kind = _volume_source(entry)
            if kind == "volume":
                assert source in declared_volumes, f"{name}: volume {source!r} not declared"
            elif kind == "bind" and not source.startswith("$"):
                assert (COMPOSE.parent / source).exists(), f"{name}: bind source {source} missing"
        deps = svc.get("depends_on") or []
        for dep in deps:
            assert dep in services, f"{name}: depends_on {dep!r} undefined"
        if isinstance(deps, dict):
            for dep, cond in deps.items():
                assert cond.get("condition") in {"service_started", "service_healthy",
                                                 "service_completed_successfully"}
                if cond.get("condition") == "service_healthy":
                    assert services[dep].get("healthcheck", {}).get("test"), f"{dep} has no healthcheck"
    used = {(_volume_source(e)[0]) for s in services.values() for e in s.get("volumes", [])}
    assert declared_volumes <= used, f"declared but unused volumes {sorted(declared_volumes - used)}"


def test_compose_one_gpu_worker():
    services = compose()["services"]
    gpu_services = {}
    for name, svc in services.items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        for dev in devices:
            if "gpu" in dev.get("capabilities", []):
                gpu_services[name] = dev
        assert "gpus" not in svc, f"{name}: use deploy.resources.reservations.devices"
        assert svc.get("runtime") != "nvidia" or name == "worker"
    assert set(gpu_services) == {"worker"}
    assert gpu_services["worker"]["count"] == 1
    worker = services["worker"]
    assert "entrypoint" not in worker and "command" not in worker, "worker runs the image ENTRYPOINT"
    drain = float(worker["environment"].get("ALPAMAYO_DRAIN_TIMEOUT_S", 60))
    assert duration_seconds(worker["stop_grace_period"]) >= drain + 15


def test_compose_kafka_topics_sink_monitoring():
    services = compose()["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert set(kafka["environment"]["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    bootstrap = services["worker"]["environment"]["ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS"]
    assert bootstrap.split(":")[0] in services
    assert services["topics"]["entrypoint"] == ["alpamayo-producer"]
    assert services["topics"].get("restart") == "no"
    assert services["sink"]["entrypoint"] == ["alpamayo-producer"]
    assert services["sink"]["command"][0] == "sink"
    sink_volumes = [_volume_source(v) for v in services["sink"]["volumes"]]
    assert any(kind == "volume" for _, kind in sink_volumes), "sink writes to a named volume"
    # both one-shot/sink containers must not inherit the worker's readiness HEALTHCHECK
    for name in ("topics", "sink"):
        assert services[name]["healthcheck"].get("disable") is True
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana")


def test_compose_prometheus_scrapes_worker_and_loads_alerts():
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    worker_job = jobs["alpamayo-worker"]
    assert worker_job["metrics_path"] == "/v1/metrics"
    targets = [t for sc in worker_job["static_configs"] for t in sc["targets"]]
    assert "worker:8000" in targets
    mounts = {}
    for entry in compose()["services"]["prometheus"]["volumes"]:
        parts = entry.split(":")
        mounts[parts[1]] = parts[0]
    for rule_file in prom["rule_files"]:
        assert (COMPOSE.parent / mounts[rule_file]).resolve() == ALERTS.resolve()


def test_compose_grafana_provisioning():
    grafana = compose()["services"]["grafana"]
    mounts = {}
    for entry in grafana["volumes"]:
        parts = entry.split(":")
        mounts[parts[1]] = parts[0]
    prov_dir = COMPOSE.parent / mounts["/etc/grafana/provisioning"]
    ds_files = list((prov_dir / "datasources").glob("*.yaml"))
    db_files = list((prov_dir / "dashboards").glob("*.yaml"))
    assert ds_files and db_files
    datasources = [d for f in ds_files for d in yaml.safe_load(f.read_text())["datasources"]]
    assert any(d["type"] == "prometheus" and d["url"] == "http://prometheus:9090" for d in datasources)
    providers = [p for f in db_files for p in yaml.safe_load(f.read_text())["providers"]]
    dashboard_mounts = {t: s for t, s in mounts.items() if s.endswith(".json")}
    for provider in providers:
        path = provider["options"]["path"]
        inside = [s for t, s in dashboard_mounts.items() if t.startswith(path.rstrip("/") + "/")]
        assert inside, f"provider path {path} has no dashboard mounted"
        for source in inside:
            assert (COMPOSE.parent / source).resolve() == DASHBOARD.resolve()


# ---------------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile():
    instr = dockerfile_instructions()
    keywords = [k for k, _ in instr]
    args = dict(re.match(r"(\w+)=(.*)", v).groups() for k, v in instr if k == "ARG" and "=" in v)
    base = next(v for k, v in instr if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert "cuda" in base and ("pytorch" in base or "nvcr.io/nvidia" in base), base
    users = [v for k, v in instr if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "must run as non-root"
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    health = [v for k, v in instr if k == "HEALTHCHECK"]
    assert len(health) == 1
    assert "/v1/health/ready" in health[0] and "127.0.0.1" in health[0]
    assert "python" in health[0] and "curl" not in health[0] and "wget" not in health[0]
    start_period = re.search(r"--start-period=(\w+)", health[0])
    assert start_period and duration_seconds(start_period.group(1)) >= 300
    entry = json.loads(next(v for k, v in instr if k == "ENTRYPOINT"))
    assert entry[-2:] == ["alpamayo-worker", "serve"]
    assert "8000" in [v for k, v in instr if k == "EXPOSE"][0].split()
    runs = " ".join(v for k, v in instr if k == "RUN")
    assert re.search(r"pip install [^&]*\s\.(\s|$)", runs), "installs the package with pip install ."
    assert not any(k == "COPY" and "models" in v for k, v in instr), "weights are mounted, not copied"
    env = " ".join(v for k, v in instr if k == "ENV")
    assert "ALPAMAYO_CACHE=" in env
    # NIM_FT_CHECKPOINT / NIM_ALPAMAYO_SPECULATIVE_MODEL must not be baked in: they cannot be combined
    # and an empty mount point would be rejected; they are set per deployment.
    assert "NIM_FT_CHECKPOINT" not in env and "NIM_ALPAMAYO_SPECULATIVE_MODEL" not in env


def test_dockerignore_keeps_context_small():
    path = REPO / ".dockerignore"
    if not path.exists():
        path = DEPLOY / "docker" / ".dockerignore"
    patterns = {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert ".git" in patterns
    for needed in ("pyproject.toml", "worker", "schemas", "producer_tools", "README.md"):
        assert needed not in patterns and f"/{needed}" not in patterns


def test_docs_mention_every_configmap_key_and_secret_key():
    doc = DEPLOY_DOC.read_text()
    for key in worker_configmap()["data"]:
        assert f"`{key}`" in doc, f"docs/deploy.md does not explain {key}"
    for key in k8s_one("Secret", "alpamayo-kafka-credentials")["stringData"]:
        assert f"`{key}`" in doc, f"docs/deploy.md does not explain secret key {key}"
    for alert in (r["alert"] for r in alert_rules()):
        assert alert in doc, f"docs/deploy.md does not describe alert {alert}"
