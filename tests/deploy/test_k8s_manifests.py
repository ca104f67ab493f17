"""Kubernetes manifests (deploy/k8s): built-in kinds validate (strict: unknown fields fail) against
the OpenAPI-derived JSON schemas bundled in ``kubernetes-validate``, the CRD kinds against the
hand-written schemas; references between manifests resolve; one GPU per pod, probes, identity;
termination grace > the worker's longest stop (drain + final flush + client closes); KEDA
maxReplicaCount <= documented partition count."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.artefacts import (K8S, documented_partitions, k8s_docs, k8s_find, k8s_one, worker_configmap,
                                    worker_container, worker_deployment)
from tests.deploy.manifest_schemas import CRD_KINDS, CRD_SCHEMAS
from worker.service import longest_stop_s

# Oldest Kubernetes minor we support, and the newest schema set the validator bundles.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


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


def test_deployment_grace_period_covers_the_longest_stop():
    pod = worker_deployment()["spec"]["template"]["spec"]
    drain = float(worker_configmap()["data"].get("ALPAMAYO_DRAIN_TIMEOUT_S", "60"))
    assert pod["terminationGracePeriodSeconds"] > longest_stop_s(drain)


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
    # the Secret template carries no credentials: every value says REPLACE_ME for the operator to fill
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
