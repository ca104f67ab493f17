"""Offset tracking and the publisher's commit rules, with recording fake Kafka clients.

The real-broker behaviour (crash, rebalance, transactions) is in test_service_kill_rebalance_drain.py.
"""

import asyncio
from dataclasses import dataclass

import pytest
from aiokafka.errors import KafkaConnectionError, ProducerFenced

import schemas as S
from worker.metrics import WorkerMetrics
from worker.publisher import COMMIT_RETRY_S, OffsetTracker, Output, Publisher, PublishError, result_output

TP0, TP1 = ("req", 0), ("req", 1)


# ---------------------------------------------------------------- OffsetTracker

def test_commit_is_highest_contiguous_completed_offset_plus_one():
    t = OffsetTracker()
    e = t.assign(TP0)
    for off in (10, 11, 12, 13):
        assert t.add(TP0, off) == e
    t.done(TP0, 10, e)
    t.done(TP0, 12, e)
    t.done(TP0, 13, e)
    assert t.committable() == {TP0: 11}       # 11 unfinished holds 12 and 13 back
    t.mark_committed({TP0: 11})
    assert t.committable() == {}
    t.done(TP0, 11, e)
    assert t.committable() == {TP0: 14}


def test_offset_gaps_are_stepped_over():
    t = OffsetTracker()
    e = t.assign(TP0)
    for off in (3, 5, 9):                      # 4, 6..8: transaction markers / compacted
        t.add(TP0, off)
    for off in (3, 5, 9):
        t.done(TP0, off, e)
    assert t.committable() == {TP0: 10}


def test_revoke_drops_state_and_stale_epochs_are_refused():
    t = OffsetTracker()
    e1 = t.assign(TP0)
    t.add(TP0, 0)
    assert t.revoke(TP0) == 1                 # one abandoned
    assert t.add(TP0, 1) is None              # not assigned: record ignored
    e2 = t.assign(TP0)
    assert e2 != e1
    assert not t.is_current(TP0, e1) and t.is_current(TP0, e2)
    t.add(TP0, 0)
    assert t.done(TP0, 0, e1) is False        # completion of the old assignment does not count
    assert t.committable() == {} and t.inflight == 1
    assert t.done(TP0, 0, e2) is True
    assert t.committable() == {TP0: 1}


def test_nothing_to_commit_before_progress_after_a_restart():
    t = OffsetTracker()
    e = t.assign(TP0)
    t.add(TP0, 40)                            # the group had committed 40 before
    t.add(TP0, 41)
    assert t.committable() == {}              # never commits behind or at the group's position
    t.done(TP0, 40, e)
    assert t.committable() == {TP0: 41}


def test_extra_done_previews_a_transaction():
    t = OffsetTracker()
    e = t.assign(TP0)
    t.assign(TP1)
    t.add(TP0, 0)
    t.add(TP0, 1)
    assert t.committable(extra_done={(TP0, 0)}) == {TP0: 1}
    assert t.committable(extra_done={(TP0, 0), (TP0, 1)}) == {TP0: 2}
    assert t.pending(TP0) == {0, 1}           # preview changes nothing
    t.done(TP0, 0, e)
    assert t.committable(only={TP1}) == {}


# ---------------------------------------------------------------- Publisher with fakes

@dataclass(frozen=True)
class FakeTP:
    topic: str
    partition: int


class FakeConsumer:
    def __init__(self, tps):
        self.tps = [FakeTP(*tp) for tp in tps]
        self.commits = []
        self.fail_commit = False

    def assignment(self):
        return set(self.tps)

    async def commit(self, offsets):
        if self.fail_commit:
            raise RuntimeError("CommitFailedError: rebalance")
        self.commits.append({(tp.topic, tp.partition): off for tp, off in offsets.items()})


class FakeProducer:
    """send() returns a future the test resolves (the broker's acknowledgement)."""

    def __init__(self):
        self.sent = []
        self.pending = []
        self.txns = []
        self._txn = None

    async def send(self, topic, value, key=None, headers=None):
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((topic, key, value))
        if self._txn is not None:
            self._txn["sends"].append((topic, key))
            fut.set_result(None)
        else:
            self.pending.append(fut)
        return fut

    def ack_all(self, error=None):
        for f in self.pending:
            f.set_exception(error) if error else f.set_result(None)
        self.pending = []

    def transaction(self):
        producer = self

        class Txn:
            async def __aenter__(self):
                producer._txn = {"sends": [], "offsets": None, "committed": False}

            async def __aexit__(self, et, e, tb):
                producer._txn["committed"] = et is None
                producer.txns.append(producer._txn)
                producer._txn = None
                return False

        return Txn()

    async def send_offsets_to_transaction(self, offsets, group_id):
        self._txn["offsets"] = ({(tp.topic, tp.partition): o for tp, o in offsets.items()}, group_id)


class FakePartitionProducers:
    """exactly_once: one FakeProducer per partition (worker.kafka_clients.PartitionProducers)."""

    def __init__(self, tps):
        self.producers = {tp: FakeProducer() for tp in tps}

    def for_partition(self, tp):
        return self.producers.get(tp)


def out(tp, offset, epoch, key):
    return Output(tp, offset, epoch, "results", key.encode(), b"v", [], request_id=key)


async def test_at_least_once_commits_only_after_every_ack():
    t = OffsetTracker()
    e = t.assign(TP0)
    for off in range(3):
        t.add(TP0, off)
    prod, cons = FakeProducer(), FakeConsumer([TP0])
    pub = Publisher(prod, cons, t, "g", exactly_once=False, tp_factory=FakeTP)
    pub.submit([out(TP0, 0, e, "a"), out(TP0, 1, e, "b")])
    flush = asyncio.create_task(pub.flush())
    await asyncio.sleep(0.05)
    assert len(prod.sent) == 2 and not flush.done()
    assert cons.commits == []                  # not acknowledged yet: nothing committed
    prod.ack_all()
    assert await flush == {TP0: 2}
    assert cons.commits == [{TP0: 2}]          # offset 2 still pending -> 2, not 3


async def test_commit_failure_is_not_fatal_and_is_retried_next_flush():
    t = OffsetTracker()
    e = t.assign(TP0)
    t.add(TP0, 0)
    prod, cons = FakeProducer(), FakeConsumer([TP0])
    cons.fail_commit = True
    metrics = WorkerMetrics(spec_counters=False)
    pub = Publisher(prod, cons, t, "g", exactly_once=False, metrics=metrics, tp_factory=FakeTP)
    pub.submit([out(TP0, 0, e, "a")])
    flush = asyncio.create_task(pub.flush())
    await asyncio.sleep(0.01)
    prod.ack_all()
    assert await flush == {}
    assert metrics.commit_failures._value.get() == 1          # alpamayo_offset_commit_failures_total
    cons.fail_commit = False
    assert await pub.flush() == {TP0: 1}
    assert metrics.commit_failures._value.get() == 1


async def test_stale_outputs_of_a_revoked_partition_are_dropped():
    t = OffsetTracker()
    e_old = t.assign(TP0)
    t.add(TP0, 0)
    t.revoke(TP0)
    t.assign(TP0)
    prod, cons = FakeProducer(), FakeConsumer([TP0])
    metrics = WorkerMetrics(spec_counters=False)
    pub = Publisher(prod, cons, t, "g", exactly_once=False, metrics=metrics, tp_factory=FakeTP)
    pub.submit([out(TP0, 0, e_old, "a")])
    assert await pub.flush() == {}
    assert prod.sent == [] and pub.dropped_stale == 1
    assert metrics.outputs_dropped._value.get() == 1          # alpamayo_outputs_dropped_total


async def test_exactly_once_each_partition_commits_through_its_own_producer():
    """Outputs and offsets of a partition go in a transaction of that partition's producer (whose
    transactional id the partition's next owner takes over, fencing this one)."""
    t = OffsetTracker()
    e0, e1 = t.assign(TP0), t.assign(TP1)
    for off in range(2):
        t.add(TP0, off)
    t.add(TP1, 5)
    prods, cons = FakePartitionProducers([TP0, TP1]), FakeConsumer([TP0, TP1])
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, tp_factory=FakeTP)
    pub.submit([out(TP0, 0, e0, "a"), out(TP1, 5, e1, "c")])
    committed = await pub.flush()
    assert committed == {TP0: 1, TP1: 6}
    (txn0,) = prods.producers[TP0].txns
    (txn1,) = prods.producers[TP1].txns
    assert txn0["committed"] and txn0["sends"] == [("results", b"a")] and txn0["offsets"] == ({TP0: 1}, "grp")
    assert txn1["committed"] and txn1["sends"] == [("results", b"c")] and txn1["offsets"] == ({TP1: 6}, "grp")
    assert cons.commits == []                  # never a plain consumer commit in exactly_once
    assert t.pending(TP0) == {1}


def fail_step(prod: FakeProducer, step: str) -> None:
    """Make one step of the producer's transaction raise (a fenced producer, a broker error)."""
    async def fenced(*a, **kw):
        raise RuntimeError("ProducerFenced")

    if step == "commit":                       # the sends succeed, ending the transaction fails
        txn_of = prod.transaction

        class CommitFails:
            def __init__(self):
                self.txn = txn_of()

            async def __aenter__(self):
                await self.txn.__aenter__()

            async def __aexit__(self, et, e, tb):
                await self.txn.__aexit__(et, e, tb)
                prod.txns[-1]["committed"] = False
                if et is None:
                    raise RuntimeError("ProducerFenced on EndTxn")
                return False

        prod.transaction = CommitFails
    elif step == "delivery":                   # sent, but the broker refused the batch
        send = prod.send

        async def refused_batch(*a, **kw):
            await send(*a, **kw)
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(RuntimeError("ProducerFenced: the batch failed"))
            return fut

        prod.send = refused_batch
    else:
        setattr(prod, {"send": "send", "send_offsets": "send_offsets_to_transaction"}[step], fenced)


@pytest.mark.parametrize("step", ["send", "delivery", "send_offsets", "commit"])
async def test_exactly_once_failed_transaction_is_fatal_and_completes_nothing(step):
    """A failed send, delivery (aiokafka commits around a failed batch), send_offsets_to_transaction
    or commit of a partition's transaction raises PublishError; the other partition's transaction
    commits; the failed partition's offsets stay pending and uncommitted, nothing of it counts as
    published."""
    t = OffsetTracker()
    e0, e1 = t.assign(TP0), t.assign(TP1)
    t.add(TP0, 0)
    t.add(TP0, 1)
    t.add(TP1, 7)
    prods, cons = FakePartitionProducers([TP0, TP1]), FakeConsumer([TP0, TP1])
    prod = prods.producers[TP0]
    fail_step(prod, step)
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, tp_factory=FakeTP)
    pub.submit([out(TP0, 0, e0, "a"), out(TP0, 1, e0, "b"), out(TP1, 7, e1, "c")])
    with pytest.raises(PublishError, match="ProducerFenced"):
        await pub.flush()
    assert t.pending(TP0) == {0, 1} and t.committed(TP0) is None
    assert [txn["committed"] for txn in prod.txns] == [False]
    assert t.pending(TP1) == set() and t.committed(TP1) == 8          # the healthy partition went through
    assert pub.published == 1 and cons.commits == []


@pytest.mark.parametrize("step", ["send", "ack"])
async def test_at_least_once_failed_send_keeps_every_offset_pending(step):
    """A send that raises at once (buffer full, closed producer) or an acknowledgement that fails:
    PublishError, no offset marked done, nothing committed."""
    t = OffsetTracker()
    e = t.assign(TP0)
    for off in range(3):
        t.add(TP0, off)
    prod, cons = FakeProducer(), FakeConsumer([TP0])
    if step == "send":
        async def refused(*a, **kw):
            raise RuntimeError("KafkaTimeoutError: buffer full")

        prod.send = refused
    pub = Publisher(prod, cons, t, "g", exactly_once=False, tp_factory=FakeTP)
    pub.submit([out(TP0, 0, e, "a"), out(TP0, 1, e, "b")])
    flush = asyncio.create_task(pub.flush())
    await asyncio.sleep(0.01)
    prod.ack_all(error=RuntimeError("NotEnoughReplicas"))
    with pytest.raises(PublishError):
        await flush
    assert t.pending(TP0) == {0, 1, 2} and t.committed(TP0) is None
    assert cons.commits == [] and pub.published == 0


async def test_exactly_once_publishes_in_offset_order_per_partition():
    """A result is never committed beyond its partition's committed offset: offset 1 finished
    before offset 0 waits for it (else a restart from offset 0 would commit a second result)."""
    t = OffsetTracker()
    e = t.assign(TP0)
    for off in range(3):
        t.add(TP0, off)
    prods, cons = FakePartitionProducers([TP0]), FakeConsumer([TP0])
    prod = prods.producers[TP0]
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, tp_factory=FakeTP)
    pub.submit([out(TP0, 1, e, "b")])
    assert await pub.flush() == {}
    assert prod.txns == [] and pub.held == 1                  # held: offset 0 unfinished
    pub.submit([out(TP0, 0, e, "a")])
    assert await pub.flush() == {TP0: 2}
    (txn,) = prod.txns
    assert txn["sends"] == [("results", b"b"), ("results", b"a")] and txn["offsets"][0] == {TP0: 2}
    assert pub.held == 0 and t.pending(TP0) == {2}


async def test_exactly_once_held_outputs_of_a_revoked_partition_are_dropped():
    t = OffsetTracker()
    e = t.assign(TP0)
    t.add(TP0, 0)
    t.add(TP0, 1)
    prods, cons = FakePartitionProducers([TP0]), FakeConsumer([TP0])
    metrics = WorkerMetrics(spec_counters=False)
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, metrics=metrics, tp_factory=FakeTP)
    pub.submit([out(TP0, 1, e, "b")])
    await pub.flush()
    t.revoke(TP0)
    t.assign(TP0)
    assert await pub.flush() == {} and pub.held == 0 and prods.producers[TP0].txns == []
    assert metrics.outputs_dropped._value.get() == 1


def test_records_fetched_before_the_assignment_seek_are_refused():
    """exactly_once positions a new assignment at the committed offset read after fencing; records
    the consumer fetched from an older position (below it, or fetched again) are not processed."""
    t = OffsetTracker()
    e = t.assign(TP0, start=10)
    assert t.add(TP0, 8) is None and t.add(TP0, 10) == e and t.add(TP0, 11) == e
    assert t.add(TP0, 10) is None and t.add(TP0, 11) is None and t.add(TP0, 12) == e
    assert t.pending(TP0) == {10, 11, 12}


async def test_at_least_once_failed_commit_is_retried_on_a_timer_without_new_outputs():
    t = OffsetTracker()
    e = t.assign(TP0)
    t.add(TP0, 0)
    prod, cons = FakeProducer(), FakeConsumer([TP0])
    cons.fail_commit = True
    pub = Publisher(prod, cons, t, "g", exactly_once=False, tp_factory=FakeTP)
    runner = asyncio.create_task(pub.run())
    pub.submit([out(TP0, 0, e, "a")])
    await asyncio.sleep(0.05)
    prod.ack_all()
    await asyncio.sleep(0.05)
    assert cons.commits == []                  # the commit failed
    cons.fail_commit = False                   # the coordinator is back; no output arrives
    await asyncio.sleep(COMMIT_RETRY_S + 0.5)
    assert cons.commits == [{TP0: 1}] and t.committed(TP0) == 1 and pub.commit_failures >= 1
    pub.close()
    await asyncio.wait_for(runner, 2)


def _result(rid: str, uncertainty: float | None) -> S.InferResult:
    return S.InferResult(
        request_id=rid, task="trajectory", num_samples=2 if uncertainty is not None else 1,
        metrics=S.ResultMetrics(reasoning_texts=[], generated_tokens=[], timings=S.StageTimings()),
        model=S.ModelIdentity(id="m", profile="bf16", precision="bf16", checkpoint_hash="h"), completed_at=1.0,
        uncertainty=S.Uncertainty(uncertainty=uncertainty) if uncertainty is not None else None)


async def test_exactly_once_doubtful_results_go_to_the_review_topic_in_the_same_transaction():
    t = OffsetTracker()
    e0 = t.assign(TP0)
    for off in range(4):
        t.add(TP0, off)
    prods, cons = FakePartitionProducers([TP0]), FakeConsumer([TP0])
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, tp_factory=FakeTP)
    outs = [result_output(TP0, i, e0, "results", _result(rid, u), 1 << 20, S.CONTENT_TYPE_MSGPACK, "review", 0.5)
            for i, (rid, u) in enumerate([("k1", None), ("low", 0.49), ("at", 0.5), ("high", 0.9)])]
    assert [o.topics for o in outs] == [["results"], ["results"], ["results", "review"], ["results", "review"]]
    pub.submit(outs)
    assert await pub.flush() == {TP0: 4}
    (txn,) = prods.producers[TP0].txns
    assert txn["committed"] and txn["offsets"] == ({TP0: 4}, "grp")
    assert txn["sends"] == [("results", b"k1"), ("results", b"low"), ("results", b"at"), ("review", b"at"),
                            ("results", b"high"), ("review", b"high")]
    assert result_output(TP0, 0, e0, "results", _result("x", 0.9), 1 << 20, S.CONTENT_TYPE_MSGPACK).topics == ["results"]   # no topic set


async def test_at_least_once_commits_after_the_review_copy_is_acknowledged():
    t = OffsetTracker()
    e = t.assign(TP0)
    t.add(TP0, 0)
    prod, cons = FakeProducer(), FakeConsumer([TP0])
    pub = Publisher(prod, cons, t, "g", exactly_once=False, tp_factory=FakeTP)
    pub.submit([result_output(TP0, 0, e, "results", _result("high", 0.9), 1 << 20, S.CONTENT_TYPE_MSGPACK, "review", 0.5)])
    flush = asyncio.create_task(pub.flush())
    await asyncio.sleep(0.05)
    assert [s[0] for s in prod.sent] == ["results", "review"] and cons.commits == []
    prod.ack_all()
    assert await flush == {TP0: 1}


@pytest.mark.parametrize("error, reopened", [(KafkaConnectionError("Connection at 127.0.0.1:9092 closed"), True),
                                             (ProducerFenced(), False)])
async def test_exactly_once_a_broker_error_hands_the_partition_to_on_broken(error, reopened):
    """A transaction that failed on a broker or connection error is handed to ``on_broken`` (the
    worker re-opens the partition); its offsets stay pending, the other partition commits. A fenced
    producer is never handed over (re-opening would fence the new owner back): PublishError."""
    t = OffsetTracker()
    e0, e1 = t.assign(TP0), t.assign(TP1)
    t.add(TP0, 0)
    t.add(TP1, 7)
    prods, cons = FakePartitionProducers([TP0, TP1]), FakeConsumer([TP0, TP1])

    async def fails(*a, **kw):
        raise error

    prods.producers[TP0].send_offsets_to_transaction = fails
    broken = []
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, tp_factory=FakeTP,
                    on_broken=lambda tp, exc: broken.append((tp, exc)) or True)
    pub.submit([out(TP0, 0, e0, "a"), out(TP1, 7, e1, "c")])
    if reopened:
        assert await pub.flush() == {TP1: 8}
        assert broken == [(TP0, error)]
    else:
        with pytest.raises(PublishError, match="ProducerFenced"):
            await pub.flush()
        assert broken == []
    assert t.pending(TP0) == {0} and t.committed(TP0) is None
    assert [txn["committed"] for txn in prods.producers[TP0].txns] == [False]
    assert pub.published == 1


async def test_exactly_once_on_broken_refusing_is_fatal():
    t = OffsetTracker()
    e0 = t.assign(TP0)
    t.add(TP0, 0)
    prods, cons = FakePartitionProducers([TP0]), FakeConsumer([TP0])

    async def fails(*a, **kw):
        raise KafkaConnectionError("Connection closed")

    prods.producers[TP0].send_offsets_to_transaction = fails
    pub = Publisher(prods, cons, t, "grp", exactly_once=True, tp_factory=FakeTP, on_broken=lambda tp, exc: False)
    pub.submit([out(TP0, 0, e0, "a")])
    with pytest.raises(PublishError, match="KafkaConnectionError"):
        await pub.flush()
