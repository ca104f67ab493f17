"""What the worker says while it works: a periodic stats line (as vLLM's throughput line) and a
rate-limited warning per dead-letter code.

Every ``ALPAMAYO_STATS_INTERVAL_S`` seconds (default 10; 0 turns both off) while there is traffic
(something published since the last line, or jobs queued or in flight), one INFO line::

    stats: 12.4 results/s, queue 3, in flight 17, dead letters 2 (bad_image 2), acceptance rate 0.41,
    mean acceptance length 3.87, GPU memory 71.3 GiB

Results and dead letters are those acknowledged since the previous line, read from the Prometheus
counters (``worker.metrics``), so the line and ``/v1/metrics`` agree; acceptance is over the
DFlash2 counters of the same interval (dflash2 profiles with spec metrics only); GPU memory is the
``alpamayo_gpu_memory_bytes`` gauge (shown when non-zero, i.e. on CUDA).

A dead letter is warned about (code, field, request id, message) the first time its code occurs,
then at most once per interval and code, with the number held back since the last warning.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

from schemas import TASKS, DeadLetter, ErrorCode
from worker.metrics import SPEC_METHOD, WorkerMetrics

__all__ = ["StatsLog"]

log = logging.getLogger("alpamayo.worker.stats")

_MESSAGE_CHARS = 200


class StatsLog:
    def __init__(self, metrics: WorkerMetrics, interval_s: float, *, queue_depth: Callable[[], int],
                 in_flight: Callable[[], int], clock: Callable[[], float] = time.monotonic):
        self.metrics, self.interval_s, self.clock = metrics, interval_s, clock
        self.queue_depth, self.in_flight = queue_depth, in_flight
        self._last = self._counters()
        self._last_t = clock()
        self._warned: dict[str, list] = {}      # code -> [time of the last warning, held back since]
        self._lock = threading.Lock()           # dead letters are noted on the engine thread too

    def _value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def _counters(self) -> dict[str, float]:
        c = {"results": sum(self._value("alpamayo_results_total", {"task": t}) for t in TASKS)}
        for code in ErrorCode:
            c[code.value] = self._value("alpamayo_dead_letters_total", {"code": code.value})
        for k in ("draft_tokens", "accepted_tokens", "verify_steps"):
            c[k] = self._value(f"alpamayo_spec_decode_{k}_total", {"method": SPEC_METHOD})
        return c

    def line(self) -> str | None:
        """The stats line for the time since the previous call; None when there was no traffic."""
        now, counters = self.clock(), self._counters()
        d = {k: v - self._last.get(k, 0.0) for k, v in counters.items()}
        dt = max(now - self._last_t, 1e-9)
        self._last, self._last_t = counters, now
        dead = {c.value: int(d[c.value]) for c in ErrorCode if d[c.value] > 0}
        queue, in_flight = self.queue_depth(), self.in_flight()
        if not (d["results"] or dead or queue or in_flight):
            return None
        parts = [f"{d['results'] / dt:.1f} results/s", f"queue {queue}", f"in flight {in_flight}",
                 f"dead letters {sum(dead.values())}"
                 + (f" ({', '.join(f'{c} {n}' for c, n in sorted(dead.items()))})" if dead else "")]
        if d["draft_tokens"] > 0:
            parts.append(f"acceptance rate {d['accepted_tokens'] / d['draft_tokens']:.2f}")
            if d["verify_steps"] > 0:
                parts.append(f"mean acceptance length {1 + d['accepted_tokens'] / d['verify_steps']:.2f}")
        gpu = self._value("alpamayo_gpu_memory_bytes")
        if gpu > 0:
            parts.append(f"GPU memory {gpu / 2**30:.1f} GiB")
        return "stats: " + ", ".join(parts)

    def dead_letter(self, dl: DeadLetter) -> None:
        """Warn about a dead letter: the first of its code at once, then one per interval and code."""
        if self.interval_s <= 0:
            return
        code, now = dl.error_code.value, self.clock()
        with self._lock:
            state = self._warned.get(code)
            if state is not None and now - state[0] < self.interval_s:
                state[1] += 1
                return
            held = state[1] if state is not None else 0
            self._warned[code] = [now, 0]
        message = dl.error_message if len(dl.error_message) <= _MESSAGE_CHARS else \
            dl.error_message[:_MESSAGE_CHARS] + "..."
        log.warning("dead letter %s at %s (request %s): %s%s", code, dl.error_field,
                    dl.request_id or f"{dl.source.topic}:{dl.source.partition}:{dl.source.offset}", message,
                    f" [{held} more {code} since the last warning]" if held else "")

    async def run(self) -> None:
        """Log the line every interval while there is traffic, until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                text = self.line()
            except Exception as exc:  # the stats line must never stop the worker
                log.debug("stats line failed: %s: %s", type(exc).__name__, exc)
                continue
            if text:
                log.info("%s", text)
