"""Kafka for the chaos harness: the cluster (local or given), topics, committed offsets, leaders."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from deploy.local.cluster import LocalKafka
from producer_tools.common import KafkaOptions
from producer_tools.topics import create_topics as create, plan_topics

log = logging.getLogger("alpamayo.chaos")


class Broker:
    """The cluster a scenario runs on: an external bootstrap (no fault injection) or a
    :class:`deploy.local.cluster.LocalKafka` this harness started (and stops in :meth:`close`)."""

    def __init__(self, bootstrap: str, local=None, *, owned: bool = False, user: str | None = None):
        self.bootstrap = bootstrap
        self.local = local
        self.owned = owned
        self.user = user

    @classmethod
    async def start_local(cls, name: str, nodes: int = 1, security: str = "plaintext",
                          users: dict[str, str] | None = None, timeout: float = 180.0) -> "Broker":
        kafka = LocalKafka(name=name, nodes=nodes, security=security, users=users, start_timeout=timeout)
        t0 = time.monotonic()
        bootstrap = await asyncio.to_thread(kafka.start, fresh=True)
        log.info("local Kafka %r: %d node(s), %s, ready in %.1fs", name, nodes, security, time.monotonic() - t0)
        return cls(bootstrap, kafka, owned=True, user=next(iter(kafka.users), None) if kafka.users else None)

    async def close(self, remove_state: bool = True) -> None:
        if self.local is not None and self.owned:
            await asyncio.to_thread(self.local.stop)
            if remove_state:
                shutil.rmtree(self.local.state_dir, ignore_errors=True)

    @property
    def sasl(self) -> bool:
        return self.local is not None and self.local.security == "sasl_ssl"

    def client_kw(self) -> dict:
        if self.local is not None and self.sasl:
            return self.local.client_config(self.user)
        return {"bootstrap_servers": self.bootstrap}

    def env(self) -> dict[str, str]:
        """The ALPAMAYO_KAFKA_* variables for the worker and the producer tools."""
        env = {"ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap, "ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
               "ALPAMAYO_KAFKA_SASL_MECHANISM": "", "ALPAMAYO_KAFKA_SASL_USERNAME": "",
               "ALPAMAYO_KAFKA_SASL_PASSWORD": "", "ALPAMAYO_KAFKA_SSL_CAFILE": ""}
        if self.sasl:
            env.update(ALPAMAYO_KAFKA_SECURITY_PROTOCOL="SASL_SSL", ALPAMAYO_KAFKA_SASL_MECHANISM="SCRAM-SHA-512",
                       ALPAMAYO_KAFKA_SASL_USERNAME=self.user, ALPAMAYO_KAFKA_SASL_PASSWORD=self.local.users[self.user],
                       ALPAMAYO_KAFKA_SSL_CAFILE=self.local.ca_file)
        return env

    def options(self, req: str, res: str, dl: str) -> KafkaOptions:
        kw = dict(bootstrap_servers=self.bootstrap, request_topic=req, result_topic=res, dead_letter_topic=dl)
        if self.sasl:
            kw.update(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username=self.user,
                      sasl_password=self.local.users[self.user], ssl_cafile=self.local.ca_file)
        return KafkaOptions(**kw)


@dataclass
class Topics:
    req: str
    res: str
    dl: str
    partitions: int

    @classmethod
    def fresh(cls, tag: str, partitions: int) -> "Topics":
        u = f"{tag}-{os.getpid()}-{int(time.time() * 1000) % 100_000_000}"
        return cls(f"chaos.{u}.requests", f"chaos.{u}.results", f"chaos.{u}.dead-letters", partitions)


async def create_topics(broker: Broker, topics: Topics, replication_factor: int = 1,
                        max_message_bytes: int = 2 << 20) -> None:
    """The three topics through the producer tools (``topics create``)."""
    kafka = broker.options(topics.req, topics.res, topics.dl)
    plans = plan_topics(kafka, partitions=topics.partitions, replication_factor=replication_factor,
                        max_message_bytes=max_message_bytes)
    await create(kafka, plans, timeout_s=60)


async def _consumer(broker: Broker, **kw):
    c = AIOKafkaConsumer(**broker.client_kw(), enable_auto_commit=False, request_timeout_ms=15000, **kw)
    await c.start()
    return c


async def request_progress(broker: Broker, topics: Topics, group: str) -> tuple[dict[int, int], dict[int, int]]:
    """({partition: end offset} of the request topic, {partition: the group's committed offset})."""
    c = await _consumer(broker, group_id=group)
    try:
        tps = [TopicPartition(topics.req, p) for p in range(topics.partitions)]
        ends = await c.end_offsets(tps)
        committed = {}
        for tp in tps:
            committed[tp.partition] = (await c.committed(tp)) or 0
        return {tp.partition: o for tp, o in ends.items()}, committed
    finally:
        await c.stop()


async def partition_leader(broker: Broker, topic: str, partition: int = 0) -> int:
    admin = AIOKafkaAdminClient(**broker.client_kw())
    await admin.start()
    try:
        for _ in range(100):
            desc = await admin.describe_topics([topic])
            for p in desc[0].get("partitions", []):
                if p["partition"] == partition and p.get("leader", -1) >= 0:
                    return int(p["leader"])
            await asyncio.sleep(0.2)
    finally:
        await admin.close()
    raise RuntimeError(f"{topic}:{partition} has no leader")
