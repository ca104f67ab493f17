"""Prometheus metrics of the worker (names and labels: docs/architecture.md, fixed).

Each :class:`WorkerMetrics` owns its own ``CollectorRegistry`` (several workers in one test
process never collide). The four ``alpamayo_spec_decode_*`` counters exist only on dflash2
profiles with spec metrics ``summary``/``detailed``; their ``method="dflash2"`` series is created
at construction, so it is exported at 0 before the first request. They grow only from trajectory
results' speculative statistics.
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from schemas import TASKS, ErrorCode

disable_created_metrics()   # only the series the seed names: *_total, no *_created

__all__ = ["WorkerMetrics", "CONTENT_TYPE_LATEST", "STAGES", "SPEC_METHOD", "ENGINE_PHASES"]

STAGES = ("queue", "image_prep", "prefill", "decode", "diffusion", "total")
SPEC_METHOD = "dflash2"
ENGINE_PHASES = ("infer", "output", "prepare")   # prepare: the next batch's host work, on the prep thread
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
_UNCERTAINTY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class WorkerMetrics:
    def __init__(self, spec_counters: bool):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.spec_enabled = bool(spec_counters)
        self.spec_draft = self.spec_accepted = self.spec_steps = self.spec_baseline_steps = None
        if self.spec_enabled:
            self.spec_draft = Counter("alpamayo_spec_decode_draft_tokens_total",
                                      "DFlash2 draft tokens proposed (trajectory requests)", ["method"], registry=r)
            self.spec_accepted = Counter("alpamayo_spec_decode_accepted_tokens_total",
                                         "DFlash2 draft tokens accepted (trajectory requests)", ["method"], registry=r)
            self.spec_steps = Counter("alpamayo_spec_decode_verify_steps_total",
                                      "DFlash2 verify steps (trajectory requests)", ["method"], registry=r)
            self.spec_baseline_steps = Counter(
                "alpamayo_spec_decode_baseline_steps_total",
                "Decode steps without drafts: the adaptive policy judged drafting not worth it (trajectory requests)",
                ["method"], registry=r)
            for c in (self.spec_draft, self.spec_accepted, self.spec_steps, self.spec_baseline_steps):
                c.labels(method=SPEC_METHOD)          # exported at 0 right away
        self.requests = Counter("alpamayo_requests_total", "Valid requests taken into batches", ["task"], registry=r)
        self.results = Counter("alpamayo_results_total", "Results published (acknowledged)", ["task"], registry=r)
        self.dead_letters = Counter("alpamayo_dead_letters_total", "Dead letters published (acknowledged)",
                                    ["code"], registry=r)
        self.batch_size = Histogram("alpamayo_batch_size", "Requests per forward batch", ["task", "k"],
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("alpamayo_queue_depth", "Jobs waiting for the engine", registry=r)
        self.engine_seconds = Counter(
            "alpamayo_engine_seconds_total",
            "Engine wall time per batch phase: infer (the model) and output (results built and encoded) on the "
            "engine thread, their rate its busy fraction; prepare: the next batch's host work on the prep "
            "thread, overlapping infer", ["phase"], registry=r)
        for phase in ENGINE_PHASES:
            self.engine_seconds.labels(phase=phase)
        self.stage_latency = Histogram("alpamayo_stage_latency_seconds", "Per-stage latency of a request",
                                       ["stage", "task"], buckets=_LATENCY_BUCKETS, registry=r)
        self.reasoning_tokens = Counter("alpamayo_reasoning_tokens_total", "Generated reasoning/text tokens",
                                        ["task"], registry=r)
        self.consumer_lag = Gauge("alpamayo_consumer_lag", "Log end offset minus committed offset",
                                  ["topic", "partition"], registry=r)
        self.partition_repairs = Counter(
            "alpamayo_partition_repairs_total", "Partitions re-opened because the broker's offsets disagreed with the "
            "worker's (lost_commit, stalled_fetch: worker.partition_watch)", ["kind"], registry=r)
        self.outputs_dropped = Counter(
            "alpamayo_outputs_dropped_total", "Results and dead letters left unpublished because their input "
            "partition moved to another consumer, which processes those requests again", registry=r)
        self.commit_failures = Counter("alpamayo_offset_commit_failures_total",
                                       "Offset commits that failed (at_least_once: retried)", registry=r)
        self.gpu_memory = Gauge("alpamayo_gpu_memory_bytes", "GPU memory held by the process (0 on CPU)",
                                registry=r)
        self.ready = Gauge("alpamayo_ready", "1 once loaded and warm", registry=r)
        self.ready_since = Gauge("alpamayo_ready_since_seconds", "Unix time the worker last became ready "
                                 "(it starts fetching right after)", registry=r)
        self.uncertainty = Histogram("alpamayo_result_uncertainty", "Uncertainty of results with K >= 2 samples",
                                     ["task", "k"], buckets=_UNCERTAINTY_BUCKETS, registry=r)
        for t in TASKS:
            self.requests.labels(task=t)
            self.results.labels(task=t)
            self.reasoning_tokens.labels(task=t)
        for code in ErrorCode:
            self.dead_letters.labels(code=code.value)
        self._lag_labels: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ updates
    def observe_batch(self, task: str, k: int, n: int) -> None:
        self.batch_size.labels(task=task, k=str(k)).observe(n)
        self.requests.labels(task=task).inc(n)

    def observe_result(self, result) -> None:
        """A published InferResult: count, stage latencies, tokens, uncertainty, speculative counters."""
        task = result.task
        self.results.labels(task=task).inc()
        t = result.metrics.timings
        for stage, ms in zip(STAGES, (t.queue_ms, t.image_prep_ms, t.prefill_ms, t.decode_ms, t.diffusion_ms,
                                      t.total_ms)):
            if ms > 0 or stage in ("queue", "total"):
                self.stage_latency.labels(stage=stage, task=task).observe(max(ms, 0.0) / 1000.0)
        self.reasoning_tokens.labels(task=task).inc(sum(result.metrics.generated_tokens))
        if result.uncertainty is not None:
            self.uncertainty.labels(task=task, k=str(result.num_samples)).observe(result.uncertainty.uncertainty)
        spec = result.metrics.speculative_decoding
        if self.spec_enabled and spec is not None and task == "trajectory":
            self.spec_draft.labels(method=SPEC_METHOD).inc(spec.num_draft_tokens)
            self.spec_accepted.labels(method=SPEC_METHOD).inc(spec.num_accepted_draft_tokens)
            self.spec_steps.labels(method=SPEC_METHOD).inc(spec.num_spec_steps)
            self.spec_baseline_steps.labels(method=SPEC_METHOD).inc(spec.num_baseline_steps)

    def observe_dead_letter(self, code: str) -> None:
        self.dead_letters.labels(code=str(code)).inc()

    def set_lag(self, lags: dict[tuple[str, int], int]) -> None:
        """Consumer lag of the assigned partitions; series of partitions no longer held are removed."""
        now = {(t, str(p)) for (t, p) in lags}
        for gone in self._lag_labels - now:
            try:
                self.consumer_lag.remove(*gone)
            except KeyError:
                pass
        for (t, p), lag in lags.items():
            self.consumer_lag.labels(topic=t, partition=str(p)).set(max(0, lag))
        self._lag_labels = now

    def render(self) -> bytes:
        return generate_latest(self.registry)


def held_gpu_memory(engine) -> int:
    """GPU memory the engine's runtime holds (``alpamayo_gpu_memory_bytes``); 0 on the CPU."""
    rt = getattr(engine, "runtime", None)
    dev = getattr(rt, "device", None)
    if dev is None or getattr(dev, "type", "cpu") != "cuda":
        return 0
    try:
        import torch     # a CUDA runtime is loaded, so torch is too; a local import keeps it off the Kafka side

        return int(torch.cuda.memory_reserved(dev))
    except Exception:
        return 0
