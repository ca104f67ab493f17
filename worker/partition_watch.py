"""What the broker says about each assigned input partition, read every few seconds on the
worker's monitor loop: the consumer lag (a metric), and an audit of the worker's own belief.

The audit looks for two silent stalls. Neither loses a record (it stays uncommitted), but each
leaves a partition unanswered until the next restart or rebalance:

* **lost commit**: nothing of the partition is pending, and the group's committed offset, read
  from the broker, is below the offset the worker committed: a transaction the client saw commit
  was not kept by the broker. The worker's belief is wrong from that offset on.
* **stalled fetch**: nothing of the partition is pending, fetching is not paused by flow control,
  and the consumer's position is below the partition's end (its last stable offset): there are
  records the consumer does not fetch.

A finding is acted on only when the next audit, ``AUDIT_INTERVAL_S`` later, finds the same
offsets (a committed transaction's offsets show a moment after the commit returns; a fetch may
be in flight). The repair is what a new owner of the partition does (``reopen``, the service's):
exactly_once restarts the partition's producer (its InitProducerId fences and settles any open
transaction of it), then the consumer is positioned at the committed offset read after that and
the tracker starts a new epoch, so late work of the old one is discarded. Nothing committed is
processed again; what was not committed is fetched and answered.

The same repair serves a third case, reported by the publisher rather than found by the audit:
**failed transaction** (exactly_once), a partition's transaction that failed on a broker or
connection error (``worker.publisher.reopenable``; aiokafka's sender gives up on a connection
closed under a coordinator lookup, for one). The partition is re-opened at once instead of the
worker exiting (a restart reloads the model), at most ``REOPEN_LIMIT`` times in
``REOPEN_WINDOW_S`` a partition; beyond that the worker stops as before (``PublishError``).

Each repair is a WARNING line and counts in ``alpamayo_partition_repairs_total{kind}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition

__all__ = ["PartitionWatch", "AUDIT_INTERVAL_S", "REOPEN_LIMIT", "REOPEN_WINDOW_S"]

log = logging.getLogger("alpamayo.worker")

TP = tuple[str, int]
AUDIT_INTERVAL_S = 10.0
"""How often the worker's belief is compared with the broker's offsets; a stall is repaired on the
second audit in a row that finds it unchanged, so between one and two intervals after it began."""
REOPEN_LIMIT, REOPEN_WINDOW_S = 3, 300.0
"""A partition whose transactions failed more often than this is not re-opened again: the worker stops."""


class PartitionWatch:
    """``consumer``: the started consumer; ``tracker``: the OffsetTracker; ``metrics``: a
    WorkerMetrics; ``paused``: whether flow control paused fetching; ``reopen``: re-opens the given
    assigned TopicPartitions as on an assignment (``WorkerService.reopen``)."""

    def __init__(self, consumer, tracker, metrics, paused: Callable[[], bool],
                 reopen: Callable[[list], Awaitable[None]]):
        self.consumer, self.tracker, self.metrics = consumer, tracker, metrics
        self.paused, self.reopen = paused, reopen
        self._suspects: dict[tuple[str, TP], tuple] = {}
        self._next_audit = time.monotonic() + AUDIT_INTERVAL_S
        self._reopened: dict[TP, list[float]] = {}
        self._repairs: set[asyncio.Task] = set()

    def broken(self, tp: TP, exc: BaseException) -> bool:
        """The publisher's ``on_broken``: re-open ``tp`` now (False: it failed too often already)."""
        now = time.monotonic()
        recent = [t for t in self._reopened.get(tp, []) if now - t < REOPEN_WINDOW_S]
        if len(recent) >= REOPEN_LIMIT:
            log.error("failed transaction on %s:%d (%s: %s), %d of them in the last %.0f s: not re-opened again",
                      *tp, type(exc).__name__, exc, len(recent) + 1, REOPEN_WINDOW_S)
            return False
        self._reopened[tp] = recent + [now]
        log.warning("failed transaction on %s:%d (%s: %s): re-opening the partition", *tp, type(exc).__name__, exc)
        self.metrics.partition_repairs.labels(kind="failed_transaction").inc()
        task = asyncio.ensure_future(self.reopen([TopicPartition(*tp)]))
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)
        return True

    async def check(self) -> None:
        """Lag for the metrics; the audit when it is due."""
        assignment = list(self.consumer.assignment())
        if not assignment:
            self.metrics.set_lag({})
            return
        ends = await self.consumer.end_offsets(assignment)
        lags = {}
        for tp in assignment:
            key = (tp.topic, tp.partition)
            committed = self.tracker.committed(key)
            if committed is None:
                committed = await self.consumer.committed(TopicPartition(*key))
                self.tracker.note_committed(key, committed)
            if committed is None:
                committed = (await self.consumer.beginning_offsets([tp])).get(tp, 0)
            lags[key] = int(ends.get(tp, 0)) - int(committed)
        self.metrics.set_lag(lags)
        if time.monotonic() >= self._next_audit:
            self._next_audit = time.monotonic() + AUDIT_INTERVAL_S
            await self.audit(assignment, ends)

    async def audit(self, assignment: list, ends: dict) -> None:
        """Compare, note what is new, repair what the previous audit found the same."""
        found: dict[tuple[str, TP], tuple] = {}
        for tp in assignment:
            key = (tp.topic, tp.partition)
            if self.tracker.pending(key) or self.tracker.epoch(key) is None:
                continue
            believed = self.tracker.committed(key)
            if believed is not None:
                broker = await self.consumer.committed(tp)
                if (broker if broker is not None else -1) < believed:
                    found[("lost commit", key)] = (tp, believed, broker)
                    continue
            if not self.paused():
                position, end = await self.consumer.position(tp), int(ends.get(tp, 0))
                if position < end:
                    found[("stalled fetch", key)] = (tp, position, end)
        repair = {k: v for k, v in found.items() if self._suspects.get(k) == v}
        self._suspects = {k: v for k, v in found.items() if k not in repair}
        if not repair:
            return
        for (kind, (topic, partition)), (_, a, b) in sorted(repair.items()):
            what = (f"the worker committed up to {a}, the group's committed offset is {b}" if kind == "lost commit"
                    else f"the consumer stays at {a}, the partition ends at {b}")
            log.warning("%s on %s:%d (%s, unchanged for %.0fs): re-opening the partition", kind, topic, partition,
                        what, AUDIT_INTERVAL_S)
            self.metrics.partition_repairs.labels(kind=kind.replace(" ", "_")).inc()
        await self.reopen(sorted({v[0] for v in repair.values()}, key=lambda tp: (tp.topic, tp.partition)))
