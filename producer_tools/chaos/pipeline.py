"""One chaos pipeline run: topics, worker, sink, monitor, publish, settle, figures."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

from producer_tools import publish as P
from producer_tools.audit import audit_run
from producer_tools.chaos.broker import Broker, Topics, create_topics, request_progress
from producer_tools.chaos.figures import Figures
from producer_tools.chaos.monitor import Monitor, lake_rows
from producer_tools.chaos.processes import Managed, make_sink, make_worker, tiny_checkpoint
from producer_tools.chaos.review_check import check_review_topic, create_review_topic
from producer_tools.lake import read_lake
from producer_tools.run_manifest import RunManifest
from worker.scenes import generate_scene
from worker.scenes.request import scene_item

log = logging.getLogger("alpamayo.chaos")

GUARANTEES = ("exactly_once", "at_least_once")
DEFAULT_PARTITIONS = 4


_SCENES: list = []


def _scenes(k: int = 8) -> list:
    if not _SCENES:
        _SCENES.extend(generate_scene(s) for s in range(k))
    return _SCENES


class Pipeline:
    """Topics + a supervised worker + (optionally) a sink subprocess + a monitor on the outputs.
    Use as ``async with Pipeline(...) as pl:``; figures accumulate in ``pl.fig``."""

    def __init__(self, broker: Broker, *, scenario: str, guarantee: str, work: Path,
                 partitions: int = DEFAULT_PARTITIONS, replication_factor: int = 1, checkpoint: Path | None = None,
                 reasoning_tokens: int = 4, batch_size: int = 4, sink: bool = True,
                 worker_extra: dict[str, str] | None = None, device: str | None = None,
                 review_threshold: float | None = None):
        self.broker = broker
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.topics = Topics.fresh(scenario, partitions)
        tag = self.topics.req.split(".")[1]
        self.group = f"chaos-workers-{tag}"
        self.sink_group = f"chaos-sink-{tag}"
        self.run_id = f"chaos-{tag}"
        self.lake = self.work / "lake"
        self.runs = self.work / "runs"
        self.replication_factor = replication_factor
        self.checkpoint = checkpoint
        self.reasoning_tokens = reasoning_tokens
        self.batch_size = batch_size
        self.want_sink = sink
        self.worker_extra = dict(worker_extra or {})
        self.device = device or os.environ.get("ALPAMAYO_CHAOS_DEVICE") or "cpu"
        if checkpoint is None and os.environ.get("ALPAMAYO_CHAOS_CHECKPOINT"):
            self.checkpoint = Path(os.environ["ALPAMAYO_CHAOS_CHECKPOINT"])
        self.guarantee = guarantee
        self.review_threshold = review_threshold   # set: a review topic, K = 2 requests, checked at the end
        self.k = 1 if review_threshold is None else 2
        self.fig = Figures(scenario, guarantee)
        self.fig.extra["_topics"] = (self.topics.req, self.topics.res, self.topics.dl)
        self.worker: Managed | None = None
        self.sink: Managed | None = None
        self.monitor: Monitor | None = None
        self.raw: Monitor | None = None
        self.published = 0
        self._t0 = time.monotonic()

    async def __aenter__(self) -> "Pipeline":
        await create_topics(self.broker, self.topics, self.replication_factor)
        if self.review_threshold is not None:
            review = await create_review_topic(self.broker, self.topics, self.replication_factor)
            self.worker_extra.update(ALPAMAYO_REVIEW_TOPIC=review, NIM_ALPAMAYO_TRAJ_SAMPLES=str(self.k),
                                     ALPAMAYO_REVIEW_THRESHOLD=str(self.review_threshold))
        ckpt = self.checkpoint or await asyncio.to_thread(tiny_checkpoint)
        self.worker = make_worker(self.broker, self.topics, self.work, checkpoint=ckpt, group=self.group,
                                  guarantee=self.guarantee, reasoning_tokens=self.reasoning_tokens,
                                  batch_size=self.batch_size, device=self.device, extra=self.worker_extra)
        if self.want_sink:
            self.sink = make_sink(self.broker, self.topics, self.work, self.lake, self.sink_group)
        self.monitor = Monitor(self.broker, self.topics)
        await self.monitor.start()
        if self.guarantee == "exactly_once":    # what a reader ignoring transactions would see
            self.raw = Monitor(self.broker, self.topics, isolation="read_uncommitted")
            await self.raw.start()
        self._t0 = time.monotonic()
        return self

    async def __aexit__(self, *exc) -> None:
        for m in (self.worker, self.sink):
            if m is not None:
                await m.close()
        for mon in (self.monitor, self.raw):
            if mon is not None:
                await mon.stop()
        self.fig.wall_s = round(time.monotonic() - self._t0, 1)

    # ------------------------------------------------------------------ processes
    async def start_worker(self, timeout: float = 300.0) -> None:
        self.worker.supervise = True
        self.worker.start()
        await self.worker.wait_ready(timeout)

    def start_sink(self) -> None:
        if self.sink is not None:
            self.sink.supervise = True
            self.sink.start()

    async def restart_worker(self, timeout: float = 300.0) -> None:
        """SIGKILL, then start again (same static member id) until ready."""
        await self.worker.kill()
        self.worker.start()
        await self.worker.wait_ready(timeout)

    async def restart_sink(self) -> None:
        await self.sink.kill()
        self.sink.start()

    # ------------------------------------------------------------------ publishing
    def items(self, start: int, stop: int) -> list:
        scenes = _scenes()
        return [scene_item(scenes[i % len(scenes)], scene_id=f"sc{i:06d}") for i in range(start, stop)]

    async def publish(self, start: int, stop: int, rate: float | None = None) -> dict:
        """Scenes ``start..stop-1`` as trajectory requests of this run (the publish tool; its run
        manifest is what ``audit`` reconciles)."""
        kafka = self.broker.options(self.topics.req, self.topics.res, self.topics.dl)
        opts = P.PublishOptions(tasks=["trajectory"], k=self.k, run_id=self.run_id, runs_dir=str(self.runs),
                                progress=False,
                                rate=rate, max_inflight=256, source=f"chaos:{self.fig.scenario}")
        summary = await P.publish(kafka, self.items(start, stop), opts)
        self.published += summary["published"]
        log.info("published %d (%d..%d) in %.1fs", summary["published"], start, stop - 1, summary.get("elapsed_s", 0))
        return summary

    # ------------------------------------------------------------------ waiting
    async def wait_answered(self, n: int, timeout: float = 600.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.monitor.answered < n:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def settle(self, timeout: float = 600.0) -> bool:
        """Until the worker group committed the whole request topic, the monitor read the output
        topics to their end and the lake holds every output record."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                ends, committed = await request_progress(self.broker, self.topics, self.group)
            except Exception as exc:  # noqa: BLE001 - the broker may be down: keep polling
                last = f"offsets unavailable ({type(exc).__name__})"
                await asyncio.sleep(1.0)
                continue
            behind = {p: ends[p] - committed.get(p, 0) for p in ends if committed.get(p, 0) < ends[p]}
            if behind:
                last = f"worker lag {behind}"
            elif not await self.monitor.wait_at_end(15):
                last = "output topics not read to the end"
            elif self.sink is not None:
                rows = await asyncio.to_thread(lake_rows, self.lake)
                if rows >= self.monitor.records:
                    return True
                last = f"lake rows {rows} < output records {self.monitor.records}"
            else:
                return True
            await asyncio.sleep(1.0)
        self.fig.failures.append(f"did not settle within {timeout:.0f}s: {last}")
        log.error("did not settle: %s\nworker:\n%s", last, self.worker.tail())
        return False

    # ------------------------------------------------------------------ the end
    async def finish(self) -> Figures:
        """SIGTERM the worker (drain) and the sink; figures from the lake, audit and the topics."""
        f = self.fig
        f.final_exit_code = await self.worker.terminate(120)
        if f.failures:                   # what the worker did after the run went wrong, to its exit
            log.error("worker, exit code %s:\n%s", f.final_exit_code, self.worker.tail(60))
        if self.sink is not None:
            f.sink_exit_code = await self.sink.terminate(60)
        await self.monitor.stop()
        if self.raw is not None:
            await self.raw.wait_at_end(10)
            await self.raw.stop()
            aborted = self.raw.records - self.monitor.records
            raw_dup = sum(c - 1 for c in self.raw.by_id.values() if c > 1)
            f.extra["aborted outputs"] = (f"{aborted} output records of aborted transactions (a reader ignoring "
                                          f"transactions would see {raw_dup} duplicates)")
            if aborted:
                f.extra["aborted ids (sample)"] = sorted(i for i, c in self.raw.by_id.items()
                                                         if c > self.monitor.by_id.get(i, 0))[:5]
            f.extra["_aborted"] = aborted
        repairs = partition_repairs(self.worker.log_path(n) for n in range(1, self.worker.starts + 1))
        if repairs:                      # worker.partition_watch: the worker repaired a partition itself
            f.extra["partition repairs"] = f"{len(repairs)}: " + "; ".join(repairs[:3])
        f.worker_restarts = self.worker.restarts
        f.unplanned_exits = self.worker.unplanned_exits
        if self.sink is not None:
            f.sink_restarts = self.sink.restarts
            f.extra["sink unplanned exits"] = self.sink.unplanned_exits
            self._lake_figures()
            if self.review_threshold is not None:
                await check_review_topic(self.broker, self.topics, str(self.lake), self.review_threshold, f)
        elif not f.published:          # (fuzz fills its own, per message)
            self._topic_figures()
        if self.monitor.undecodable:
            f.failures.append(f"{self.monitor.undecodable} output records could not be decoded")
        if self.monitor.header_mismatch:
            f.failures.append(f"{self.monitor.header_mismatch} dead letters whose error-code header differs")
        f.wall_s = round(time.monotonic() - self._t0, 1)
        return f.check()

    def _topic_figures(self) -> None:
        f, m = self.fig, self.monitor
        f.results, f.dead_letters = m.results, m.dead_letters
        f.duplicated = sum(c - 1 for c in m.by_id.values() if c > 1)

    def _lake_figures(self) -> None:
        f = self.fig
        cols = ["request_id", "kafka_topic", "kafka_partition", "kafka_offset"]
        res = read_lake(str(self.lake), "results", columns=cols).to_pylist()
        dls = read_lake(str(self.lake), "dead_letters", columns=cols).to_pylist()
        published = RunManifest.for_run(self.runs, self.run_id).published_ids()
        ids = Counter(r["request_id"] for r in res + dls)
        coords = Counter((r["kafka_topic"], r["kafka_partition"], r["kafka_offset"]) for r in res + dls)
        f.published = len(published)
        f.results, f.dead_letters = len(res), len(dls)
        f.answered = len(published & set(ids))
        lost = published - set(ids)
        f.lost = len(lost)
        f.duplicated = sum(c - 1 for c in ids.values() if c > 1)
        f.lake_duplicates = sum(c - 1 for c in coords.values() if c > 1)
        deduped = Counter(r["request_id"] for t in ("results", "dead_letters")
                          for r in read_lake(str(self.lake), t, columns=["request_id"], dedupe=True).to_pylist())
        f.duplicated_after_dedup = sum(c - 1 for c in deduped.values() if c > 1)
        rep = audit_run(self.run_id, str(self.lake), runs_dir=str(self.runs))
        f.extra["audit"] = rep.verdict + \
            f" (missing {len(rep.missing)}, failed {len(rep.failed)}, redelivered {len(rep.duplicated)})"
        if set(rep.missing) != lost:
            f.failures.append(f"audit's missing ({len(rep.missing)}) differs from the lake's ({len(lost)})")
        if rep.lake_duplicates:
            f.failures.append(f"audit found lake duplicates: {rep.lake_duplicates[:5]}")
        if len(res) + len(dls) != self.monitor.records:
            f.failures.append(f"the lake holds {len(res) + len(dls)} rows, the topics {self.monitor.records} records")
        if rep.unexpected:
            f.failures.append(f"{len(rep.unexpected)} unexpected request ids in the lake")
        if lost:
            f.extra["lost ids (sample)"] = sorted(lost)[:10]


def _thresholds(total: int, n: int, rng: random.Random, lo: float = 0.05, hi: float = 0.9) -> list[int]:
    """``n`` progress points in (lo, hi) of ``total``, one drawn in each equal slice."""
    if n <= 0:
        return []
    a, b = lo * total, hi * total
    step = (b - a) / n
    return [max(1, int(a + step * i + rng.uniform(0.15, 0.85) * step)) for i in range(n)]


def _work_dir(work: str | os.PathLike | None, name: str) -> Path:
    if work is not None:
        p = Path(work)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return Path(tempfile.mkdtemp(prefix=f"alpamayo-chaos-{name}-"))


def partition_repairs(logs) -> list[str]:
    """The partition repairs (``worker.partition_watch``) the worker logs in ``logs`` report, each
    as its message (kind, partition, offsets), in order."""
    return [line.split(" WARNING alpamayo.worker: ", 1)[-1] for path in logs if Path(path).exists()
            for line in Path(path).read_text(errors="replace").splitlines() if "re-opening the partition" in line]
