"""Every deploy artefact parses; the documents agree with the artefacts: the metrics and variables
tables of docs/architecture.md read, every variable an artefact sets is documented, docs/deploy.md
explains every ConfigMap key, Secret key and alert."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import REPO_ROOT
from tests.deploy.artefacts import (ALERTS, COMPOSE, DASHBOARD, DEPLOY, DEPLOY_DOC, DOCKERFILE, K8S, alert_rules,
                                    artefact_files, compose, documented_env_vars, exported_metrics, k8s_one,
                                    load_yaml_docs, worker_configmap, worker_container)

# Environment variables our artefacts may set beyond the documented worker configuration.
EXTRA_ENV = {
    "ALPAMAYO_CACHE",  # cache dir of the embedded demo checkpoint (worker/config.py)
}


def test_architecture_tables_parse():
    metrics = exported_metrics()
    assert len(metrics) >= 13, sorted(metrics)
    assert metrics["alpamayo_stage_latency_seconds"]["type"] == "histogram"
    assert metrics["alpamayo_stage_latency_seconds"]["labels"] == {"stage", "task"}
    assert metrics["alpamayo_consumer_lag"]["labels"] == {"topic", "partition"}
    env = documented_env_vars()
    assert {"ALPAMAYO_DRAIN_TIMEOUT_S", "ALPAMAYO_GROUP_INSTANCE_ID", "NIM_MODEL_PROFILE"} <= env


@pytest.mark.parametrize("path", artefact_files(".yaml", ".yml"), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_yaml_artefact_parses(path: Path):
    assert load_yaml_docs(path), f"{path} is empty"


@pytest.mark.parametrize("path", artefact_files(".json"), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_json_artefact_parses(path: Path):
    json.loads(path.read_text())


def test_expected_artefacts_exist():
    for path in [DOCKERFILE, COMPOSE, DASHBOARD, ALERTS, DEPLOY_DOC, DEPLOY / "compose" / "prometheus.yml",
                 K8S / "kustomization.yaml"]:
        assert path.is_file(), path
    assert (REPO_ROOT / ".dockerignore").is_file() or (DEPLOY / "docker" / ".dockerignore").is_file()


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


def test_docs_mention_every_configmap_key_and_secret_key():
    doc = DEPLOY_DOC.read_text()
    for key in worker_configmap()["data"]:
        assert f"`{key}`" in doc, f"docs/deploy.md does not explain {key}"
    for key in k8s_one("Secret", "alpamayo-kafka-credentials")["stringData"]:
        assert f"`{key}`" in doc, f"docs/deploy.md does not explain secret key {key}"
    for alert in (r["alert"] for r in alert_rules()):
        assert alert in doc, f"docs/deploy.md does not describe alert {alert}"
