"""``multi-sink``: three lake sinks in one consumer group, SIGKILLed, SIGTERMed and restarted at
random while they replay crashed segments -> every committed result record exactly once in the
lake (none lost, none twice, none of an aborted transaction).

No worker: result records are published straight to the results topic in transactions (one in
eight aborted), in waves while the faults run. The sinks rotate segments every few rows and pause
after each data file (``--debug-pause``, logged), and the first SIGKILL and half of the others wait
for a sink inside such a pause between two files of one segment; the partition's next owner must
finish that segment with its own bounds, and may itself be killed, stopped (its replay cut short)
or revoked (a restarted sink joins) while it does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time
import uuid
from collections import Counter
from pathlib import Path

from aiokafka import AIOKafkaProducer, TopicPartition

import schemas as S
from producer_tools.chaos.broker import Broker, Topics, _consumer, create_topics
from producer_tools.chaos.figures import Figures
from producer_tools.chaos.pipeline import _work_dir
from producer_tools.chaos.processes import Managed, make_sink
from producer_tools.lake import read_lake

log = logging.getLogger("alpamayo.chaos")

SINKS = 3
TXN_RECORDS = 10            # records per transaction; every ABORT_EVERY-th transaction is aborted
ABORT_EVERY = 8
RUNS = ("ms-a", "ms-b", "ms-c")     # three run ids: three files per segment
REPLAY_LINE = "are finished with their own bounds"
CUT_LINE = "left to the next owner"
STARTUP_S = 5.0             # SIGTERM only sinks up this long (their handler is installed)
MID_SEGMENT_LINE = re.compile(r": file (\d+) of (\d+) written; pausing")    # the sink's debug-pause line
TARGET_WAIT_S = 5.0         # a targeted kill waits this long for a sink paused mid-segment, then kills any


def _result(rid: str, run: str, i: int) -> S.InferResult:
    return S.InferResult(
        request_id=rid, run_id=run, task="trajectory", labels={"scene_id": f"s{i}"}, num_samples=1,
        pred_trajectories=[[[0.1 * t, 0.01 * i, 0.0] for t in range(64)]],
        metrics=S.ResultMetrics(reasoning_texts=["r"], generated_tokens=[1], timings=S.StageTimings(total_ms=1.0)),
        model=S.ModelIdentity(id="chaos", profile="bf16", precision="bf16", checkpoint_hash="0"),
        completed_at=time.time())


async def _publish(broker: Broker, topic: str, start: int, stop: int, tag: str,
                   committed: set, aborted: set) -> None:
    """Records ``start..stop-1`` in transactions; the coordinates of committed and aborted ones."""
    producer = AIOKafkaProducer(**broker.client_kw(), transactional_id=f"{tag}-{start}", enable_idempotence=True,
                                acks="all")
    await producer.start()
    try:
        for t0 in range(start, stop, TXN_RECORDS):
            abort = (t0 // TXN_RECORDS) % ABORT_EVERY == ABORT_EVERY - 1
            async with producer.transaction() if not abort else _Aborting(producer):
                futs = []
                for i in range(t0, min(stop, t0 + TXN_RECORDS)):
                    run = RUNS[i % len(RUNS)]
                    rid = f"{run}:s{i}:trajectory:k1"
                    value, headers = S.encode_result(_result(rid, run, i))
                    futs.append(await producer.send(topic, value, key=rid.encode(), headers=headers))
                mds = [await f for f in futs]
            (aborted if abort else committed).update((md.partition, md.offset) for md in mds)
    finally:
        await producer.stop()


class _Aborting:
    """A transaction that is aborted at its end (what a crashed worker's open transaction becomes)."""

    def __init__(self, producer: AIOKafkaProducer):
        self.producer = producer

    async def __aenter__(self):
        await self.producer.begin_transaction()

    async def __aexit__(self, *exc):
        await self.producer.abort_transaction()


def _paused_mid_segment(m: Managed, pause: float) -> bool:
    """Whether sink m is inside its debug pause between two files of one segment: its log's last
    written-file line reads "file i of n" with i < n, and the log changed less than half a pause ago."""
    path = m.log_path()
    try:
        st = path.stat()
        if time.time() - st.st_mtime > pause / 2:
            return False
        with path.open("rb") as f:
            f.seek(max(0, st.st_size - 4096))
            hits = MID_SEGMENT_LINE.findall(f.read().decode(errors="replace"))
    except OSError:
        return False
    return bool(hits) and int(hits[-1][0]) < int(hits[-1][1])


async def _paused_sink(alive: list[Managed], pause: float) -> Managed | None:
    """The first of `alive` seen paused mid-segment within TARGET_WAIT_S (logs polled every 10 ms)."""
    deadline = time.monotonic() + TARGET_WAIT_S
    while time.monotonic() < deadline:
        for m in alive:
            if m.alive and _paused_mid_segment(m, pause):
                return m
        await asyncio.sleep(0.01)
    return None


async def _settled(broker: Broker, topics: Topics, group: str, committed: set) -> bool:
    """The group's committed offsets are past the last committed record of every partition."""
    last: dict[int, int] = {}
    for p, o in committed:
        last[p] = max(last.get(p, -1), o)
    c = await _consumer(broker, group_id=group)
    try:
        for p, o in last.items():
            if ((await c.committed(TopicPartition(topics.res, p))) or 0) <= o:
                return False
        return True
    finally:
        await c.stop()


def _count_log_lines(sinks: list[Managed], text: str) -> int:
    n = 0
    for m in sinks:
        for i in range(1, m.starts + 1):
            try:
                n += m.log_path(i).read_text(errors="replace").count(text)
            except OSError:
                pass
    return n


async def run_multi_sink(broker: Broker, *, scenes: int = 600, faults: int = 12, partitions: int = 4,
                         seed: int = 0, work: str | os.PathLike | None = None, timeout: float = 600.0,
                         rotate_rows: int = 7, debug_pause: float = 0.05, gap_s: tuple[float, float] = (0.5, 2.5)
                         ) -> Figures:
    """Publish ``scenes`` result records in 4 waves while ``faults`` random faults hit the 3 sinks
    (SIGKILL, SIGTERM, restart of a stopped one); settle with all 3 up; SIGTERM; count the lake."""
    rng = random.Random(seed)
    work = Path(_work_dir(work, "multi-sink"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    fig = Figures(scenario="multi-sink", guarantee="exactly_once")
    topics = Topics.fresh("multi-sink", partitions)
    await create_topics(broker, topics)
    tag = f"chaos-multi-sink-{uuid.uuid4().hex[:8]}"
    lake = work / "lake"
    sinks = []
    for k in range(SINKS):
        m = make_sink(broker, topics, work, lake, tag)
        m.name = f"sink{k}"
        m.argv += ["--rotate-rows", str(rotate_rows), "--debug-pause", str(debug_pause)]
        m.argv.insert(m.argv.index("sink"), "-v")
        sinks.append(m)
    committed: set = set()
    aborted: set = set()
    actions = Counter()
    started: dict[str, float] = {}

    def start(m: Managed) -> None:
        m.start()
        started[m.name] = time.monotonic()

    try:
        for m in sinks:
            start(m)
        waves = 4
        bounds = [scenes * w // waves for w in range(waves + 1)]

        async def publishing() -> None:
            for w in range(waves):
                await _publish(broker, topics.res, bounds[w], bounds[w + 1], tag, committed, aborted)
                await asyncio.sleep(rng.uniform(*gap_s) * 2)

        async def faulting() -> None:
            for _ in range(faults):
                await asyncio.sleep(rng.uniform(*gap_s))
                alive = [m for m in sinks if m.alive]
                stopped = [m for m in sinks if not m.alive]
                kind = rng.choice(["kill", "kill", "term", "start"]) if alive else "start"
                if kind == "start" and not stopped:
                    kind = "kill"
                if kind != "start" and len(alive) == 1 and stopped:
                    kind = "start"          # keep at least one sink consuming
                if kind == "kill":
                    targeted = fig.sink_kills == 0 or rng.random() < 0.5
                    victim = (await _paused_sink(alive, debug_pause) if targeted else None) or rng.choice(alive)
                    await victim.kill()
                    fig.sink_kills += 1
                elif kind == "term":          # a sink still importing has no SIGTERM handler yet
                    settled_in = [m for m in alive if time.monotonic() - started[m.name] >= STARTUP_S]
                    if not settled_in:
                        continue
                    m = rng.choice(settled_in)
                    code = await m.terminate(60)
                    if code != 0:
                        fig.failures.append(f"{m.name} exited {code} after SIGTERM:\n{m.tail(8)}")
                else:
                    start(rng.choice(stopped))
                    fig.sink_restarts += 1
                actions[kind] += 1

        await asyncio.gather(publishing(), faulting())
        fig.kills_requested = fig.sink_kills
        for m in sinks:
            if not m.alive:
                start(m)
                fig.sink_restarts += 1
        t_settle = time.monotonic()
        deadline = t_settle + timeout
        while not await _settled(broker, topics, tag, committed):
            if time.monotonic() > deadline:
                fig.failures.append(f"the sinks did not commit every record within {timeout:.0f}s")
                break
            await asyncio.sleep(1.0)
        fig.settle_s = round(time.monotonic() - t_settle, 1)
        await asyncio.sleep(max(0.0, STARTUP_S - (time.monotonic() - max(started.values()))))
        codes = [await m.terminate(60) for m in sinks]
        fig.sink_exit_code = next((c for c in codes if c != 0), 0)
    finally:
        for m in sinks:
            await m.close()
    tbl = read_lake(lake, "results", columns=["kafka_partition", "kafka_offset"])
    rows = Counter(zip(tbl.column("kafka_partition").to_pylist(), tbl.column("kafka_offset").to_pylist()))
    fig.published = len(committed)
    fig.results = tbl.num_rows
    fig.answered = len(committed & set(rows))
    fig.lost = len(committed - set(rows))
    fig.lake_duplicates = sum(n - 1 for n in rows.values())
    phantom = sum(n for coord, n in rows.items() if coord not in committed)
    replays, cut = _count_log_lines(sinks, REPLAY_LINE), _count_log_lines(sinks, CUT_LINE)
    fig.extra.update({"sinks": SINKS, "partitions": partitions, "faults": dict(actions),
                      "aborted records": len(aborted), "rows of aborted or unknown records": phantom,
                      "assignments with segments to replay": replays, "replays cut short": cut})
    if phantom:
        fig.failures.append(f"{phantom} lake row(s) of records that were never committed")
    if fig.sink_kills and not replays:
        fig.failures.append("no sink found a crashed segment to replay: the scenario tested nothing")
    fig.wall_s = round(time.monotonic() - t_start, 1)
    return fig.check()
