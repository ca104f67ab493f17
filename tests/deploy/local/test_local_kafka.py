"""The local Apache Kafka (deploy/local/) against real brokers: no mocks."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from deploy.local import local_kafka
from deploy.local.cluster import LocalKafka, LocalKafkaError
from deploy.local.probe import probe_api_versions, probe_metadata

pytestmark = pytest.mark.kafka


async def _consume(consumer, want: int, timeout: float = 30.0) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=500)
        for records in batch.values():
            got.extend(records)
    return got


async def test_round_trip_plain_bytes(kafka_bootstrap, topic_factory):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = await topic_factory(1, prefix="roundtrip")
    payloads = [bytes([i]) * (i + 1) for i in range(20)] + [b"", b"\x00\xff" * 5000]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i, value in enumerate(payloads):
            await producer.send_and_wait(topic, value, key=f"k{i}".encode())
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, group_id=f"g-{topic}",
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        got = await _consume(consumer, len(payloads))
        await consumer.commit()
    finally:
        await consumer.stop()
    assert [r.value for r in got] == payloads
    assert [r.key for r in got] == [f"k{i}".encode() for i in range(len(payloads))]
    assert [r.offset for r in got] == list(range(len(payloads)))


async def test_topic_factory_partitions(kafka_bootstrap, topic_factory):
    from aiokafka.admin import AIOKafkaAdminClient

    a, b = await topic_factory.many(2, partitions=3, prefix="multi")
    assert a != b
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        topics = {t["topic"]: t for t in await admin.describe_topics([a, b])}
    finally:
        await admin.close()
    assert {len(topics[a]["partitions"]), len(topics[b]["partitions"])} == {3}


def test_topic_factory_from_sync_code(topic_factory):
    assert topic_factory.sync(2, prefix="sync").startswith("sync-")


def test_start_is_idempotent(local_kafka, kafka_bootstrap):
    if local_kafka is None:
        pytest.skip("ALPAMAYO_TEST_KAFKA_BOOTSTRAP points at an external broker")
    assert local_kafka.is_running()
    again = LocalKafka(name=local_kafka.name)
    t0 = time.monotonic()
    assert again.start() == kafka_bootstrap
    assert time.monotonic() - t0 < 5.0, "a second start() must reuse the running broker"
    assert again.is_running()


def test_protocol_probe_sees_the_broker(local_kafka, kafka_bootstrap):
    host, port = kafka_bootstrap.split(",")[0].rsplit(":", 1)
    versions = probe_api_versions(host, int(port))
    assert 3 in versions and 18 in versions  # Metadata, ApiVersions
    md = probe_metadata(host, int(port))
    assert (host, int(port)) in md["brokers"].values()
    if local_kafka is not None:
        assert md["cluster_id"] == local_kafka.cluster_id


def test_start_failure_points_at_the_log(tmp_path, monkeypatch):
    """A node that cannot start fails loudly, naming its log file, instead of hanging."""
    libs = local_kafka.ensure_jars()  # the jars of the real cache, before ALPAMAYO_CACHE moves
    monkeypatch.setenv("ALPAMAYO_CACHE", str(tmp_path))
    monkeypatch.setattr(local_kafka, "ensure_jars", lambda *a, **k: libs)
    monkeypatch.setattr(local_kafka, "NODE_JVM_OPTS", [*local_kafka.NODE_JVM_OPTS, "-XX:+NoSuchJvmOption"])
    bad = LocalKafka(name=f"pytest-broken-{os.getpid()}", start_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(LocalKafkaError, match=r"node 1 exited during startup; log: .*kafka\.log"):
        bad.start()
    assert time.monotonic() - t0 < 30
    assert not bad.is_running()
    bad.stop()


async def test_sasl_ssl_scram_round_trip():
    """SASL_SSL + SCRAM-SHA-512 listener with a generated CA: right password works, wrong fails."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.errors import KafkaConnectionError, KafkaError

    kafka = LocalKafka(name=f"pytest-sasl-{os.getpid()}", security="sasl_ssl",
                       users={"worker": "w-secret", "other": "o-secret"})
    await asyncio.to_thread(kafka.start, fresh=True)
    try:
        assert kafka.ca_file and os.path.exists(kafka.ca_file)
        cfg = kafka.client_config("worker")
        assert cfg["security_protocol"] == "SASL_SSL" and cfg["sasl_mechanism"] == "SCRAM-SHA-512"
        producer = AIOKafkaProducer(acks="all", **cfg)
        await producer.start()
        try:
            await producer.send_and_wait("secure-t", b"over-tls")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer("secure-t", group_id="secure-g", auto_offset_reset="earliest",
                                    **kafka.client_config("other"))
        await consumer.start()
        try:
            got = await _consume(consumer, 1)
        finally:
            await consumer.stop()
        assert [r.value for r in got] == [b"over-tls"]

        wrong = AIOKafkaProducer(**dict(cfg, sasl_plain_password="wrong", request_timeout_ms=5000))
        with pytest.raises((KafkaConnectionError, KafkaError)):
            await wrong.start()
        await wrong.stop()
    finally:
        await asyncio.to_thread(kafka.stop)


@pytest.mark.multinode
async def test_three_node_cluster_survives_leader_kill():
    """RF 3 / min ISR 2: SIGKILL the leader of partition 0, acks=all still works, node rejoins."""
    if os.environ.get("ALPAMAYO_SKIP_MULTINODE") == "1":
        pytest.skip("ALPAMAYO_SKIP_MULTINODE=1")
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    kafka = LocalKafka(name=f"pytest-3node-{os.getpid()}", nodes=3)
    t0 = time.monotonic()
    bootstrap = await asyncio.to_thread(kafka.start, fresh=True)
    started = time.monotonic() - t0
    topic = "replicated"
    try:
        assert len(bootstrap.split(",")) == 3
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=3,
                                                topic_configs={"min.insync.replicas": "2"})])

            async def partitions():
                while True:
                    desc = await admin.describe_topics([topic])
                    parts = desc[0].get("partitions", []) if desc else []
                    if len(parts) == 3 and all(p["leader"] >= 0 for p in parts):
                        return {p["partition"]: p for p in parts}
                    await asyncio.sleep(0.2)

            parts = await asyncio.wait_for(partitions(), 30)
        finally:
            await admin.close()
        assert all(len(p["replicas"]) == 3 for p in parts.values())
        leader = parts[0]["leader"]

        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                                    request_timeout_ms=30000)
        await producer.start()
        try:
            for i in range(20):
                await producer.send_and_wait(topic, f"before-{i}".encode(), partition=0)
            await asyncio.to_thread(kafka.kill_node, leader)
            assert not kafka.node_alive(leader)
            t_kill = time.monotonic()
            for i in range(20):
                await producer.send_and_wait(topic, f"after-{i}".encode(), partition=0)
            failover = time.monotonic() - t_kill
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(bootstrap_servers=",".join(
            a for n, a in zip(kafka.ids, bootstrap.split(",")) if n != leader), enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            got = await _consume(consumer, 40)
        finally:
            await consumer.stop()
        values = [r.value.decode() for r in got]
        assert values == [f"before-{i}" for i in range(20)] + [f"after-{i}" for i in range(20)]

        t_restart = time.monotonic()
        await asyncio.to_thread(kafka.start_node, leader)
        restarted = time.monotonic() - t_restart
        assert kafka.node_alive(leader)
        assert await asyncio.to_thread(kafka.is_running)
        print(f"\n3-node start {started:.1f}s, failover after SIGKILL of node {leader}: {failover:.1f}s, "
              f"restart {restarted:.1f}s", end=" ")
    finally:
        t_stop = time.monotonic()
        await asyncio.to_thread(kafka.stop)
        print(f"stop {time.monotonic() - t_stop:.1f}s, total {time.monotonic() - t0:.1f}s")
    assert not kafka.node_alive(1)
