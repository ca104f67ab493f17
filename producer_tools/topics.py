"""``alpamayo-producer topics create|describe``: the request, result and dead-letter topics.

Created through the Kafka admin API (``AIOKafkaAdminClient``) with

* ``--partitions N`` (default 6; keep the three topics equal so a request, its result and its
  dead letter share a partition number),
* ``--replication-factor R`` (default: min(3, brokers)); ``min.insync.replicas`` = 2 when R >= 3,
* ``max.message.bytes``: ``--max-message-bytes`` (default 2 MiB) for requests and results; the
  dead-letter topic gets 256 KiB more (a dead letter carries the original request bytes),
* ``retention.ms``: ``--retention-ms`` (default 7 days); dead letters
  ``--dead-letter-retention-ms`` (default 30 days, time to fix and replay),
* ``cleanup.policy=compact,delete`` for results with ``--compact-results`` (keyed by request id),
* any ``--config key=value`` on all three.

Existing topics are left as they are and reported (``create`` is idempotent).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from producer_tools.common import KafkaOptions, ToolError, client_kwargs

__all__ = ["TopicPlan", "plan_topics", "create_topics", "describe_topics", "format_description"]

DEFAULT_MAX_MESSAGE_BYTES = 2 << 20
DAY_MS = 24 * 3600 * 1000
SHOWN_CONFIGS = ("max.message.bytes", "retention.ms", "cleanup.policy", "min.insync.replicas")


class TopicPlan(dict):
    """{"name", "role", "partitions", "replication_factor", "configs"}."""


def plan_topics(kafka: KafkaOptions, partitions: int = 6, replication_factor: int = 1,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, retention_ms: int = 7 * DAY_MS,
                dead_letter_retention_ms: int = 30 * DAY_MS, compact_results: bool = False,
                extra: dict[str, str] | None = None) -> list[TopicPlan]:
    if partitions < 1:
        raise ToolError("--partitions must be >= 1")
    if replication_factor < 1:
        raise ToolError("--replication-factor must be >= 1")
    base = {"max.message.bytes": str(max_message_bytes), "retention.ms": str(retention_ms)}
    if replication_factor >= 3:
        base["min.insync.replicas"] = "2"
    plans = []
    for role, name in (("requests", kafka.request_topic), ("results", kafka.result_topic),
                       ("dead_letters", kafka.dead_letter_topic)):
        cfg = dict(base)
        if role == "dead_letters":
            cfg["max.message.bytes"] = str(max_message_bytes + (256 << 10))
            cfg["retention.ms"] = str(dead_letter_retention_ms)
        if role == "results" and compact_results:
            cfg["cleanup.policy"] = "compact,delete"
        cfg.update(extra or {})
        plans.append(TopicPlan(name=name, role=role, partitions=partitions, replication_factor=replication_factor,
                               configs=cfg))
    return plans


async def _admin(kafka: KafkaOptions):
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    await admin.start()
    return admin


async def broker_count(kafka: KafkaOptions) -> int:
    admin = await _admin(kafka)
    try:
        return len((await admin.describe_cluster()).get("brokers", [])) or 1
    finally:
        await admin.close()


async def create_topics(kafka: KafkaOptions, plans: list[TopicPlan], timeout_s: float = 30.0) -> list[dict]:
    """Create the planned topics (existing ones are reported, not changed); waits for leaders."""
    from aiokafka.admin import NewTopic

    admin = await _admin(kafka)
    out = []
    try:
        existing = set(await admin.list_topics())
        new = [p for p in plans if p["name"] not in existing]
        for p in plans:
            out.append({"name": p["name"], "role": p["role"],
                        "status": "exists" if p["name"] in existing else "created"})
        if new:
            resp = await admin.create_topics(
                [NewTopic(p["name"], num_partitions=p["partitions"], replication_factor=p["replication_factor"],
                          topic_configs=p["configs"]) for p in new],
                timeout_ms=int(timeout_s * 1000))
            for err in getattr(resp, "topic_errors", []):
                name, code = err[0], err[1]
                msg = err[2] if len(err) > 2 else ""
                if code == 36:  # TOPIC_ALREADY_EXISTS (a concurrent create)
                    for o in out:
                        if o["name"] == name:
                            o["status"] = "exists"
                elif code != 0:
                    raise ToolError(f"creating topic {name} failed: error {code} {msg or ''}".strip())
            deadline = time.monotonic() + timeout_s
            names = [p["name"] for p in new]
            while True:
                topics = await admin.describe_topics(names)
                ok = all(t.get("error_code") == 0 and t.get("partitions")
                         and all(pp.get("leader", -1) >= 0 for pp in t["partitions"]) for t in topics)
                if ok and len(topics) == len(names):
                    break
                if time.monotonic() > deadline:
                    raise ToolError(f"topics {names} have no leader for every partition after {timeout_s}s")
                await asyncio.sleep(0.1)
    finally:
        await admin.close()
    return out


async def describe_topics(kafka: KafkaOptions, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Partitions, replication, leaders/ISR and the main configs of each topic."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    names = names or [kafka.request_topic, kafka.result_topic, kafka.dead_letter_topic]
    admin = await _admin(kafka)
    try:
        existing = set(await admin.list_topics())
        meta = {t["topic"]: t for t in await admin.describe_topics([n for n in names if n in existing])} \
            if any(n in existing for n in names) else {}
        configs: dict[str, dict[str, str]] = {}
        present = [n for n in names if n in existing]
        if present:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, n) for n in present])
            for resp in responses:
                for res in resp.resources:
                    entries = res[4]
                    configs[res[3]] = {e[0]: e[1] for e in entries}
    finally:
        await admin.close()
    out = []
    for n in names:
        if n not in existing:
            out.append({"name": n, "exists": False})
            continue
        parts = sorted(meta[n].get("partitions", []), key=lambda p: p["partition"])
        out.append({
            "name": n, "exists": True, "partitions": len(parts),
            "replication_factor": max((len(p.get("replicas", [])) for p in parts), default=0),
            "leaders": {p["partition"]: p.get("leader") for p in parts},
            "under_replicated": [p["partition"] for p in parts
                                 if len(p.get("isr", [])) < len(p.get("replicas", []))],
            "configs": {k: configs.get(n, {}).get(k) for k in SHOWN_CONFIGS},
        })
    return out


def format_description(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if not r["exists"]:
            lines.append(f"{r['name']}: does not exist")
            continue
        c = r["configs"]
        lines.append(f"{r['name']}: partitions={r['partitions']} replication={r['replication_factor']} "
                     f"max.message.bytes={c['max.message.bytes']} retention.ms={c['retention.ms']} "
                     f"cleanup.policy={c['cleanup.policy']} min.insync.replicas={c['min.insync.replicas']}"
                     + (f" under-replicated={r['under_replicated']}" if r["under_replicated"] else ""))
    return "\n".join(lines)
