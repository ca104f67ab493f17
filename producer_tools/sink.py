"""``alpamayo-producer sink``: result and dead-letter topics (``--requests``: the request topic
too) -> a Hive-partitioned Parquet lake, exactly once.

Layout (``producer_tools.lake``): ``<lake>/<table>/run_id=<run>/date=<YYYY-MM-DD>/
<topic>+<partition>+<start>-<end>.parquet``, plus ``<lake>/_sink/locks/`` and ``_sink/ranges/``.
``date`` is the UTC day of the Kafka record timestamp (immutable, so every rewrite of a record
picks the same directory); files hold the fixed schemas of ``producer_tools.lake_tables``. A topic
may land in two tables (``--samples``: results and samples); both are written from the same
segment, under the same file name, so everything below holds per table.

Exactly once into the lake
--------------------------
A *segment* is a contiguous range ``[start, end]`` of one topic-partition (``start``/``end`` are
offsets of records in it). Its rows are split by Hive directory, and every file of the segment is
named ``<topic>+<partition>+<start>-<end>.parquet``, so the lake's file names are the sink's
offset log (the Kafka Connect HDFS recovery idea). The protocol:

1. A file appears under its final name only complete and durable: Parquet bytes to a temp file in
   the same directory, ``fsync``, ``rename``, ``fsync`` of the directory.
2. Kafka offsets (``end + 1``) are committed only after every file of the segment is durable
   (manual commit, ``read_committed`` consumer). The commit only saves re-reading work; the
   files are the truth.
3. On assignment of a partition (holding an ``flock`` on its lock file, so a zombie sink still
   writing it blocks the new owner), the sink reads the partition's *range index*
   (``<lake>/_sink/ranges/<topic>+<partition>.ranges``, ``producer_tools.lake``): one line per
   segment, appended and fsynced *before* the segment's first file, so it lists every range that
   may have files (a lake of an older sink gets its index from one scan of the lake, once).
   Every range ``[s, e]`` listed with ``e >=`` the committed offset is *replayed with exactly
   those bounds*: the records ``s..e`` are re-read (the sink seeks back to ``s`` when the
   committed offset falls inside a range) and only the files of that range that are missing are
   written. A file's content is a function of the records of its range and of its directory
   (the Kafka log is immutable), so a present file already holds exactly the rows a rewrite would.
   A replay is written only once every record ``s..e`` still in the log was read: a replay cut
   short (revocation, SIGTERM, ``--until-idle``, ``--max-records``) writes nothing and commits
   nothing, and the next owner replays the range from ``s``.
4. Records outside every listed range form new segments, cut by ``--rotate-rows`` (per
   partition), by ``--rotate-seconds`` since the segment's first record, before the start of the
   next listed range, on revocation and on shutdown. Such records are in no file yet: a file
   of a range ``[s, e]`` holds only records of ``s..e`` and that range was not listed.
5. Row decoding, Parquet encoding and the fsyncs run in a thread, never on the event loop, which
   stays free for the consumer's heartbeats and rebalances.

Hence every record lands in exactly one file: never twice (a record belongs to one range, which
is either replayed with its own bounds into the files still missing, or new and in no file), and
never lost (a range's missing files are written before ``end + 1`` is committed, and a range
with files is always finished on restart). Wall-clock rotation needs no state file because the
chosen boundaries are recorded by the file names themselves, and a crash before the first file of
a segment leaves nothing behind to conflict with. The sink refuses to run when it finds
overlapping ranges of one topic-partition (only possible if files were copied in by hand or two
sinks wrote one partition without the lock). Files copied into a lake by hand must come with
their ranges: delete ``<lake>/_sink/ranges`` and the next assignment rebuilds it from a scan. ``alpamayo-producer lake compact``
(``producer_tools.compact``) merges finished ranges (below the committed offset) into one range
and one file per directory; every change of the range index, the sink's appends included, holds
the index's lock, so that no append is lost to the compaction's rewrite. Limits: records deleted
by retention or compaction before a crashed range is replayed cannot be written; the lock needs a file system with working
``flock`` (local disks, NFSv4).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fcntl
import logging
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener
from tqdm import tqdm

from producer_tools.common import KafkaOptions, ToolError, atomic_write_bytes, client_kwargs
from producer_tools.lake import (append_range, check_ranges, hive_dir, read_range_index, scan_ranges,
                                 segment_file_name, write_range_index)
from producer_tools.lake_tables import ROW_BUILDERS, rows_to_table, table_bytes

log = logging.getLogger("alpamayo.sink")

__all__ = ["SinkOptions", "LakeSink", "run_sink"]


def _utc_date(ts_ms: int | None, fallback: dt.datetime | None = None) -> str:
    if ts_ms is not None and ts_ms >= 0:
        return dt.datetime.fromtimestamp(ts_ms / 1000.0, dt.timezone.utc).strftime("%Y-%m-%d")
    return (fallback or dt.datetime.fromtimestamp(0, dt.timezone.utc)).strftime("%Y-%m-%d")


async def _in_thread(fn, *args):
    """``fn(*args)`` in a thread; cancelled, still waits for the thread (the caller's partition
    locks must outlive its writes) before it re-raises."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


# --------------------------------------------------------------------------------------------
# the sink
# --------------------------------------------------------------------------------------------


@dataclass
class SinkOptions:
    lake: str
    group_id: str = "alpamayo-lake-sink"
    include_results: bool = True
    include_dead_letters: bool = True
    include_samples: bool = False        # results also as one row per sample (table "samples")
    include_requests: bool = False       # the request topic too (table "requests": no images)
    rotate_rows: int = 10_000
    rotate_seconds: float = 60.0
    until_idle: float | None = None
    max_records: int | None = None       # stop (gracefully) after this many records
    lock_timeout: float = 120.0
    session_timeout_ms: int = 10_000     # how soon a killed sink's partitions move (broker min 6000)
    progress: bool = True
    debug_pause: float = 0.0             # sleep after each data file (tests: kill between files)


@dataclass
class _Partition:
    topic: str
    partition: int
    tables: tuple[str, ...]         # the tables this topic's records land in (the first has the ranges)
    lock_fd: int
    replay: list[tuple[int, int]] = field(default_factory=list)   # lake ranges still to finish
    buf: list = field(default_factory=list)
    buf_kind: str = "free"          # "free" | "replay"
    started: float = 0.0            # monotonic time of the buffer's first record
    next_offset: int = 0            # records below this were handled (or precede the start) in this assignment


class LakeSink:
    def __init__(self, kafka: KafkaOptions, opts: SinkOptions):
        self.kafka = kafka
        self.opts = opts
        self.lake = Path(opts.lake)
        self.tables: dict[str, tuple[str, ...]] = {}
        if opts.include_results:
            self.tables[kafka.result_topic] = ("results", "samples") if opts.include_samples else ("results",)
        if opts.include_dead_letters:
            self.tables[kafka.dead_letter_topic] = ("dead_letters",)
        if opts.include_requests:
            self.tables[kafka.request_topic] = ("requests",)
        if not self.tables:
            raise ToolError("nothing to sink: both results and dead letters are excluded")
        self.parts: dict[Any, _Partition] = {}
        self.consumer = None
        self.stop_event = asyncio.Event()
        self.stats = {"records": 0, "rows_written": 0, "files_written": 0, "files_skipped": 0,
                      "segments": 0, "replayed_segments": 0, "replays_left": 0, "commits_failed": 0}
        self.assigned_once = asyncio.Event()
        self._bar = None
        # rebalance callbacks run on aiokafka's coordinator task, concurrently with the main loop's
        # processing of a fetched batch: the lock keeps a revocation from interleaving with a flush
        self._lock = asyncio.Lock()
        self.fatal: BaseException | None = None

    # ---------------------------------------------------------------- partition ownership
    def _lock_path(self, topic: str, partition: int) -> Path:
        return self.lake / "_sink" / "locks" / f"{topic}+{partition}.lock"

    async def _acquire_lock(self, topic: str, partition: int) -> int:
        path = self._lock_path(topic, partition)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.opts.lock_timeout
        warned = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ToolError(f"{path} is locked by another sink for {self.opts.lock_timeout:.0f}s")
                if not warned:
                    log.warning("waiting for %s (another sink still holds %s+%s)", path, topic, partition)
                    warned = True
                await asyncio.sleep(0.2)

    def _release(self, p: _Partition) -> None:
        try:
            fcntl.flock(p.lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(p.lock_fd)

    def _fail(self, exc: BaseException) -> None:     # aiokafka only logs a rebalance callback's exception
        if self.fatal is None:
            self.fatal = exc
        self.stop_event.set()

    async def on_assigned(self, assigned) -> None:
        async with self._lock:
            try:
                await self._assign(assigned)
            except BaseException as exc:
                self._fail(exc)
                raise

    async def _assign(self, assigned) -> None:
        new = [tp for tp in sorted(assigned, key=lambda t: (t.topic, t.partition)) if tp not in self.parts]
        for tp in new:      # own every new partition before looking at the lake
            self.parts[tp] = _Partition(tp.topic, tp.partition, self.tables[tp.topic],
                                        await self._acquire_lock(tp.topic, tp.partition))
        indexed = await _in_thread(self._load_indexes, [self.parts[tp] for tp in new])
        for tp in new:
            p = self.parts[tp]
            ranges = indexed[tp.topic, tp.partition]
            committed = await self.consumer.committed(tp)
            start = committed if committed is not None else 0
            pending = [r for r in ranges if r[1] >= start]
            inside = [r for r in pending if r[0] < start]
            if inside:
                self.consumer.seek(tp, inside[0][0])
                log.info("%s+%s: committed offset %s falls inside lake segment %s-%s: re-reading from %s",
                         tp.topic, tp.partition, committed, inside[0][0], inside[0][1], inside[0][0])
            p.replay = pending
            p.next_offset = inside[0][0] if inside else start
            if pending:
                log.info("%s+%s: %d lake segment(s) at or after offset %s are finished with their own bounds",
                         tp.topic, tp.partition, len(pending), start)
        self.assigned_once.set()

    def _load_indexes(self, parts: list[_Partition]) -> dict[tuple[str, int], list[tuple[int, int]]]:
        """The owned partitions' range indexes (thread: file I/O). A partition without one (a lake
        of an older sink) gets it from one scan of its table, written before anything else."""
        out: dict[tuple[str, int], list[tuple[int, int]]] = {}
        scanned: dict[str, dict] = {}
        for p in parts:
            ranges = read_range_index(self.lake, p.topic, p.partition, repair=True)
            if ranges is None:
                table = p.tables[0]
                if table not in scanned:
                    scanned[table] = scan_ranges(self.lake, table)
                ranges = scanned[table].get((p.topic, p.partition), [])
                check_ranges(p.topic, p.partition, ranges)
                write_range_index(self.lake, p.topic, p.partition, ranges)
                log.info("%s+%s: range index built from a scan of the lake (%d segments)",
                         p.topic, p.partition, len(ranges))
            check_ranges(p.topic, p.partition, ranges)
            out[p.topic, p.partition] = ranges
        return out

    async def on_revoked(self, revoked) -> None:
        async with self._lock:
            try:
                await self._revoke(revoked)
            except BaseException as exc:
                self._fail(exc)
                raise

    async def _revoke(self, revoked) -> None:
        for tp in list(revoked):
            p = self.parts.get(tp)
            if p is None:
                continue
            try:
                await self._flush(tp, p)
            finally:
                self._release(p)
                del self.parts[tp]

    # ---------------------------------------------------------------- records
    async def _add(self, tp, p: _Partition, record) -> None:
        o = record.offset
        if o < p.next_offset:
            return      # a batch fetched before a rebalance, re-delivered after the seek: already here
        p.next_offset = o + 1
        while p.replay and o > p.replay[0][1]:
            if p.buf:
                await self._flush(tp, p, complete=True)   # the replay range (its end record is gone) or free records
            else:
                p.replay.pop(0)             # none of that range's records are left in the log
        if p.replay and o >= p.replay[0][0]:
            if p.buf and p.buf_kind == "free":
                await self._flush(tp, p)
            p.buf_kind = "replay"
            self._append(p, record)
            if o == p.replay[0][1]:
                await self._flush(tp, p, complete=True)
            return
        p.buf_kind = "free"
        self._append(p, record)
        if len(p.buf) >= self.opts.rotate_rows:
            await self._flush(tp, p)

    def _append(self, p: _Partition, record) -> None:
        if not p.buf:
            p.started = time.monotonic()
        p.buf.append(record)

    async def _flush(self, tp, p: _Partition, complete: bool = False) -> None:
        """Write the buffered segment (missing files only), then commit its end + 1. A replay
        buffer is written only ``complete`` (every record of its range still in the log was read);
        cut short (revocation, shutdown, idle, ``max_records``) it is dropped: nothing written,
        nothing committed, and the partition's next owner replays the range from its start."""
        if p.buf_kind == "replay" and p.replay:
            start, end = p.replay[0]
            if not complete:
                log.info("%s+%s: replay of lake segment %s-%s stopped after offset %s: left to the next owner",
                         p.topic, p.partition, start, end, p.buf[-1].offset if p.buf else None)
                self.stats["replays_left"] += 1
                p.buf = []
                p.buf_kind = "free"
                return
            new_range = False
        else:
            if not p.buf:
                return
            start, end = p.buf[0].offset, p.buf[-1].offset
            new_range = True
        await _in_thread(self._write_segment, p, start, end, p.buf, new_range)
        self.stats["segments"] += 1
        if not new_range:
            self.stats["replayed_segments"] += 1
            p.replay.pop(0)
        p.buf = []
        p.buf_kind = "free"
        await self._commit(tp, end + 1)
        if self._bar is not None:
            self._bar.set_postfix(files=self.stats["files_written"], skipped=self.stats["files_skipped"], refresh=False)

    def _write_segment(self, p: _Partition, start: int, end: int, records: list, new_range: bool) -> None:
        """Decode, encode and write the segment's missing files (a thread: keeps the loop free for
        heartbeats and rebalances; the sink's lock keeps one flush at a time). A new segment's
        bounds go to the range index first, so a crash between its files leaves a range to finish."""
        if new_range:
            append_range(self.lake, p.topic, p.partition, start, end)
        groups: dict[tuple[str, str | None, str], list[dict]] = defaultdict(list)
        for table in p.tables:
            for r in records:
                for row in ROW_BUILDERS[table](r):
                    groups[(table, row.get("run_id"), _utc_date(r.timestamp, row.get("completed_at")))].append(row)
        name = segment_file_name(p.topic, p.partition, start, end)
        files = sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2]))
        for i, ((table, run_id, date), rows) in enumerate(files, 1):
            path = hive_dir(self.lake, table, run_id, date) / name
            if path.exists():
                self.stats["files_skipped"] += 1
                continue
            for stale in path.parent.glob(f".{name}.tmp-*"):      # left by a sink killed mid-write
                stale.unlink(missing_ok=True)
            atomic_write_bytes(path, table_bytes(rows_to_table(rows, table)))
            self.stats["files_written"] += 1
            self.stats["rows_written"] += len(rows)
            if self.opts.debug_pause:       # the chaos harness kills a sink inside this pause (MID_SEGMENT_LINE)
                log.info("%s: file %d of %d written; pausing %.2fs", name, i, len(files), self.opts.debug_pause)
                time.sleep(self.opts.debug_pause)

    async def _commit(self, tp, offset: int) -> None:
        try:
            await self.consumer.commit({tp: offset})
        except Exception as exc:  # noqa: BLE001 - the files are the truth; a lost commit costs a re-read
            self.stats["commits_failed"] += 1
            log.warning("commit of %s+%s at %s failed (%s: %s); the lake is unaffected",
                        tp.topic, tp.partition, offset, type(exc).__name__, exc)

    async def _tick(self) -> None:
        """Time rotation, and replay ranges whose end record is gone (retention/compaction)."""
        now = time.monotonic()
        for tp, p in list(self.parts.items()):
            if p.buf and p.buf_kind == "free" and now - p.started >= self.opts.rotate_seconds:
                await self._flush(tp, p)
            elif p.replay:
                try:
                    pos = await self.consumer.position(tp)
                except Exception:  # noqa: BLE001 - position unknown yet
                    continue
                if pos > p.replay[0][1]:
                    if p.buf_kind == "replay":
                        await self._flush(tp, p, complete=True)
                    elif not p.buf:
                        p.replay.pop(0)

    # ---------------------------------------------------------------- main loop
    async def run(self) -> dict[str, Any]:
        sink = self

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                await sink.on_revoked(revoked)

            async def on_partitions_assigned(self, assigned):
                await sink.on_assigned(assigned)

        self.consumer = AIOKafkaConsumer(
            **client_kwargs(self.kafka), group_id=self.opts.group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", isolation_level="read_committed",
            max_partition_fetch_bytes=32 << 20, fetch_max_bytes=64 << 20,
            rebalance_timeout_ms=max(60_000, int(self.opts.lock_timeout * 1000) + 30_000),
            session_timeout_ms=self.opts.session_timeout_ms,
            heartbeat_interval_ms=max(100, min(3000, self.opts.session_timeout_ms // 3)))
        self.consumer.subscribe(list(self.tables), listener=Listener())
        self._bar = tqdm(unit="rec", desc="sink", disable=not self.opts.progress, file=sys.stderr)
        await self.consumer.start()
        last_record = time.monotonic()
        t0 = time.monotonic()
        try:
            while not self.stop_event.is_set():
                batch = await self.consumer.getmany(timeout_ms=200, max_records=2000)
                n = 0
                async with self._lock:
                    for tp, records in batch.items():
                        p = self.parts.get(tp)
                        if p is None:           # revoked meanwhile: its new owner re-reads these
                            continue
                        for r in records:
                            await self._add(tp, p, r)
                        n += len(records)
                    await self._tick()
                if n:
                    last_record = time.monotonic()
                    self.stats["records"] += n
                    self._bar.update(n)
                if self.opts.max_records is not None and self.stats["records"] >= self.opts.max_records:
                    break
                if self.opts.until_idle is not None:
                    if not self.assigned_once.is_set():
                        last_record = time.monotonic()
                    elif time.monotonic() - last_record >= self.opts.until_idle:
                        break
            if self.fatal is not None:
                raise self.fatal
            async with self._lock:
                for tp, p in list(self.parts.items()):
                    await self._flush(tp, p)
        finally:
            try:
                await self.consumer.stop()
            finally:
                for p in self.parts.values():
                    self._release(p)
                self.parts.clear()
                self._bar.close()
        self.stats["elapsed_s"] = round(time.monotonic() - t0, 3)
        return dict(self.stats)


async def run_sink(kafka: KafkaOptions, opts: SinkOptions, install_signals: bool = True) -> dict[str, Any]:
    """Run the sink until SIGTERM/SIGINT (graceful: flush, commit, exit), ``until_idle`` or
    ``max_records``; returns counters."""
    sink = LakeSink(kafka, opts)
    loop = asyncio.get_running_loop()
    installed = []
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, sink.stop_event.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):
                pass
    try:
        return await sink.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
