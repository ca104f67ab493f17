"""The benchmarks' clock sampler (worker/gpu_clock.py): readings taken on its thread, summarised
over the timed runs' spans only; no NVML, no sampler."""

import threading
import time

from worker import gpu_clock
from worker.gpu_clock import ClockSampler


def test_a_span_summarises_only_the_readings_taken_inside_it():
    readings = iter([(1980.0, 150.0, False)] * 4 + [(1400.0, 690.0, True), (1500.0, 680.0, True),
                                                    (1950.0, 600.0, False)] + [(1980.0, 150.0, False)] * 1000)
    s = ClockSampler(lambda: next(readings), period=0.01).start()
    while len(s._samples) < 4:                    # the idle readings before the span
        time.sleep(0.005)
    t0 = time.perf_counter()
    while len(s._samples) < 7:                    # the three readings of the "timed run"
        time.sleep(0.001)
    t1 = time.perf_counter()
    s.stop()
    inside = s.during([(t0, t1)])
    assert inside is not None and inside.samples in (3, 4)     # one more reading may land before t1 is read
    assert inside.low_mhz == 1400.0 and inside.capped >= 0.5 and inside.mean_w > 500
    assert "SM clock median" in str(inside) and "power cap in" in str(inside)
    assert s.during([(t1 + 10, t1 + 20)]) is None


def test_without_a_gpu_nothing_is_sampled():
    assert gpu_clock.sampler() is None            # the CPU machine: the bench's rows carry no clock


def test_a_reader_that_fails_ends_the_sampling_quietly_and_keeps_what_was_read(monkeypatch):
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    readings = iter([(1500.0, 650.0, True)] * 3)
    t0 = time.perf_counter()
    s = ClockSampler(lambda: next(readings), period=0.001).start()
    s._thread.join(timeout=5)                     # StopIteration on the fourth read ends the thread
    assert not s._thread.is_alive() and raised == []      # no traceback over the bench's output
    got = s.during([(t0, time.perf_counter())])
    assert got is not None and got.samples == 3 and got.median_mhz == 1500.0
