"""The Parquet lake the sink writes and ``audit``, ``dlq``, ``report`` and the chaos harness read:
its layout (fixed schemas, Hive directories, segment file names = the sink's offset log) and its
readers (``scan_ranges``, ``read_lake``, ``one_row_per_request``).

Layout::

    <lake>/results/run_id=<run>/date=<YYYY-MM-DD>/<topic>+<partition>+<start>-<end>.parquet
    <lake>/dead_letters/run_id=<run>/date=<YYYY-MM-DD>/<topic>+<partition>+<start>-<end>.parquet

(also ``samples/`` and ``requests/``, see ``producer_tools.lake_tables``). ``run_id`` is
URI-encoded in the path (``__HIVE_DEFAULT_PARTITION__`` when null) and a column in the files;
``date`` comes from the path. Files hold the fixed schemas of ``producer_tools.lake_tables``.
How the sink writes them exactly once: ``producer_tools.sink``; how ``lake compact`` merges them:
``producer_tools.compact``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections import defaultdict
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa

from producer_tools.common import ToolError, atomic_write_bytes, fsync_dir
from producer_tools.lake_tables import DEAD_LETTER_SCHEMA, REQUEST_SCHEMA, RESULT_SCHEMA, SAMPLE_SCHEMA, TABLES

__all__ = [
    "RESULT_SCHEMA",
    "DEAD_LETTER_SCHEMA",
    "SAMPLE_SCHEMA",
    "REQUEST_SCHEMA",
    "PARTITION_SCHEMA",
    "TABLES",
    "NULL_PARTITION",
    "segment_file_name",
    "parse_segment_file_name",
    "hive_dir",
    "scan_ranges",
    "check_ranges",
    "range_index_path",
    "read_range_index",
    "write_range_index",
    "append_range",
    "merge_ranges",
    "lake_files",
    "read_lake",
    "one_row_per_request",
]

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
_STR = pa.string()
PARTITION_SCHEMA = pa.schema([pa.field("run_id", _STR), pa.field("date", _STR)])

_SEGMENT_RE = re.compile(r"^(?P<topic>[A-Za-z0-9._-]+)\+(?P<partition>\d+)\+(?P<start>\d+)-(?P<end>\d+)\.parquet$")


def segment_file_name(topic: str, partition: int, start: int, end: int) -> str:
    """``<topic>+<partition>+<startOffset>-<endOffset>.parquet`` (offsets inclusive)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", topic):
        raise ValueError(f"not a Kafka topic name: {topic!r}")
    if not 0 <= start <= end:
        raise ValueError(f"bad offset range {start}-{end}")
    return f"{topic}+{int(partition)}+{int(start)}-{int(end)}.parquet"


def parse_segment_file_name(name: str) -> tuple[str, int, int, int] | None:
    """(topic, partition, start, end) of a segment file name, or None."""
    m = _SEGMENT_RE.match(name)
    if not m:
        return None
    return m["topic"], int(m["partition"]), int(m["start"]), int(m["end"])


def _partition_value(v: str | None) -> str:
    return NULL_PARTITION if v is None or v == "" else quote(v, safe="")


def hive_dir(lake: str | os.PathLike, table: str, run_id: str | None, date: str) -> Path:
    return Path(lake) / table / f"run_id={_partition_value(run_id)}" / f"date={date}"


def scan_ranges(lake: str | os.PathLike, table: str) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """{(topic, partition): sorted distinct [start, end] ranges} of a table's segment files."""
    out: dict[tuple[str, int], set[tuple[int, int]]] = defaultdict(set)
    root = Path(lake) / table
    if not root.is_dir():
        return {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = parse_segment_file_name(name)
            if p is not None:
                out[(p[0], p[1])].add((p[2], p[3]))
    return {k: _outermost(v) for k, v in out.items()}


def _outermost(ranges) -> list[tuple[int, int]]:
    """Sorted ranges without those inside another (the inputs of an unfinished ``lake compact``)."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges, key=lambda r: (r[0], -r[1])):
        if not out or e > out[-1][1]:
            out.append((s, e))
    return out


def check_ranges(topic: str, partition: int, ranges: list[tuple[int, int]]) -> None:
    for (s1, e1), (s2, e2) in zip(ranges, ranges[1:]):
        if s2 <= e1:
            raise ToolError(f"the lake holds overlapping segments of {topic}+{partition}: {s1}-{e1} and {s2}-{e2}; "
                            "refusing to write (was a sink run without the partition lock?)")


# --------------------------------------------------------------------------------------------
# the range index: the sink's offset log of one topic-partition, one "<start> <end>" line per segment
# --------------------------------------------------------------------------------------------


def range_index_path(lake: str | os.PathLike, topic: str, partition: int) -> Path:
    """``<lake>/_sink/ranges/<topic>+<partition>.ranges`` (readers of the tables skip ``_`` paths)."""
    return Path(lake) / "_sink" / "ranges" / f"{topic}+{int(partition)}.ranges"


@contextlib.contextmanager
def _index_locked(lake: str | os.PathLike, topic: str, partition: int):
    """Held for every change of a range index: the sink's appends and repairs, and ``lake compact``'s
    read-modify-write, never interleave (an append to a file being replaced would be lost)."""
    path = range_index_path(lake, topic, partition).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                    # releases the lock


def _read_index(lake, topic: str, partition: int) -> tuple[list[tuple[int, int]] | None, bool]:
    """(sorted distinct ranges or None, whether the last line is a torn append)."""
    path = range_index_path(lake, topic, partition)
    try:
        text = path.read_text("ascii")
    except FileNotFoundError:
        return None, False
    lines = text.split("\n")
    out = set()
    for i, line in enumerate(lines[:-1]):            # lines[-1]: "" or a torn append
        m = re.fullmatch(r"(\d+) (\d+)", line)
        if not m or int(m[1]) > int(m[2]):
            raise ToolError(f"{path}: line {i + 1} is not '<start> <end>': {line[:80]!r}")
        out.add((int(m[1]), int(m[2])))
    return sorted(out), bool(lines[-1])


def _write_index(lake, topic: str, partition: int, ranges) -> None:
    atomic_write_bytes(range_index_path(lake, topic, partition),
                       "".join(f"{s} {e}\n" for s, e in sorted(set(ranges))).encode("ascii"))


def read_range_index(lake: str | os.PathLike, topic: str, partition: int,
                     repair: bool = False) -> list[tuple[int, int]] | None:
    """Sorted distinct ranges of the index, or None when the partition has none yet. A last line
    without its newline is an append torn by a crash: no file of that range was written (files
    come after the line is durable), so it is ignored (``repair``: and cut off, so that the next
    append starts a line; only the holder of the partition's lock may repair)."""
    with _index_locked(lake, topic, partition):
        ranges, torn = _read_index(lake, topic, partition)
        if repair and torn:
            _write_index(lake, topic, partition, ranges)
    return ranges


def write_range_index(lake: str | os.PathLike, topic: str, partition: int, ranges: list[tuple[int, int]]) -> None:
    """Create the index (atomically) from ranges found by one scan of the lake."""
    with _index_locked(lake, topic, partition):
        _write_index(lake, topic, partition, ranges)


def append_range(lake: str | os.PathLike, topic: str, partition: int, start: int, end: int) -> None:
    """Record a new segment's bounds durably, before any of its files is written."""
    path = range_index_path(lake, topic, partition)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _index_locked(lake, topic, partition):
        new = not path.exists()
        with open(path, "ab") as f:
            f.write(f"{int(start)} {int(end)}\n".encode("ascii"))
            f.flush()
            os.fsync(f.fileno())
    if new:
        fsync_dir(path.parent)


def merge_ranges(lake: str | os.PathLike, topic: str, partition: int, merged: list[tuple[int, int]],
                 into: tuple[int, int]) -> bool:
    """Replace the ranges ``merged`` by the one range ``into`` in the index (``lake compact``, once
    the merged files are durable); False, and nothing changed, when one of them is no longer listed."""
    with _index_locked(lake, topic, partition):
        ranges, _torn = _read_index(lake, topic, partition)
        if ranges is None or not set(merged) <= set(ranges):
            return False
        _write_index(lake, topic, partition, [r for r in ranges if r not in set(merged)] + [into])
    return True


_COORDS = ("kafka_topic", "kafka_partition", "kafka_offset")


def one_row_per_request(tbl: pa.Table) -> pa.Table:
    """At-least-once re-deliveries removed: of the rows sharing a ``request_id``, the one of the
    earliest Kafka record (topic, partition, offset) is kept; rows without a request id are kept.
    Deterministic (the lake's files are), and in the lake's row order otherwise."""
    import pyarrow.compute as pc  # slow to import; only readers need it, not the sink

    idx = pa.array(range(tbl.num_rows), pa.int64())
    keyed = tbl.select(["request_id", *_COORDS]).append_column("_row", idx)
    keyed = keyed.take(pc.sort_indices(keyed, [(c, "ascending") for c in ("request_id", *_COORDS)]))
    first = keyed.filter(pc.is_valid(keyed["request_id"])).group_by("request_id", use_threads=False) \
        .aggregate([("_row", "first")]).column("_row_first")
    keep = pa.concat_arrays([first.combine_chunks().cast(pa.int64()),
                             keyed.filter(pc.is_null(keyed["request_id"]))["_row"].combine_chunks()])
    return tbl.take(pc.take(keep, pc.sort_indices(keep)))


def lake_files(lake: str | os.PathLike, table: str, run_id: str | None = None) -> list[str]:
    """The data files of a table (optionally one run's) a reader reads: every ``*.parquet`` outside
    ``_``/``.`` paths, except a segment whose range lies inside another segment's range of the same
    topic-partition in the same directory: the input of a ``lake compact`` whose merged file (which
    holds its rows) is already there and which is about to be deleted."""
    root = Path(lake) / table
    if run_id is not None:
        root = root / f"run_id={_partition_value(run_id)}"
    out: list[str] = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        segments: dict[tuple[str, int], dict[tuple[int, int], str]] = defaultdict(dict)
        for name in sorted(files):
            if name.startswith(("_", ".")) or not name.endswith(".parquet"):
                continue
            seg = parse_segment_file_name(name)
            if seg is None:
                out.append(os.path.join(dirpath, name))
            else:
                segments[seg[:2]][seg[2:]] = name
        for names in segments.values():
            out.extend(os.path.join(dirpath, names[r]) for r in _outermost(names))
    return out


def read_lake(lake: str | os.PathLike, table: str = "results", run_id: str | None = None,
              columns: list[str] | None = None, dedupe: bool = False) -> pa.Table:
    """The table (``date`` from the path), optionally one run's rows only; ``dedupe``: one row per
    request id (`one_row_per_request`), what lake consumers usually want from an at-least-once run."""
    if dedupe:
        cols = None if columns is None else list(dict.fromkeys([*columns, "request_id", *_COORDS]))
        tbl = one_row_per_request(read_lake(lake, table, run_id, cols))
        return tbl.select(columns) if columns else tbl
    import pyarrow.dataset as ds  # slow to import; only readers need it, not the sink

    schema = pa.schema(list(TABLES[table]) + [pa.field("date", _STR)])
    files = lake_files(lake, table, run_id)
    if not files:
        tbl = schema.empty_table()
        return tbl.select(columns) if columns else tbl
    d = ds.dataset(files, format="parquet", schema=schema, partition_base_dir=str(Path(lake) / table),
                   partitioning=ds.partitioning(PARTITION_SCHEMA, flavor="hive"))
    return d.to_table(columns=columns)
