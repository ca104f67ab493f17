"""exactly_once's fence across rebalances on a real broker (worker.kafka_clients.PartitionProducers).

The issue's reproduction: the new owner of a partition committed offset 10; the previous owner
(a zombie) then commits a transaction holding an output and offset 5. With one transactional
producer per input partition the new owner's start fenced the zombie: its transaction fails, the
group offset stays 10 and read_committed shows only the new owner's output.
"""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from worker.config import load_settings
from worker.kafka_clients import PartitionProducers


def settings(bootstrap: str, group: str, worker: str):
    return load_settings({"ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "ALPAMAYO_GROUP_ID": group,
                          "ALPAMAYO_WORKER_ID": worker, "ALPAMAYO_PROCESSING_GUARANTEE": "exactly_once"})


async def read_committed_values(bootstrap: str, topic: str) -> list[bytes]:
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, isolation_level="read_committed",
                         auto_offset_reset="earliest", enable_auto_commit=False)
    await c.start()
    try:
        got = await c.getmany(timeout_ms=3000)
        return [r.value for recs in got.values() for r in recs]
    finally:
        await c.stop()


async def test_the_next_owner_of_a_partition_fences_the_zombie(kafka_bootstrap, topic_factory):
    req, out = await topic_factory(prefix="pp-req"), await topic_factory(prefix="pp-out")
    group = f"pp-{uuid.uuid4().hex[:8]}"
    tp = (req, 0)
    zombie = PartitionProducers(settings(kafka_bootstrap, group, "worker-a"))
    owner = PartitionProducers(settings(kafka_bootstrap, group, "worker-b"))
    await zombie.open([tp])
    try:
        z = zombie.for_partition(tp)
        await z.begin_transaction()
        await z.send_and_wait(out, b"zombie-open")            # open when the partition moves
        await owner.open([tp])                                # InitProducerId: fences + aborts it
        o = owner.for_partition(tp)
        async with o.transaction():
            await o.send(out, b"owner")
            await o.send_offsets_to_transaction({TopicPartition(req, 0): 10}, group)
        with pytest.raises(KafkaError):                       # the zombie's late transaction
            await z.send_and_wait(out, b"zombie-late")
            await z.send_offsets_to_transaction({TopicPartition(req, 0): 5}, group)
            await z.commit_transaction()
    finally:
        await zombie.close_all()
        await owner.close_all()
    assert zombie.partitions == [] and owner.partitions == []
    c = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        assert await c.committed(TopicPartition(req, 0)) == 10
    finally:
        await c.stop()
    assert await read_committed_values(kafka_bootstrap, out) == [b"owner"]
