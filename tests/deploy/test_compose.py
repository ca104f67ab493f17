"""The compose stack (deploy/compose): images set or built, named volumes declared, depends_on
targets exist, one GPU worker, topics with the documented partition count, the sink, Prometheus
scraping the worker with the alert rules, Grafana provisioned with the dashboard."""

from __future__ import annotations

import yaml

from tests import REPO_ROOT
from tests.deploy.artefacts import (ALERTS, COMPOSE, DASHBOARD, DEPLOY, DOCKERFILE, compose, documented_partitions,
                                    duration_seconds)
from worker.service import longest_stop_s


def test_compose_topic_partitions_match_documentation():
    cmd = compose()["services"]["topics"]["command"]
    assert cmd[:2] == ["topics", "create"]
    assert int(cmd[cmd.index("--partitions") + 1]) == documented_partitions()


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
            assert context.resolve() == REPO_ROOT, f"{name}: build context must be the repo root"
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
    assert duration_seconds(worker["stop_grace_period"]) > longest_stop_s(drain)


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
