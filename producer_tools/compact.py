"""``alpamayo-producer lake compact``: merge the lake's many small segment files, safely next to
running sinks and replays.

The sink (``producer_tools.sink``) names every file by its segment's offset range and keeps the
ranges in a per-partition range index; on assignment it replays, with their own bounds, the ranges
that end at or after the group's committed offset, writing only the files still missing. So:

* Only *finished* ranges are merged: those that end below the sink group's committed offset (the
  sink commits ``end + 1`` only once every file of the range is durable), read from Kafka (the
  sink's ``--group-id``). A sink never writes a finished range again except in a replay after its
  offsets were reset, and a replay of the merged range finds its files present.
* Consecutive finished ranges ``[s1, e1] .. [sn, en]`` of one topic-partition become one range
  ``[s1, en]``: in every directory (and table) holding files of them, one file of their rows in
  offset order, written atomically; then the index swaps the ranges for ``[s1, en]`` (under the
  index lock the sink also takes to append, so no append is lost); then the inputs are deleted.
* Readers (``lake.read_lake``) and a sink rebuilding its index from a scan skip a segment file
  inside a wider one of the same directory, so a reader during a compaction, or after one cut
  short, sees every row once. A compaction cut short before the index swap leaves merged files the
  index does not list: the next compaction deletes them (their inputs are all still there); cut
  short after it, leftover inputs are deleted by the next one.
* Two compactions of one partition never run at once (a lock file per partition, not waited for).

A DuckDB or pandas reader globbing the files itself (not through ``read_lake``) can see a
partition's rows twice while its inputs are being deleted: run such queries between compactions,
or deduplicate on (kafka_topic, kafka_partition, kafka_offset).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from producer_tools.common import KafkaOptions, atomic_write_bytes, client_kwargs, fsync_dir
from producer_tools.lake import (NULL_PARTITION, merge_ranges, parse_segment_file_name, read_range_index,
                                 segment_file_name)
from producer_tools.lake_tables import TABLES, table_bytes

__all__ = ["committed_offsets", "compact_lake", "DEFAULT_TARGET_ROWS"]

log = logging.getLogger("alpamayo.compact")

DEFAULT_TARGET_ROWS = 100_000
"""A merged range stops growing once its files hold this many rows (all directories together)."""

Files = dict[tuple[int, int], dict[Path, Path]]       # range -> {directory: file}


async def committed_offsets(kafka: KafkaOptions, group_id: str) -> dict[tuple[str, int], int]:
    """{(topic, partition): committed offset} of the sink's consumer group."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group_id)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): om.offset for tp, om in offsets.items() if om.offset >= 0}


def _partition_files(lake: Path, topic: str, partition: int) -> Files:
    out: Files = defaultdict(dict)
    for table in TABLES:
        for dirpath, dirs, names in os.walk(lake / table):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            for name in names:
                seg = parse_segment_file_name(name)
                if seg is not None and seg[:2] == (topic, partition):
                    out[seg[2:]][Path(dirpath)] = Path(dirpath) / name
    return out


def _delete(paths) -> None:
    dirs = set()
    for p in paths:
        p.unlink(missing_ok=True)
        dirs.add(p.parent)
    for d in dirs:
        fsync_dir(d)


def _heal(files: Files, ranges: list[tuple[int, int]], stats: dict) -> None:
    """Finish what an interrupted compaction left: merged files the index does not list (cut short
    before the swap: their inputs are all there) and inputs inside a listed range whose file is
    in the same directory (cut short after it) are deleted."""
    listed = set(ranges)
    for r, by_dir in list(files.items()):
        if r in listed:
            continue
        inside = [x for x in ranges if r[0] <= x[0] and x[1] <= r[1]]
        outer = [x for x in ranges if x[0] <= r[0] and r[1] <= x[1]]
        if inside and inside[0][0] == r[0] and inside[-1][1] == r[1]:
            _delete(by_dir.values())
            stats["unfinished_merges_removed"] += len(by_dir)
            del files[r]
        elif outer:
            gone = [f for d, f in by_dir.items() if d in files.get(outer[0], {})]
            _delete(gone)
            stats["leftover_inputs_removed"] += len(gone)


def _rows(paths) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def _plan(files: Files, finished: list[tuple[int, int]], target_rows: int) -> list[list[tuple[int, int]]]:
    """Runs of consecutive finished ranges, each up to ``target_rows`` rows; only runs of 2 or more."""
    groups, cur, rows = [], [], 0
    for r in finished:
        n = _rows(files.get(r, {}).values())
        if cur and rows + n > target_rows:
            groups.append(cur)
            cur, rows = [], 0
        cur.append(r)
        rows += n
    groups.append(cur)
    return [g for g in groups if len(g) > 1]


def _merged_table(table: str, directory: Path, paths: list[Path]) -> pa.Table:
    schema = TABLES[table]
    parts = []
    for p in paths:
        t = pq.read_table(p)
        t = pa.table({f.name: t.column(f.name) if f.name in t.column_names else pa.nulls(t.num_rows, f.type)
                      for f in schema}, schema=schema)
        parts.append(t)
    merged = pa.concat_tables(parts)
    run = directory.parent.name.removeprefix("run_id=")     # files of an older sink: run_id only in the path
    if merged.column("run_id").null_count == merged.num_rows and run != NULL_PARTITION:
        merged = merged.set_column(schema.get_field_index("run_id"), "run_id",
                                   pa.array([unquote(run)] * merged.num_rows, pa.string()))
    return merged


def _compact_partition(lake: Path, topic: str, partition: int, committed: int, target_rows: int,
                       stats: dict) -> None:
    ranges = read_range_index(lake, topic, partition) or []
    files = _partition_files(lake, topic, partition)
    _heal(files, ranges, stats)
    finished = [r for r in ranges if r[1] < committed]
    for group in _plan(files, finished, target_rows):
        into = (group[0][0], group[-1][1])
        name = segment_file_name(topic, partition, *into)
        inputs: dict[Path, list[Path]] = defaultdict(list)
        for r in group:                                          # offset order
            for d, f in files.get(r, {}).items():
                inputs[d].append(f)
        for d, paths in sorted(inputs.items()):
            table = d.relative_to(lake).parts[0]
            atomic_write_bytes(d / name, table_bytes(_merged_table(table, d, paths)))
            stats["files_written"] += 1
        if not merge_ranges(lake, topic, partition, group, into):
            _delete(d / name for d in inputs)                      # the index changed meanwhile: undo
            stats["groups_skipped"] += 1
            continue
        old = [f for paths in inputs.values() for f in paths]
        _delete(old)
        stats["files_removed"] += len(old)
        stats["ranges_merged"] += len(group)


@contextlib.contextmanager
def _compaction_lock(lake: Path, topic: str, partition: int):
    path = lake / "_sink" / "locks" / f"{topic}+{partition}.compact.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def compact_lake(lake: str | os.PathLike, committed: dict[tuple[str, int], int],
                 target_rows: int = DEFAULT_TARGET_ROWS) -> dict[str, Any]:
    """Compact every topic-partition with a range index; ``committed``: the sink group's committed
    offsets (:func:`committed_offsets`). Returns counters."""
    lake = Path(lake)
    stats = defaultdict(int)
    before = sum(1 for t in TABLES for _ in (lake / t).rglob("*.parquet"))
    for index in sorted((lake / "_sink" / "ranges").glob("*.ranges")):
        topic, _, part = index.stem.rpartition("+")
        c = committed.get((topic, int(part)))
        if c is None:
            stats["partitions_without_commit"] += 1
            continue
        with _compaction_lock(lake, topic, int(part)) as mine:
            if not mine:
                stats["partitions_busy"] += 1
                continue
            _compact_partition(lake, topic, int(part), c, target_rows, stats)
            stats["partitions"] += 1
    stats["files_before"] = before
    stats["files_after"] = sum(1 for t in TABLES for _ in (lake / t).rglob("*.parquet"))
    return dict(stats)
