"""The output topics as a reader sees them (read_committed), and the lake's row count."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

import schemas as S
from producer_tools.chaos.broker import Broker, Topics, _consumer

log = logging.getLogger("alpamayo.chaos")


class Monitor:
    """Reads the result and dead-letter topics from the beginning (read_committed) for the whole
    run: outputs per request id and per source record, record counts, end-of-topic status."""

    def __init__(self, broker: Broker, topics: Topics, isolation: str = "read_committed"):
        self.broker = broker
        self.topics = topics
        self.isolation = isolation
        self.by_id: Counter = Counter()
        self.by_source: dict[tuple[str, int, int], list[tuple[str, str | None]]] = defaultdict(list)
        self.records = 0
        self.results = 0
        self.dead_letters = 0
        self.codes: Counter = Counter()
        self.undecodable = 0
        self.header_mismatch = 0
        self.at_end = False
        self.errors = 0
        self._task: asyncio.Task | None = None
        self._consumer = None
        self._stop = False

    @property
    def answered(self) -> int:
        return len(self.by_id)

    async def start(self) -> None:
        self._consumer = await _consumer(self.broker, isolation_level=self.isolation,
                                         max_partition_fetch_bytes=8 << 20)
        self._tps = [TopicPartition(t, p) for t in (self.topics.res, self.topics.dl)
                     for p in range(self.topics.partitions)]
        self._consumer.assign(self._tps)
        await self._consumer.seek_to_beginning(*self._tps)
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        c = self._consumer
        last_check = 0.0
        while not self._stop:
            try:
                data = await c.getmany(timeout_ms=300, max_records=5000)
                for tp, recs in data.items():
                    for r in recs:
                        self._add(tp.topic, r)
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    ends = await c.end_offsets(self._tps)
                    self.at_end = all([await c.position(tp) >= ends[tp] for tp in self._tps]) and not data
            except KafkaError as exc:
                self.errors += 1
                self.at_end = False
                log.debug("monitor: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(0.5)

    def _add(self, topic: str, r) -> None:
        self.records += 1
        try:
            if topic == self.topics.res:
                msg = S.decode_result(r.value, list(r.headers))
                src = (msg.lineage.topic, msg.lineage.partition, msg.lineage.offset) if msg.lineage else None
                rid, code = msg.request_id, None
                self.results += 1
            else:
                msg = S.decode_dead_letter(r.value, list(r.headers))
                src = (msg.source.topic, msg.source.partition, msg.source.offset)
                rid, code = msg.request_id, msg.error_code.value
                self.dead_letters += 1
                self.codes[code] += 1
                hdr = dict((k, v) for k, v in r.headers).get("error-code")
                if hdr != code.encode():
                    self.header_mismatch += 1
        except Exception:  # noqa: BLE001 - counted, reported
            self.undecodable += 1
            return
        self.by_id[rid if rid is not None else f"@{src}"] += 1
        if src is not None:
            self.by_source[src].append(("result" if code is None else "dead_letter", code))

    async def wait_at_end(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.at_end = False
            await asyncio.sleep(1.2)
            if self.at_end:
                return True
        return False

    async def stop(self) -> None:
        self._stop = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()


def lake_rows(lake: Path) -> int:
    """Rows in the lake's data files (results + dead letters), from the Parquet footers."""
    n = 0
    for table in ("results", "dead_letters"):
        root = lake / table
        if not root.is_dir():
            continue
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                if name.endswith(".parquet") and not name.startswith("."):
                    with contextlib.suppress(OSError, Exception):
                        n += pq.read_metadata(os.path.join(dirpath, name)).num_rows
    return n
