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
from aiokafka.errors import KafkaConnectionError, KafkaError

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


class _FlakyProducer:
    """Fails to start (no broker answers) ``fails`` times in all, then starts."""

    fails = 0
    started: list = []

    def __init__(self, **kw):
        self.kw = kw

    async def start(self):
        if _FlakyProducer.fails > 0:
            _FlakyProducer.fails -= 1
            raise self.error
        _FlakyProducer.started.append(self.kw["transactional_id"])

    async def stop(self):
        pass


@pytest.mark.parametrize("error, retried", [(KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9)]"), True),
                                            (KafkaError("TransactionalIdAuthorizationFailed"), False)])
async def test_open_tries_again_while_no_broker_answers(error, retried):
    """A restart of the broker while a partition is opened (an assignment, a re-open): its producer
    is tried again every second; any other error is raised at once."""
    _FlakyProducer.fails, _FlakyProducer.started, _FlakyProducer.error = 2, [], error
    producers = PartitionProducers(settings("127.0.0.1:9", "g", "w"), factory=_FlakyProducer)
    if retried:
        await producers.open([("req", 0)], retry_s=10.0)
        assert producers.partitions == [("req", 0)] and _FlakyProducer.started == ["g.req.0"]
    else:
        with pytest.raises(KafkaError, match="Authorization"):
            await producers.open([("req", 0)], retry_s=10.0)
        assert producers.partitions == [] and _FlakyProducer.fails == 1
    with pytest.raises(KafkaConnectionError):          # and gives up after retry_s
        _FlakyProducer.fails, _FlakyProducer.error = 100, KafkaConnectionError("Unable to bootstrap")
        await producers.open([("req", 1)], retry_s=1.5)
