"""The worker service: one asyncio loop per GPU tying intake, batcher, engine and publisher
together, plus the HTTP side port. Kafka client settings: ``worker.kafka_clients``; running it
as a process, a thread or a child: ``worker.process``.

Lifecycle
---------
1. Side port up (live; ready = 503).
2. Engine: prepare (checkpoint + head checks), load, warm every configured K - on the engine
   thread, so the side port answers meanwhile. A refused checkpoint/head exits 2.
3. at_least_once: the producer, then the consumer: manual commits, static membership only when
   ``ALPAMAYO_GROUP_INSTANCE_ID`` is set, ``read_committed``, a rebalance listener. exactly_once:
   one transactional producer per assigned partition, started on assignment (InitProducerId
   fences the previous owner and completes its open transaction) before the partition's
   committed offset is read and fetched from; closed on revocation.
4. Ready (200). Only now is anything fetched.
5. Tasks: fetch (getmany, bounded in-flight with pause/resume) -> intake thread (decode, claim
   check, images) -> batcher -> engine thread (one batch at a time; heartbeats never wait for it)
   -> publisher (results + dead letters, then offsets) ; monitor (consumer lag and an audit of the
   worker's offsets against the broker's: ``worker.partition_watch``; GPU memory).
6. SIGTERM/SIGINT: not ready, stop fetching, flush the batcher, wait until every fetched record
   is published and committed (at most ``ALPAMAYO_DRAIN_TIMEOUT_S``), close, exit 0. Work not
   finished by then is not committed and is re-delivered.

Rebalance (eager, as aiokafka does it): on revoke, queued jobs of the revoked partitions are
abandoned (re-delivered to the next owner), the batch running on the engine is waited for (at
most the drain timeout), whatever finished is published and its offsets committed, then the
partitions' state is dropped (exactly_once: their producers closed) - later completions of their
work are discarded, so no offset is ever committed for unpublished work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from schemas import DeadLetter
from worker.batcher import Batcher
from worker.config import ConfigError, Settings
from worker.errors import Refusal
from worker.frames import DECODER
from worker.http import HealthState, SidePort
from worker.intake import Intake, Job
from worker.kafka_clients import (PartitionProducers, consumer_kwargs, instance_id, kafka_preflight, producer_kwargs,
                                  security_kwargs)
from worker.metrics import WorkerMetrics, held_gpu_memory
from worker.output_limits import OutputLimits, producer_max_request_size, read_output_limits
from worker.partition_watch import PartitionWatch
from worker.publisher import OffsetTracker, Output, Publisher, PublishError, dead_letter_output, job_output
from worker.stats import StatsLog

__all__ = ["WorkerService", "load_engine", "EXIT_OK", "EXIT_FAILED", "EXIT_REFUSED", "longest_stop_s"]

log = logging.getLogger("alpamayo.worker")

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
FETCH_TIMEOUT_MS = 200
MONITOR_INTERVAL_S = 2.0
INTAKE_THREADS = 4              # scenes in intake at once; their pixels decode in worker/frames.py's processes
FINAL_FLUSH_EXTRA_S = 5.0       # the drain's last flush may run this long past the drain timeout
CLIENT_CLOSE_S = 15.0           # each Kafka client (consumer, then producer(s)) gets this long to close


def longest_stop_s(drain_timeout_s: float) -> float:
    """The longest a SIGTERM takes to exit: the drain, its final flush's extra time, then the consumer
    and the producer(s) closed one after the other (a pod's termination grace must exceed it)."""
    return drain_timeout_s + FINAL_FLUSH_EXTRA_S + 2 * CLIENT_CLOSE_S


def load_engine(engine, settings: Settings) -> None:
    """prepare + load + (test knob: reasoning cap) + warm every K. Blocking."""
    engine.prepare()
    engine.load(warmup=False)
    if settings.max_reasoning_tokens is not None and getattr(engine, "runtime", None) is not None:
        engine.runtime.trajectory_max_new = int(settings.max_reasoning_tokens)
    engine.warm()


class _RebalanceListener(ConsumerRebalanceListener):
    """Forwards the consumer's rebalance callbacks to the service."""

    def __init__(self, service: "WorkerService"):
        self.service = service

    async def on_partitions_revoked(self, revoked):
        await self.service._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned):
        await self.service._on_assigned(assigned)


class WorkerService:
    def __init__(self, settings: Settings, engine=None, *, engine_loader=load_engine,
                 install_signal_handlers: bool = True, on_ready=None):
        self.settings = settings
        if engine is None:
            # worker.engine imports torch (through worker.model.runtime): imported only when the
            # service builds its own engine, so the Kafka side imports without torch
            from worker.engine import Engine

            engine = Engine(settings)
        self.engine = engine
        self.engine_loader = engine_loader
        self.install_signal_handlers = install_signal_handlers
        self.on_ready = on_ready
        spec = settings.speculative and settings.spec_metrics != "none"
        self.metrics = WorkerMetrics(spec_counters=spec)
        self.state = HealthState(self.metrics, self.engine.models_payload)
        self.side = SidePort(self.state, settings.http_host, settings.http_port)
        self.tracker = OffsetTracker()
        self._in_intake = 0                  # fetched records whose intake (decode, checks) has not finished
        self.batcher: Batcher[Job] = Batcher(lambda j: j.group, settings.max_batch_size, settings.max_batch_wait_ms,
                                             incoming=lambda: self._in_intake)
        self.stats = StatsLog(self.metrics, settings.stats_interval_s, queue_depth=self.waiting,
                              in_flight=lambda: self.tracker.inflight)
        self.exactly_once = settings.processing_guarantee == "exactly_once"
        self.consumer = self.producer = self.publisher = None
        self.output_limits: OutputLimits | None = None     # read from the broker at startup
        self.intake = Intake(settings, getattr(engine, "default_seed", None) or _default_seed,
                             shrink_frame=getattr(engine, "shrink_frame", None))
        self._engine_pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._intake_pool = ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix="intake")
        self._prep_pool = ThreadPoolExecutor(1, thread_name_prefix="batch-prep")
        self._stop = asyncio.Event()
        self._fetching = True
        self._paused = False
        self._partitions_lock = asyncio.Lock()      # rebalance callbacks and partition repairs, one at a time
        self._running: list[Job] = []
        self._ahead: list[Job] = []          # the next batch, picked and being prepared while `_running` runs
        self._revoking: set[tuple[str, int]] = set()
        self._engine_idle = asyncio.Event()
        self._engine_idle.set()
        self._fatal: BaseException | None = None
        self.engine_busy = False
        self.exit_code: int | None = None

    # ------------------------------------------------------------------ control
    def waiting(self) -> int:
        """Jobs waiting for the engine: queued in the batcher, or picked ahead as the next batch."""
        return len(self.batcher) + len(self._ahead)

    def request_stop(self) -> None:
        """Begin the drain (signal handlers, WorkerThread.stop). Event-loop thread only."""
        if not self._stop.is_set():
            log.info("stop requested: draining (at most %.0fs)", self.settings.drain_timeout_s)
        self._stop.set()

    @property
    def port(self) -> int | None:
        return self.side.bound_port

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        if self.install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.side.start()
        except OSError as exc:      # another process holds the port (a second worker on this host)
            self.state.set_ready(False, "failed")
            print(f"alpamayo-worker: the side port {self.settings.http_host}:{self.settings.http_port} cannot be "
                  f"bound ({os.strerror(exc.errno) if exc.errno else exc}): set ALPAMAYO_HTTP_PORT to a free port, or stop the process "
                  "holding it", file=sys.stderr, flush=True)
            self._intake_pool.shutdown(wait=False)
            self._prep_pool.shutdown(wait=False)
            self._engine_pool.shutdown(wait=False)
            self.exit_code = EXIT_REFUSED
            return EXIT_REFUSED
        try:
            code = await self._run_loaded(loop)
        finally:
            await self.side.stop()
            self._intake_pool.shutdown(wait=False, cancel_futures=True)
            self._prep_pool.shutdown(wait=False, cancel_futures=True)
            self._engine_pool.shutdown(wait=False, cancel_futures=True)
        self.exit_code = code
        return code

    async def _run_loaded(self, loop) -> int:
        s = self.settings
        # -- kafka preflight: refused credentials / an untrusted CA stop here, before the model loads
        try:
            await kafka_preflight(s)
        except ConfigError as exc:
            self.state.set_ready(False, "failed")
            print(f"alpamayo-worker: {exc}", file=sys.stderr, flush=True)
            return EXIT_REFUSED
        # -- engine: load and warm on the engine thread --------------------------------------
        self.engine_busy = True
        load = loop.run_in_executor(self._engine_pool, self.engine_loader, self.engine, s)
        loop.run_in_executor(self._intake_pool, DECODER.start)     # the image decoder processes, meanwhile
        stop_wait = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({load, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            log.info("stopped while loading")
            self.state.set_ready(False, "draining")
            return EXIT_OK
        stop_wait.cancel()
        self.engine_busy = False
        exc = load.exception()
        if exc is not None:
            self.state.set_ready(False, "failed")
            if isinstance(exc, Refusal):      # one line, as for configuration errors
                print(exc.line(), file=sys.stderr, flush=True)
                return EXIT_REFUSED
            log.error("engine failed to load: %s: %s", type(exc).__name__, exc, exc_info=exc)
            return EXIT_FAILED
        # -- kafka ---------------------------------------------------------------------------
        try:
            await self._start_kafka()
        except Exception as exc:
            log.error("Kafka clients failed to start: %s: %s", type(exc).__name__, exc)
            await self._close_kafka()
            self.state.set_ready(False, "failed")
            return EXIT_FAILED
        if self._stop.is_set():
            await self._close_kafka()
            return EXIT_OK
        self.state.detail = {"worker_id": s.worker_id, "group_instance_id": instance_id(s)}
        self.state.set_ready(True, "ready")
        log.info("ready: http://%s:%s (profile %s, K=%s, %s, group %s, instance %s)", s.http_host, self.port,
                 s.profile, list(s.k_values), s.processing_guarantee, s.group_id, instance_id(s))
        if self.on_ready is not None:
            self.on_ready(self)
        # -- run -----------------------------------------------------------------------------
        tasks = {
            asyncio.create_task(self._fetch_loop(loop), name="fetch"),
            asyncio.create_task(self._batch_loop(loop), name="batch"),
            asyncio.create_task(self.publisher.run(), name="publish"),
            asyncio.create_task(self._monitor_loop(), name="monitor"),
        }
        if s.stats_interval_s > 0:
            tasks.add(asyncio.create_task(self.stats.run(), name="stats"))
        stop_wait = asyncio.create_task(self._stop.wait(), name="stop")
        done, _ = await asyncio.wait(tasks | {stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if t is not stop_wait and (t.cancelled() or t.exception() is not None)]
        # a loop that returned because a stop was requested (the fetch loop checks the stop event)
        # is the drain starting, not a failure, even when it finished in the same turn as stop_wait
        ended = set() if self._stop.is_set() else done - {stop_wait}
        if failed or ended:
            t = next(iter(failed or ended))
            err = t.exception() if not t.cancelled() else None
            self._fatal = err or RuntimeError(f"task {t.get_name()} ended")
            log.error("fatal: %s: %s (nothing more is committed; unfinished records will be re-delivered)",
                      type(self._fatal).__name__, self._fatal, exc_info=err)
            self.state.set_ready(False, "failed")
            for task in tasks | {stop_wait}:
                task.cancel()
            await asyncio.gather(*tasks, stop_wait, return_exceptions=True)
            await self._close_kafka()
            return EXIT_FAILED
        code = await self._drain(tasks)
        await self._close_kafka()
        return code

    # ------------------------------------------------------------------ kafka clients
    async def _start_kafka(self) -> None:
        s = self.settings
        self.output_limits = await read_output_limits(
            {"bootstrap_servers": s.bootstrap_servers, **security_kwargs(s)}, s.result_topic, s.dead_letter_topic,
            producer_max_request_size(producer_kwargs(s)), review_topic=s.review_topic)
        if self.exactly_once:            # started per partition on assignment
            self.producer = PartitionProducers(s)
        else:
            self.producer = AIOKafkaProducer(**producer_kwargs(s))
            await self.producer.start()
        self.consumer = AIOKafkaConsumer(**consumer_kwargs(s, self._revoke_timeout()))
        self.consumer.subscribe([s.request_topic], listener=_RebalanceListener(self))
        await self.consumer.start()
        self.watch = PartitionWatch(self.consumer, self.tracker, self.metrics, reopen=self.reopen,
                                    paused=lambda: self._paused or not self._fetching)
        self.publisher = Publisher(self.producer, self.consumer, self.tracker, s.group_id, self.exactly_once,
                                   self.metrics, on_broken=self.watch.broken)

    async def _close_kafka(self) -> None:
        for client in (self.consumer, self.producer):
            if client is None:
                continue
            try:
                stop = client.close_all() if isinstance(client, PartitionProducers) else client.stop()
                await asyncio.wait_for(stop, CLIENT_CLOSE_S)
            except Exception as exc:  # closing is best effort
                log.warning("closing %s: %s: %s", type(client).__name__, type(exc).__name__, exc)

    def _revoke_timeout(self) -> float:
        return max(1.0, min(self.settings.drain_timeout_s, 120.0))

    # ------------------------------------------------------------------ rebalance
    async def _on_assigned(self, assigned) -> None:
        async with self._partitions_lock:
            if await self._open(assigned, seek=self.exactly_once):
                self._paused = False
                log.info("assigned %s", [f"{tp.topic}:{tp.partition}" for tp in sorted(assigned)])

    async def reopen(self, assigned) -> None:
        """Assigned partitions taken up again as on an assignment (worker.partition_watch's repair);
        never in the middle of a rebalance callback, and not those revoked meanwhile."""
        async with self._partitions_lock:
            held = self.consumer.assignment()
            assigned = [tp for tp in assigned if tp in held and self.tracker.epoch(tuple(tp)) is not None]
            keys = {(tp.topic, tp.partition) for tp in assigned}
            self.batcher.remove(lambda j: j.tp in keys)       # fetched again under the new epoch
            if self.exactly_once:
                await self.producer.close(sorted(keys))
            if assigned and await self._open(assigned, seek=True):
                self.consumer.resume(*assigned)       # the fetch loop pauses them again when full

    async def _open(self, assigned, seek: bool) -> bool:
        """A new tracker epoch per partition; exactly_once first starts their producers (fencing the
        previous owners); ``seek``: positioned at the committed offsets read after that."""
        tps = sorted((tp.topic, tp.partition) for tp in assigned)
        starts: dict[tuple[str, int], int | None] = {}
        try:
            if self.exactly_once and tps:
                await self.producer.open(tps)           # fences the previous owners first
            if seek and tps:
                starts = await self._seek_committed(assigned)
        except Exception as exc:  # the partitions stay unserved: stop, they are re-delivered
            self._fatal = self._fatal or exc
            log.error("assignment of %s failed: %s: %s", tps, type(exc).__name__, exc)
            self.request_stop()
            return False
        for tp in tps:
            self.tracker.assign(tp, starts.get(tp))
        return True

    async def _seek_committed(self, assigned) -> dict[tuple[str, int], int]:
        """Position at the committed offsets read now (exactly_once: after InitProducerId settled
        the previous owners' transactions; the consumer read them earlier, concurrently). Every
        offset is read first, then all seeks happen with no await before the tracker takes them."""
        assigned = list(assigned)
        committed = {tp: await self.consumer.committed(tp) for tp in assigned}
        unset = [tp for tp, off in committed.items() if off is None]
        beginning = await self.consumer.beginning_offsets(unset) if unset else {}
        starts = {}
        for tp in assigned:
            start = committed[tp] if committed[tp] is not None else beginning[tp]
            self.consumer.seek(tp, start)
            starts[(tp.topic, tp.partition)] = start
        return starts

    async def _on_revoked(self, revoked) -> None:
        async with self._partitions_lock:
            await self._revoke(revoked)

    async def _revoke(self, revoked) -> None:
        tps = {(tp.topic, tp.partition) for tp in revoked}
        if not tps:
            return
        self._revoking |= tps            # no new work of these partitions enters the batcher or the engine
        abandoned = self.batcher.remove(lambda j: j.tp in tps)
        self.metrics.queue_depth.set(self.waiting())
        if any(j.tp in tps for j in self._running):
            try:
                await asyncio.wait_for(self._engine_idle.wait(), self._revoke_timeout())
            except TimeoutError:
                log.warning("revoke: the engine batch did not finish in %.0fs; its work is abandoned",
                            self._revoke_timeout())
        if self.publisher is not None and self._fatal is None:
            try:
                await self.publisher.flush()
            except PublishError as exc:
                self._fatal = exc
                log.error("revoke: %s", exc)
                self.request_stop()
        committed = {tp: self.tracker.committed(tp) for tp in tps}
        unfinished = sum(self.tracker.revoke(tp) for tp in tps)
        if self.exactly_once and self.producer is not None:
            await self.producer.close(tps)
        self._revoking -= tps
        log.info("revoked %s: committed up to %s, abandoned %d queued, %d unfinished (re-delivered to the next "
                 "owner)", sorted(f"{t}:{p}" for t, p in tps),
                 {f"{t}:{p}": o for (t, p), o in sorted(committed.items())}, len(abandoned), unfinished)

    # ------------------------------------------------------------------ fetch + intake
    async def _fetch_loop(self, loop) -> None:
        s = self.settings
        while self._fetching and not self._stop.is_set():
            room = s.max_inflight - self.tracker.inflight
            assignment = self.consumer.assignment()
            if room <= 0:
                if assignment:
                    self.consumer.pause(*assignment)
                self._paused = True
                max_records = 1
            else:
                if self._paused:
                    self.consumer.resume(*assignment)
                    self._paused = False
                max_records = room
            try:
                data = await self.consumer.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=max_records)
            except KafkaError as exc:
                log.warning("fetch failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
                continue
            if not data:
                continue
            now = time.time()
            for tp, records in data.items():
                key = (tp.topic, tp.partition)
                for rec in records:
                    epoch = self.tracker.add(key, rec.offset)
                    if epoch is None:       # partition no longer ours
                        continue
                    self._in_intake += 1
                    fut = loop.run_in_executor(self._intake_pool, self.intake.process, rec, now)
                    fut.add_done_callback(lambda f, rec=rec, epoch=epoch: self._on_intake(f, rec, epoch))

    def _on_intake(self, fut, rec, epoch: int) -> None:
        tp = (rec.topic, rec.partition)
        self._in_intake -= 1
        self.batcher.notify()                # a group waiting for intake may be ready now
        if fut.cancelled():
            return
        exc = fut.exception()
        out = exc if exc is not None else fut.result()
        if not self.tracker.is_current(tp, epoch) or tp in self._revoking or self.batcher.closed:
            return                         # revoked meanwhile (the next owner gets it) or shut down
        if isinstance(out, Job):
            out.epoch = epoch
            self.batcher.put(out)
            self.metrics.queue_depth.set(self.waiting())
            return
        if not isinstance(out, DeadLetter):   # intake never raises; belt and braces
            out = self.intake.dead_letter(out if isinstance(out, BaseException) else RuntimeError(str(out)), rec)
        self.stats.dead_letter(out)
        self.publisher.submit([dead_letter_output(tp, rec.offset, epoch, self.settings.dead_letter_topic, out,
                                                  self.output_limits.dead_letter_bytes,
                                                  self.settings.result_content_type)])

    # ------------------------------------------------------------------ engine
    async def _batch_loop(self, loop) -> None:
        """One batch at a time on the engine thread. While it runs, the next batch is picked as
        soon as a group is full and its host work (prompts, frame staging: `Engine.prepare_batch`)
        runs on the prep thread, off the engine's critical path. Jobs revoked meanwhile are dropped
        when their batch's turn comes (and the batch prepared again without them)."""
        ahead = None                                     # (picked, future of the prepared batch)
        prepare = getattr(self.engine, "prepare_batch", None)
        while True:
            if ahead is not None:
                picked, prepared = ahead
                ahead, self._ahead = None, []
            else:
                picked, prepared = await self.batcher.get(), None
            self.metrics.queue_depth.set(self.waiting())
            if picked is None:
                return
            (task, k), jobs = picked
            live = [j for j in jobs if self.tracker.is_current(j.tp, j.epoch) and j.tp not in self._revoking]
            if not live:
                continue
            if prepared is not None:
                try:
                    prepared = await prepared if len(live) == len(jobs) else None
                except Exception as exc:          # the engine prepares the batch itself (and isolates the culprit)
                    log.warning("preparing a batch ahead failed (%s: %s)", type(exc).__name__, exc)
                    prepared = None
            jobs = live
            self.metrics.observe_batch(task, k, len(jobs))
            log.debug("batch %s K=%d: %s", task, k, [j.request_id for j in jobs])
            self._running = jobs
            self._engine_idle.clear()
            self.engine_busy = True
            try:
                run = loop.run_in_executor(self._engine_pool, self._run_batch, jobs, prepared)
                if prepare is not None:
                    ahead = await self._pick_ahead(loop, run, prepare)
                outputs = await run
            finally:
                self.engine_busy = False
            log.debug("batch done: %s", [(o.request_id, o.error_code or "result") for o in outputs])
            self.publisher.submit(outputs)
            self._running = []
            self._engine_idle.set()

    async def _pick_ahead(self, loop, run, prepare):
        """While `run` (the engine's batch) is going: wait for a full group, take it and start its
        host work on the prep thread -> (picked, future) or None when the batch ended first."""
        full = asyncio.ensure_future(self.batcher.get(full_only=True))
        try:
            await asyncio.wait({run, full}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not full.done():
                full.cancel()                    # the batch ended first (or this loop stops): nothing was taken
        picked = full.result() if full.done() and not full.cancelled() else None
        if picked is None:
            return None
        self._ahead = picked[1]
        self.metrics.queue_depth.set(self.waiting())

        def timed(t0: float):
            try:
                return prepare([j.scene for j in picked[1]])
            finally:
                self.metrics.engine_seconds.labels(phase="prepare").inc(time.perf_counter() - t0)
        return picked, loop.run_in_executor(self._prep_pool, timed, time.perf_counter())

    def _run_batch(self, jobs: list[Job], prepared=None) -> list[Output]:
        """Engine thread: infer (the batch `prepared` ahead when given), then build and encode
        each job's result (or dead letter)."""
        start = time.time()
        t0 = time.perf_counter()
        try:
            results = self.engine.infer(prepared if prepared is not None else [j.scene for j in jobs])
            if len(results) != len(jobs):
                raise RuntimeError(f"engine returned {len(results)} results for {len(jobs)} scenes")
        except Exception as exc:
            if len(jobs) == 1:
                results = [exc]
            else:   # isolate the culprit: one failing scene must not fail its batch-mates
                log.warning("batch of %d failed (%s: %s); retrying scene by scene", len(jobs), type(exc).__name__,
                            exc)
                results = []
                for j in jobs:
                    try:
                        results.extend(self.engine.infer([j.scene]))
                    except Exception as one:
                        results.append(one)
        t1 = time.perf_counter()
        outputs = []
        for job, res in zip(jobs, results, strict=True):
            out, dl = job_output(job, res, start, self.engine, self.settings, self.output_limits)
            if dl is not None:
                self.stats.dead_letter(dl)
            outputs.append(out)
        self.metrics.engine_seconds.labels(phase="infer").inc(t1 - t0)
        self.metrics.engine_seconds.labels(phase="output").inc(time.perf_counter() - t1)
        return outputs

    # ------------------------------------------------------------------ monitor
    async def _monitor_loop(self) -> None:
        while True:
            try:
                await self.watch.check()
            except Exception as exc:  # monitoring must never stop the worker
                log.debug("partition watch failed: %s: %s", type(exc).__name__, exc)
            self.metrics.gpu_memory.set(held_gpu_memory(self.engine))
            await asyncio.sleep(MONITOR_INTERVAL_S)

    # ------------------------------------------------------------------ drain
    async def _drain(self, tasks) -> int:
        s = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.drain_timeout_s
        self.state.set_ready(False, "draining")
        self._fetching = False
        fetch = next(t for t in tasks if t.get_name() == "fetch")
        try:
            await asyncio.wait_for(asyncio.shield(fetch), max(0.1, deadline - loop.time()))
        except (TimeoutError, Exception):
            fetch.cancel()
        # the last getmany may have handed records to intake threads: let them land in the batcher
        self.batcher.flush(True)
        while self.tracker.inflight > 0 and loop.time() < deadline and self._fatal is None:
            publish = next(t for t in tasks if t.get_name() == "publish")
            if publish.done():
                break
            await self.publisher.wait_progress(min(0.5, max(0.01, deadline - loop.time())))
        left = self.tracker.inflight
        code = EXIT_OK
        if self._fatal is None:
            try:
                await asyncio.wait_for(self.publisher.flush(), max(1.0, deadline - loop.time() + FINAL_FLUSH_EXTRA_S))
            except Exception as exc:
                log.error("final flush failed: %s: %s", type(exc).__name__, exc)
                code = EXIT_FAILED
            left = self.tracker.inflight
        else:
            code = EXIT_FAILED
        if left:
            log.warning("drain timeout: %d fetched records unfinished; not committed, they will be re-delivered",
                        left)
        else:
            log.info("drained: every fetched record published and committed")
        self.batcher.close()
        self.publisher.close()
        for t in tasks:
            if t.get_name() in ("monitor", "stats", "batch", "fetch") or left:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return code


def _default_seed(request_id: str) -> int:
    from worker.engine import default_seed     # torch (see WorkerService.__init__)

    return default_seed(request_id)
