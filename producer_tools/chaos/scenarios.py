"""The chaos scenarios: crash, broker-restart, leader-kill, fuzz, soak (see ``producer_tools.chaos``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

from aiokafka import AIOKafkaProducer

from producer_tools.chaos.broker import Broker, partition_leader
from producer_tools.chaos.figures import Figures
from producer_tools.chaos.fuzz import FuzzCase, fuzz_cases, prepare_claim_root
from producer_tools.chaos.pipeline import DEFAULT_PARTITIONS, Pipeline, _thresholds, _work_dir
from producer_tools.chaos.processes import _http_text, _mb, peak_rss_bytes

log = logging.getLogger("alpamayo.chaos")


async def run_crash(broker: Broker, *, scenes: int = 80, kills: int = 3, guarantee: str = "exactly_once",
                    sink_kills: int = 0, seed: int = 0, work: str | os.PathLike | None = None,
                    partitions: int = DEFAULT_PARTITIONS, jitter_s: float = 0.3, timeout: float = 900.0,
                    reasoning_tokens: int = 4, batch_size: int = 4, review_threshold: float | None = None) -> Figures:
    """Publish ``scenes``, SIGKILL the worker ``kills`` times (and the sink ``sink_kills`` times) at
    random moments mid-run, restart it each time; settle; sink + audit. ``review_threshold``: K = 2
    requests and a review topic, checked against the lake (``producer_tools.chaos.review_check``)."""
    rng = random.Random(seed)
    work = _work_dir(work, "crash")
    async with Pipeline(broker, scenario="crash", guarantee=guarantee, work=work / guarantee, partitions=partitions,
                        reasoning_tokens=reasoning_tokens, batch_size=batch_size,
                        review_threshold=review_threshold) as pl:
        pl.fig.kills_requested = kills + sink_kills
        await pl.publish(0, scenes)
        pl.start_sink()
        await pl.start_worker()
        last_fault = time.monotonic()

        async def worker_faults() -> None:
            nonlocal last_fault
            for th in _thresholds(scenes, kills, rng, hi=0.75):
                if not await pl.wait_answered(th, timeout):
                    pl.fig.failures.append(f"no progress to {th} answered before a kill")
                    return
                await asyncio.sleep(rng.uniform(0.0, jitter_s))
                if pl.monitor.answered >= scenes:
                    log.warning("kill skipped: the run is already answered")
                    return
                last_fault = time.monotonic()
                await pl.restart_worker()
                pl.fig.worker_kills += 1

        async def sink_faults() -> None:
            nonlocal last_fault
            for th in _thresholds(scenes, sink_kills, rng, lo=0.1, hi=0.95):
                if not await pl.wait_answered(th, timeout):
                    return
                await asyncio.sleep(rng.uniform(0.0, 2.0))
                if pl.monitor.answered >= scenes:
                    return
                last_fault = time.monotonic()
                await pl.restart_sink()
                pl.fig.sink_kills += 1

        await asyncio.gather(worker_faults(), sink_faults())
        await pl.settle(timeout)
        pl.fig.settle_s = round(time.monotonic() - last_fault, 1)
        return await pl.finish()


async def run_broker_restart(broker: Broker, *, scenes: int = 80, guarantee: str = "exactly_once",
                             down_s: float = 5.0, hard: bool = False, at: float = 0.3,
                             work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                             timeout: float = 900.0, reasoning_tokens: int = 4, batch_size: int = 4) -> Figures:
    """Mid-run, stop (``hard``: SIGKILL) the single broker node, keep it down ``down_s``, start it."""
    if broker.local is None:
        raise ValueError("broker-restart needs a LocalKafka the harness controls")
    node = broker.local.ids[0]
    work = _work_dir(work, "broker-restart")
    async with Pipeline(broker, scenario="broker-restart", guarantee=guarantee, work=work / guarantee,
                        partitions=partitions, reasoning_tokens=reasoning_tokens, batch_size=batch_size) as pl:
        await pl.publish(0, scenes)
        pl.start_sink()
        await pl.start_worker()
        if not await pl.wait_answered(max(1, int(at * scenes)), timeout):
            pl.fig.failures.append("no progress before the broker fault")
        before = pl.monitor.answered
        t_fault = time.monotonic()
        await asyncio.to_thread(broker.local.kill_node if hard else broker.local.stop_node, node)
        pl.fig.broker_faults += 1
        pl.fig.extra["broker fault"] = f"node {node} {'SIGKILLed' if hard else 'stopped'} at {before}/{scenes} " \
                                      f"answered, down {down_s:.0f}s"
        await asyncio.sleep(down_s)
        await asyncio.to_thread(broker.local.start_node, node)
        pl.fig.broker_restarts += 1
        pl.fig.extra["broker down"] = f"{time.monotonic() - t_fault:.1f}s"
        last_fault = time.monotonic()
        if before >= scenes:
            pl.fig.failures.append("the broker fault came after the run was answered")
        await pl.settle(timeout)
        pl.fig.settle_s = round(time.monotonic() - last_fault, 1)
        return await pl.finish()


async def run_leader_kill(broker: Broker, *, scenes: int = 80, guarantee: str = "exactly_once",
                          down_s: float = 10.0, at: float = 0.3, work: str | os.PathLike | None = None,
                          partitions: int = DEFAULT_PARTITIONS, timeout: float = 900.0, reasoning_tokens: int = 4,
                          batch_size: int = 4) -> Figures:
    """3 brokers, RF 3, min ISR 2: SIGKILL the leader of request partition 0 mid-run, publish the
    second half of the scenes while it is down, restart it after ``down_s``."""
    if broker.local is None or broker.local.nodes < 3:
        raise ValueError("leader-kill needs a LocalKafka of 3 nodes the harness controls")
    work = _work_dir(work, "leader-kill")
    first = scenes // 2
    async with Pipeline(broker, scenario="leader-kill", guarantee=guarantee, work=work / guarantee,
                        partitions=partitions, replication_factor=3, reasoning_tokens=reasoning_tokens,
                        batch_size=batch_size) as pl:
        await pl.publish(0, first)
        pl.start_sink()
        await pl.start_worker()
        if not await pl.wait_answered(max(1, int(at * first)), timeout):
            pl.fig.failures.append("no progress before the broker fault")
        before = pl.monitor.answered
        leader = await partition_leader(broker, pl.topics.req, 0)
        t_fault = time.monotonic()
        await asyncio.to_thread(broker.local.kill_node, leader)
        pl.fig.broker_faults += 1
        pl.fig.extra["broker fault"] = (f"leader of {pl.topics.req.split('.')[-1]}:0 = node {leader} SIGKILLed at "
                                        f"{before}/{scenes} answered; {scenes - first} scenes published while down")
        await pl.publish(first, scenes)
        pl.fig.extra["publish during the fault"] = f"{time.monotonic() - t_fault:.1f}s for {scenes - first} scenes"
        await asyncio.sleep(max(0.0, down_s - (time.monotonic() - t_fault)))
        await asyncio.to_thread(broker.local.start_node, leader)
        pl.fig.broker_restarts += 1
        pl.fig.extra["broker down"] = f"{time.monotonic() - t_fault:.1f}s"
        last_fault = time.monotonic()
        if before >= first:
            pl.fig.failures.append("the leader kill came after the first half was answered")
        await pl.settle(timeout)
        pl.fig.settle_s = round(time.monotonic() - last_fault, 1)
        return await pl.finish()


def _gpu_memory(url: str) -> int | None:
    text = _http_text(url + "/v1/metrics")
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("alpamayo_gpu_memory_bytes"):
            with contextlib.suppress(ValueError, IndexError):
                return int(float(line.split()[-1]))
    return None


async def run_fuzz(broker: Broker, *, bad: int = 1000, good: int = 20, seed: int = 0,
                   guarantee: str = "at_least_once", work: str | os.PathLike | None = None,
                   partitions: int = DEFAULT_PARTITIONS, max_rss_growth_mb: float = 200.0, warmup: int = 8,
                   max_request_bytes: int = 256 << 10, timeout: float = 900.0) -> Figures:
    """Bad messages of every category interleaved with good ones through one worker."""
    work = _work_dir(work, "fuzz")
    claim_root = prepare_claim_root(Path(work) / "claims")
    extra = {"ALPAMAYO_MAX_REQUEST_BYTES": str(max_request_bytes),
             "ALPAMAYO_CLAIM_CHECK_ROOTS": f"file://{claim_root}/"}
    async with Pipeline(broker, scenario="fuzz", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, sink=False, worker_extra=extra, batch_size=8) as pl:
        f = pl.fig
        await pl.start_worker()
        producer = AIOKafkaProducer(**broker.client_kw(), acks="all", enable_idempotence=True, linger_ms=5,
                                    max_request_size=4 << 20)
        await producer.start()
        try:
            # warm-up: good requests until the RSS baseline is taken
            warm = list(fuzz_cases(0, warmup, seed=seed + 1, prefix="warm")) if warmup else []
            for c in warm:
                await producer.send_and_wait(pl.topics.req, c.value, key=c.key, headers=c.headers)
            if not await pl.wait_answered(len(warm), timeout):
                f.failures.append("warm-up requests were not answered")
            await asyncio.sleep(1.0)
            f.rss_start_mb = _mb(pl.worker.sample_rss())
            peak = [pl.worker.sample_rss() or 0]
            sampling = True

            async def sample() -> None:
                while sampling:
                    v = pl.worker.sample_rss()
                    if v:
                        peak[0] = max(peak[0], v)
                    await asyncio.sleep(0.25)

            sampler = asyncio.ensure_future(sample())
            t_send = time.monotonic()
            cases: dict[tuple[str, int, int], FuzzCase] = {}
            pending: list = []
            gen = fuzz_cases(bad, good, seed=seed, claim_root=claim_root, max_request_bytes=max_request_bytes)
            for c in gen:
                fut = await producer.send(pl.topics.req, c.value, key=c.key, headers=c.headers)
                pending.append((fut, c))
                if len(pending) >= 500:
                    for fu, cc in pending:
                        md = await fu
                        cases[(md.topic, md.partition, md.offset)] = cc
                    pending = []
            for fu, cc in pending:
                md = await fu
                cases[(md.topic, md.partition, md.offset)] = cc
            f.extra["send"] = f"{len(cases)} messages in {time.monotonic() - t_send:.1f}s"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all(src in pl.monitor.by_source for src in cases):
                    break
                if not pl.worker.alive and not pl.worker.supervise:
                    break
                await asyncio.sleep(0.5)
            f.extra["processed"] = f"in {time.monotonic() - t_send:.1f}s"
            await pl.monitor.wait_at_end(15)
            sampling = False
            await sampler
            f.rss_end_mb = _mb(pl.worker.sample_rss())
            hwm = peak_rss_bytes(pl.worker.pid) if pl.worker.pid else None
            f.rss_peak_mb = _mb(max(peak[0], hwm or 0))
        finally:
            await producer.stop()
        # -- verdicts per message --------------------------------------------------------------
        wrong: list[str] = []
        per_cat: dict[str, Counter] = defaultdict(Counter)
        lost = dup = 0
        for src, c in cases.items():
            outs = pl.monitor.by_source.get(src, [])
            if not outs:
                lost += 1
                per_cat[c.category]["missing"] += 1
                continue
            dup += len(outs) - 1
            _kind, code = outs[0]
            if c.good:
                ok = all(k == "result" for k, _ in outs)
            else:
                ok = all(k == "dead_letter" and cd in c.expected for k, cd in outs)
            per_cat[c.category][code or "result"] += 1
            if not ok:
                allowed = sorted(c.expected or ["result"])
                wrong.append(f"{c.category} at {src[1]}:{src[2]} -> {outs} (allowed {allowed})")
        f.published = len(cases)
        outs_all = [o for src in cases for o in pl.monitor.by_source.get(src, [])]
        f.results = sum(1 for k, _ in outs_all if k == "result")
        f.dead_letters = sum(1 for k, _ in outs_all if k == "dead_letter")
        f.extra["warm-up results (not counted)"] = len(warm)
        f.answered = len(cases) - lost
        f.lost, f.duplicated = lost, dup
        n_good_sent = sum(1 for c in cases.values() if c.good)
        f.extra["bad/good sent"] = f"{len(cases) - n_good_sent}/{n_good_sent}"
        f.extra["dead-letter codes"] = dict(sorted(pl.monitor.codes.items()))
        f.extra["_per_category"] = {k: dict(v) for k, v in sorted(per_cat.items())}
        f.extra["_wrong"] = wrong
        if wrong:
            f.failures.append(f"{len(wrong)} messages answered wrongly, e.g. {wrong[:3]}")
        if pl.worker.unplanned_exits or not pl.worker.alive:
            f.failures.append(f"the worker did not stay up ({pl.worker.unplanned_exits} unplanned exits)")
        if f.rss_start_mb is not None and f.rss_end_mb is not None:
            growth = f.rss_end_mb - f.rss_start_mb
            f.extra["RSS growth"] = f"{growth:+.1f} MB (limit {max_rss_growth_mb:.0f} MB)"
            if growth > max_rss_growth_mb:
                f.failures.append(f"worker RSS grew {growth:.0f} MB (> {max_rss_growth_mb:.0f} MB)")
        return await pl.finish()


async def run_soak(broker: Broker, *, minutes: float = 3.0, rate: float = 2.0, guarantee: str = "exactly_once",
                   work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                   sample_s: float = 5.0, warmup_fraction: float = 0.1, timeout: float = 900.0,
                   reasoning_tokens: int = 4, batch_size: int = 4) -> Figures:
    """Steady load for ``minutes``; RSS (worker, sink) and GPU memory sampled every ``sample_s``."""
    work = _work_dir(work, "soak")
    n = max(1, int(minutes * 60 * rate))
    async with Pipeline(broker, scenario="soak", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, reasoning_tokens=reasoning_tokens, batch_size=batch_size) as pl:
        f = pl.fig
        pl.start_sink()
        await pl.start_worker()
        samples: list[tuple[float, int, int | None, int | None]] = []
        done = False

        async def sample() -> None:
            t0 = time.monotonic()
            while not done:
                w = pl.worker.sample_rss()
                s = pl.sink.sample_rss() if pl.sink else None
                g = await asyncio.to_thread(_gpu_memory, pl.worker.ready_url()) if pl.worker.alive else None
                if w:
                    samples.append((time.monotonic() - t0, w, s, g))
                await asyncio.sleep(sample_s)

        sampler = asyncio.ensure_future(sample())
        t_pub = time.monotonic()
        await pl.publish(0, n, rate=rate)
        f.extra["load"] = f"{n} scenes at {rate}/s over {(time.monotonic() - t_pub) / 60:.1f} min"
        await pl.settle(timeout)
        done = True
        await sampler
        if samples:
            t_end = samples[-1][0]
            steady = [x for x in samples if x[0] >= warmup_fraction * t_end] or samples
            f.rss_start_mb, f.rss_end_mb = _mb(steady[0][1]), _mb(steady[-1][1])
            f.rss_peak_mb = _mb(max(x[1] for x in samples))
            if len(steady) >= 3 and steady[-1][0] - steady[0][0] >= 600:   # shorter: noise, not a trend
                ts = [x[0] for x in steady]
                ys = [x[1] / (1 << 20) for x in steady]
                mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
                var = sum((t - mt) ** 2 for t in ts)
                if var > 0:
                    f.rss_slope_mb_per_h = round(sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var * 3600, 1)
            sinks = [x[2] for x in steady if x[2]]
            if sinks:
                f.sink_rss_start_mb, f.sink_rss_end_mb = _mb(sinks[0]), _mb(sinks[-1])
            gpus = [x[3] for x in steady if x[3] is not None]
            if gpus:
                f.gpu_mem_start_mb, f.gpu_mem_end_mb = _mb(gpus[0]), _mb(gpus[-1])
            f.extra["_samples"] = [(round(t, 1), _mb(w), _mb(s), _mb(g)) for t, w, s, g in samples]
        return await pl.finish()
