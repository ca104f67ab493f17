"""Results and dead letters to Kafka, and the consumer offsets that say they are done.

Offsets (:class:`OffsetTracker`)
--------------------------------
Every fetched record is *pending* on its partition until its output (one result or one dead
letter) is acknowledged. The committable offset of a partition is the lowest pending offset, or
(nothing pending) the highest fetched offset + 1: i.e. the highest *contiguous* completed offset
+ 1, which also steps over offset gaps (transaction markers, compaction). A record whose output
is not acknowledged - still in the engine, abandoned on a revoke, lost in a crash - therefore
holds the partition's commit back, and is re-delivered.

Each assignment of a partition gets a new *epoch*; work fetched under an older epoch (the
partition was revoked meanwhile) is dropped instead of published.

Guarantees (:class:`Publisher`)
-------------------------------
* ``at_least_once``: idempotent producer, ``acks=all``. A flush sends every queued output,
  waits for all acknowledgements, marks their offsets done and only then commits the
  committable offsets (``consumer.commit``). A crash between ack and commit re-delivers: a
  duplicate result, never a lost one. A commit that fails (rebalance, coordinator moving) is
  retried every ``COMMIT_RETRY_S`` even when no further output arrives.
* ``exactly_once``: one transactional producer per assigned input partition
  (``worker.kafka_clients.PartitionProducers``, ``transactional_id = <group>.<topic>.<partition>``),
  so the next owner of a partition fences the previous one, zombies included. A flush is one
  transaction per partition: the partition's outputs plus ``send_offsets_to_transaction`` of the
  offsets they complete, through that partition's producer. Readers use ``read_committed``; an
  aborted or crashed transaction leaves neither outputs nor offsets.
  Outputs are published per partition in offset order: an output whose partition still has an
  earlier record unfinished is held back until that record's output is ready, so a transaction
  never commits a result beyond its partition's committed offset (a restart would otherwise
  re-process it and commit a second result). The price is head-of-line waiting within a
  partition; at_least_once publishes as soon as an output is ready.

Review topic (``ALPAMAYO_REVIEW_TOPIC``): a result whose uncertainty reaches the threshold is also
published there (same key, value and headers), in the same transaction (exactly_once) or the same
acknowledged send batch before the offset commit (at_least_once) as the result itself.

A send or transaction failure is fatal (:class:`PublishError`): the worker exits non-zero
without committing, and the records are re-delivered to the restarted worker. One exception:
exactly_once, a partition's transaction that failed on a broker or connection error (not a fenced
producer, not an authorization failure) is handed to ``on_broken`` (the service re-opens the
partition in place, as a new owner would: ``worker.partition_watch``); its outputs stay pending
and are dropped with their epoch, and its records are fetched and answered again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiokafka.errors import (AuthenticationFailedError, ClusterAuthorizationFailedError, GroupAuthorizationFailedError,
                             KafkaError, ProducerFenced, TopicAuthorizationFailedError,
                             TransactionalIdAuthorizationFailed)

from schemas import ContractError, DeadLetter, ErrorCode, InferResult, dead_letter_key, encode_result, result_key
from worker.output_limits import check_result_fits, fit_dead_letter

__all__ = ["TP", "Output", "OffsetTracker", "Publisher", "PublishError", "reopenable", "COMMIT_RETRY_S", "result_output",
           "dead_letter_output", "job_output"]

log = logging.getLogger("alpamayo.publisher")

TP = tuple[str, int]
COMMIT_RETRY_S = 1.0
"""at_least_once: how soon a failed offset commit is retried when no output arrives meanwhile."""


class PublishError(RuntimeError):
    """Outputs could not be published/committed; the worker must stop without committing more."""


NOT_REOPENED = (ProducerFenced, AuthenticationFailedError, ClusterAuthorizationFailedError, GroupAuthorizationFailedError,
                TopicAuthorizationFailedError, TransactionalIdAuthorizationFailed)
"""Transaction failures a new producer of the partition would meet again, or must not cause: another
owner fenced this one (re-opening would fence it back), or the credentials are refused."""


def reopenable(exc: BaseException) -> bool:
    """A failed transaction whose partition may be re-opened in place (a broker or connection error)."""
    return isinstance(exc, KafkaError) and not isinstance(exc, NOT_REOPENED)


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Output:
    """One message to publish for one source record."""

    tp: TP                      # source partition
    offset: int                 # source offset
    epoch: int                  # assignment epoch of the source partition when fetched
    topic: str                  # destination topic
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    result: InferResult | None = None
    error_code: str | None = None
    request_id: str | None = None
    review_topic: str | None = None     # a doubtful result: the same record also goes here, with the result

    @property
    def topics(self) -> list[str]:
        """Where the record is published: its topic, and the review topic when it has one."""
        return [self.topic] if self.review_topic is None else [self.topic, self.review_topic]


def result_output(tp: TP, offset: int, epoch: int, topic: str, result: InferResult, max_bytes: int,
                  content_type: str, review_topic: str | None = None, review_threshold: float = 1.0) -> Output:
    """The result encoded as ``content_type`` (``ALPAMAYO_RESULT_FORMAT``); also bound for
    ``review_topic`` when its uncertainty is at or above ``review_threshold``. Raises an
    ``oversize`` ContractError when the result's record exceeds ``max_bytes``."""
    value, headers = encode_result(result, content_type)
    key = result_key(result.request_id)
    check_result_fits(key, value, headers, max_bytes)
    doubtful = result.uncertainty is not None and result.uncertainty.uncertainty >= review_threshold
    return Output(tp, offset, epoch, topic, key, value, headers, result=result, request_id=result.request_id,
                  review_topic=review_topic if doubtful else None)


def dead_letter_output(tp: TP, offset: int, epoch: int, topic: str, dl: DeadLetter, max_bytes: int,
                       content_type: str) -> Output:
    """The dead letter encoded as ``content_type``, cut to fit ``max_bytes``
    (:func:`worker.output_limits.fit_dead_letter`)."""
    dl, value, headers = fit_dead_letter(dl, max_bytes, content_type)
    return Output(tp, offset, epoch, topic, dead_letter_key(dl), value, headers, error_code=dl.error_code.value,
                  request_id=dl.request_id)


# the request field an engine error code points at in the dead letter
FIELD_FOR_CODE = {"bad_image": "$.images", "missing_egomotion": "$.egomotion",
                  "missing_future_egomotion": "$.future_egomotion", "k_not_served": "$.num_traj_samples"}


def job_output(job, res, start: float, engine, settings, limits) -> tuple[Output, DeadLetter | None]:
    """A finished job's output: its result record (`engine.to_result`), or its dead letter when the
    engine failed (res an exception, or a SceneResult with an error), the result is unusable or it
    does not fit its topic (`limits`: OutputLimits); the dead letter is returned too (to count)."""
    s = settings
    err: BaseException | None = None
    if isinstance(res, BaseException):
        err = ContractError(ErrorCode.INFERENCE_FAILED, "$", f"{type(res).__name__}: {res}"[:1000])
    elif getattr(res, "error", None):
        code, msg = res.error
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.INFERENCE_FAILED
        err = ContractError(code, FIELD_FOR_CODE.get(code.value, "$"), str(msg)[:1000])
    if err is None:
        try:
            res.timings_ms["image_prep"] = res.timings_ms.get("image_prep", 0.0) + job.image_prep_ms
            lineage = job.lineage(s.worker_id)
            queue_ms = max(0.0, (start - job.origin_at) * 1000.0)
            total_ms = max(queue_ms, (time.time() - job.origin_at) * 1000.0)
            result = engine.to_result(job.request, res, lineage, queue_ms, total_ms, job.warnings)
            return result_output(job.tp, job.offset, job.epoch, s.result_topic, result, limits.result_bytes,
                                 s.result_content_type, s.review_topic, s.review_threshold), None
        except ContractError as exc:        # oversize: the result does not fit its topic
            err = exc
        except ValueError as exc:
            err = ContractError(ErrorCode.INFERENCE_FAILED, "$", str(exc)[:1000])
        except Exception as exc:
            err = ContractError(ErrorCode.INTERNAL_ERROR, "$", f"{type(exc).__name__}: {exc}"[:1000])
    dl = job.dead_letter(err, s.worker_id)
    return dead_letter_output(job.tp, job.offset, job.epoch, s.dead_letter_topic, dl, limits.dead_letter_bytes,
                              s.result_content_type), dl


# --------------------------------------------------------------------------------------------
# offsets
# --------------------------------------------------------------------------------------------


@dataclass
class _Partition:
    epoch: int
    start: int | None = None         # records below it are not this assignment's (fetched before a seek)
    pending: set[int] = field(default_factory=set)
    low: int | None = None           # lowest offset fetched (the group's position when assigned)
    high: int | None = None          # highest offset fetched
    committed: int | None = None     # last offset committed by this worker (or read from the group)


class OffsetTracker:
    """Pending/done offsets per assigned partition (event-loop only; not thread-safe)."""

    def __init__(self) -> None:
        self._parts: dict[TP, _Partition] = {}
        self._epochs: dict[TP, int] = {}

    # assignment
    def assign(self, tp: TP, start: int | None = None) -> int:
        """A new epoch of ``tp``; ``start``: the offset the consumer was positioned at (records
        below it, or fetched twice, are refused: they were fetched before that seek)."""
        epoch = self._epochs.get(tp, 0) + 1
        self._epochs[tp] = epoch
        self._parts[tp] = _Partition(epoch, start)
        return epoch

    def revoke(self, tp: TP) -> int:
        """Forget the partition; returns how many offsets were still pending (abandoned)."""
        part = self._parts.pop(tp, None)
        return len(part.pending) if part else 0

    @property
    def assigned(self) -> list[TP]:
        return list(self._parts)

    def epoch(self, tp: TP) -> int | None:
        part = self._parts.get(tp)
        return part.epoch if part else None

    def is_current(self, tp: TP, epoch: int) -> bool:
        part = self._parts.get(tp)
        return part is not None and part.epoch == epoch

    # records
    def add(self, tp: TP, offset: int) -> int | None:
        """A fetched record; returns the epoch, or None when the partition is not assigned or the
        record is not this assignment's to process (below its start, or already fetched)."""
        part = self._parts.get(tp)
        if part is None or (part.start is not None and offset < part.start) or \
                (part.high is not None and offset <= part.high):
            return None
        part.pending.add(offset)
        if part.high is None or offset > part.high:
            part.high = offset
        if part.low is None or offset < part.low:
            part.low = offset
        return part.epoch

    def done(self, tp: TP, offset: int, epoch: int) -> bool:
        part = self._parts.get(tp)
        if part is None or part.epoch != epoch:
            return False
        part.pending.discard(offset)
        return True

    @property
    def inflight(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())

    def pending(self, tp: TP) -> set[int]:
        part = self._parts.get(tp)
        return set(part.pending) if part else set()

    # commits
    def committable(self, extra_done: set[tuple[TP, int]] = frozenset(),
                    only: set[TP] | None = None) -> dict[TP, int]:
        """{tp: offset to commit} for partitions whose committable offset moved past the last commit.

        ``extra_done``: (tp, offset) pairs to treat as done (an exactly-once transaction about to
        carry their outputs)."""
        out: dict[TP, int] = {}
        for tp, part in self._parts.items():
            if only is not None and tp not in only:
                continue
            if part.high is None:
                continue
            pending = [o for o in part.pending if (tp, o) not in extra_done] if extra_done else part.pending
            target = min(pending) if pending else part.high + 1
            if target > (part.committed if part.committed is not None else part.low):
                out[tp] = target
        return out

    def mark_committed(self, offsets: dict[TP, int]) -> None:
        for tp, off in offsets.items():
            part = self._parts.get(tp)
            if part is not None and (part.committed is None or off > part.committed):
                part.committed = off

    def committed(self, tp: TP) -> int | None:
        part = self._parts.get(tp)
        return part.committed if part else None

    def note_committed(self, tp: TP, offset: int | None) -> None:
        """The group's committed offset as read from Kafka (for lag before our first commit)."""
        part = self._parts.get(tp)
        if part is not None and part.committed is None and offset is not None and offset >= 0:
            part.committed = offset


# --------------------------------------------------------------------------------------------
# publisher
# --------------------------------------------------------------------------------------------


class Publisher:
    """Publishes queued outputs and commits offsets; one flush at a time (a lock).

    ``producer``: at_least_once, a started idempotent aiokafka producer; exactly_once, the
    partitions' transactional producers (``for_partition(tp)``, a
    ``worker.kafka_clients.PartitionProducers``). ``consumer``: the started consumer.
    ``metrics``: a WorkerMetrics (or None). ``on_broken(tp, exc) -> bool``: exactly_once, a partition
    whose transaction failed with a :func:`reopenable` error; True when it will be re-opened (else,
    or without it: PublishError).
    """

    def __init__(self, producer, consumer, tracker: OffsetTracker, group_id: str, exactly_once: bool,
                 metrics=None, tp_factory=None, on_broken=None):
        self.producer = producer
        self.consumer = consumer
        self.tracker = tracker
        self.group_id = group_id
        self.exactly_once = exactly_once
        self.metrics = metrics
        self.on_broken = on_broken
        self._queue: list[Output] = []
        self._held: list[Output] = []       # exactly_once: ready, but behind an unfinished earlier offset
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._closed = False
        self._progress = asyncio.Event()
        self._commit_failed = False         # at_least_once: the last commit failed, retry on a timer
        if tp_factory is None:
            from aiokafka import TopicPartition as tp_factory  # noqa: N813
        self._tp = tp_factory
        self.published = 0
        self.dropped_stale = 0
        self.commit_failures = 0

    # ------------------------------------------------------------------ queue
    def submit(self, outputs: list[Output]) -> None:
        if outputs:
            self._queue.extend(outputs)
            self._wakeup.set()

    @property
    def held(self) -> int:
        return len(self._held)

    def _take(self) -> list[Output]:
        batch, self._queue = self._queue, []
        fresh = [o for o in batch if self.tracker.is_current(o.tp, o.epoch)]
        self._dropped(len(batch) - len(fresh))
        return fresh

    async def run(self) -> None:
        """Flush whenever outputs are queued (and every COMMIT_RETRY_S while a commit is owed),
        until :meth:`close`. Raises PublishError."""
        while True:
            try:
                await asyncio.wait_for(self._wakeup.wait(), COMMIT_RETRY_S if self._commit_failed else None)
            except TimeoutError:
                pass
            self._wakeup.clear()
            if self._queue or self._commit_failed:
                await self.flush()
            if self._closed and not self._queue:
                return

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def wait_progress(self, timeout: float) -> None:
        """Return after the next flush (or the timeout)."""
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), timeout)
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ flush
    async def flush(self) -> dict[TP, int]:
        """Publish everything queued, then commit what is complete; returns the offsets committed."""
        async with self._lock:
            batch = self._take()
            if self.exactly_once:
                committed = await self._flush_transaction(batch)
            else:
                committed = await self._flush_acked(batch)
            self._progress.set()
            log.debug("flushed %d outputs, committed %s", len(batch), committed)
            return committed

    def _dropped(self, n: int) -> None:
        """n outputs of partitions this worker no longer owns, left unpublished."""
        self.dropped_stale += n
        if self.metrics is not None and n:
            self.metrics.outputs_dropped.inc(n)

    def _account(self, batch: list[Output]) -> None:
        self.published += len(batch)
        if self.metrics is None:
            return
        for o in batch:
            if o.result is not None:
                self.metrics.observe_result(o.result)
            elif o.error_code is not None:
                self.metrics.observe_dead_letter(o.error_code)

    def _assigned(self) -> set[TP]:
        try:
            return {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        except Exception:
            return set()

    async def _flush_acked(self, batch: list[Output]) -> dict[TP, int]:
        if batch:
            try:
                futures = [await self.producer.send(t, o.value, key=o.key, headers=o.headers)
                           for o in batch for t in o.topics]
                await asyncio.gather(*futures)
            except Exception as exc:
                raise PublishError(f"publishing {len(batch)} outputs failed: {type(exc).__name__}: {exc}") from exc
            for o in batch:
                self.tracker.done(o.tp, o.offset, o.epoch)
            self._account(batch)
        offsets = self.tracker.committable(only=self._assigned())
        if not offsets:
            self._commit_failed = False
            return {}
        try:
            await self.consumer.commit({self._tp(t, p): off for (t, p), off in offsets.items()})
        except Exception as exc:  # rebalance in progress, coordinator moved: retried, else re-delivered
            self._commit_failed = True
            self.commit_failures += 1
            if self.metrics is not None:
                self.metrics.commit_failures.inc()
            log.warning("offset commit failed (%s: %s); retried in %.0fs (re-delivered if it never succeeds)",
                        type(exc).__name__, exc, COMMIT_RETRY_S)
            return {}
        self._commit_failed = False
        self.tracker.mark_committed(offsets)
        return offsets

    def _in_offset_order(self, batch: list[Output]) -> list[Output]:
        """The outputs that extend their partition's contiguous completed prefix; the rest is held."""
        candidates = [o for o in self._held if self.tracker.is_current(o.tp, o.epoch)] + batch
        self._dropped(len(self._held) + len(batch) - len(candidates))
        ready_offsets: dict[TP, set[int]] = {}
        for o in candidates:
            ready_offsets.setdefault(o.tp, set()).add(o.offset)
        frontier = {tp: min(self.tracker.pending(tp) - offs, default=None) for tp, offs in ready_offsets.items()}
        publish, self._held = [], []
        for o in candidates:
            f = frontier[o.tp]
            (publish if f is None or o.offset < f else self._held).append(o)
        return publish

    async def _flush_transaction(self, batch: list[Output]) -> dict[TP, int]:
        """One transaction per partition, through the partition's own producer."""
        batch = self._in_offset_order(batch)
        done = {(o.tp, o.offset) for o in batch}
        offsets = self.tracker.committable(extra_done=done, only=self._assigned())
        by_tp: dict[TP, list[Output]] = {}
        for o in batch:
            by_tp.setdefault(o.tp, []).append(o)
        tps = sorted(set(by_tp) | set(offsets))
        results = await asyncio.gather(*(self._partition_transaction(tp, by_tp.get(tp, []), offsets.get(tp))
                                         for tp in tps), return_exceptions=True)
        for tp, exc in zip(tps, results, strict=True):
            if isinstance(exc, BaseException) and not (self.on_broken is not None and reopenable(exc)
                                                       and self.on_broken(tp, exc)):
                raise PublishError(f"transaction of {len(batch)} outputs failed: {type(exc).__name__}: {exc}") from exc
        return {tp: offsets[tp] for tp, ok in zip(tps, results, strict=True) if ok is True and tp in offsets}

    async def _partition_transaction(self, tp: TP, outputs: list[Output], offset: int | None) -> bool:
        """The outputs of ``tp`` and its offset in one transaction of the partition's producer;
        False when the partition has no producer (revoked meanwhile: its work is dropped)."""
        producer = self.producer.for_partition(tp)
        if producer is None:
            self._dropped(len(outputs))
            return False
        async with producer.transaction():
            deliveries = [await producer.send(t, o.value, key=o.key, headers=o.headers)
                          for o in outputs for t in o.topics]
            if offset is not None:
                await producer.send_offsets_to_transaction({self._tp(*tp): offset}, self.group_id)
            # aiokafka ends a transaction even when one of its batches failed (it waits for the
            # batches, not for their success): a failed one must abort it here, offsets included
            await asyncio.gather(*deliveries)
        for o in outputs:
            self.tracker.done(o.tp, o.offset, o.epoch)
        if offset is not None:
            self.tracker.mark_committed({tp: offset})
        self._account(outputs)
        return True
