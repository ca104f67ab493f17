"""What the GPU ran at while the benchmarks timed it: the SM clock, the board's power draw and
whether the power cap held the clock down, sampled through NVML by a background thread
(`nvidia-ml-py`, which the GPU images carry; where it is missing, or on the CPU, nothing is
sampled and the figures carry no clock).

Why the benchmarks print it: the H200 caps its board at 700 W, and the 24-image prefill's
products reach the cap. Thirty-first session (2026-12-04, docs/benchmarks.md): one fp8 prefill ran
331 ms (321-353) when prefills ran back to back and 319 ms (315-324) after 2 s idle, the same
code, the CUDA events' device time equal to the wall; in the samples over 450 W the SM clock's
median was 1,485 MHz (1,155-1,980) with the power-cap reason set in 99% of them, 1,980 MHz idle.
So two figures of one row differ by the clock they ran at, which the row now says.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

SAMPLE_S = 0.1                 # NVML's readings moved every ~100 ms on the H200 (nvidia-smi -lms 50)
POWER_CAP_REASON = 0x4         # NVML clocks-event reason "software power cap"

Reading = tuple[float, float, bool]          # (SM clock MHz, board power W, power cap holding the clock)


@dataclass(frozen=True)
class ClockSummary:
    samples: int
    median_mhz: float
    low_mhz: float
    high_mhz: float
    mean_w: float
    capped: float              # fraction of samples with the power cap holding the clock down

    def __str__(self) -> str:
        return (f"SM clock median {self.median_mhz:,.0f} MHz ({self.low_mhz:,.0f}-{self.high_mhz:,.0f}), "
                f"{self.mean_w:.0f} W, power cap in {self.capped:.0%} of {self.samples} samples")


class ClockSampler:
    """Readings of `reader()` every `period` seconds on a daemon thread, stamped with
    time.perf_counter(); `during(spans)` summarises those taken inside the given spans."""

    def __init__(self, reader: Callable[[], Reading], period: float = SAMPLE_S):
        self._reader = reader
        self._period = period
        self._samples: list[tuple[float, Reading]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-clock", daemon=True)

    def start(self) -> "ClockSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reading = self._reader()
            except Exception:          # the driver stopped answering: keep what was sampled
                return
            with self._lock:
                self._samples.append((time.perf_counter(), reading))
            self._stop.wait(self._period)

    def during(self, spans: list[tuple[float, float]]) -> ClockSummary | None:
        """The readings taken inside any of `spans` ((start, end) in perf_counter seconds), or
        None where there are none."""
        with self._lock:
            inside = [r for t, r in self._samples if any(a <= t <= b for a, b in spans)]
        if not inside:
            return None
        mhz = [r[0] for r in inside]
        return ClockSummary(len(inside), statistics.median(mhz), min(mhz), max(mhz),
                            statistics.fmean(r[1] for r in inside), sum(r[2] for r in inside) / len(inside))


def nvml_reader(index: int = 0) -> Callable[[], Reading] | None:
    """A reader of GPU `index` (NVML's numbering) through NVML, or None where NVML cannot be had."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:                  # no nvidia-ml-py, no driver: nothing to sample
        return None
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def read() -> Reading:
        return (float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3, bool(reasons(handle) & POWER_CAP_REASON))
    try:
        read()
    except Exception:                  # a query this driver does not answer: nothing to sample
        return None
    return read


_sampler: ClockSampler | None = None


def sampler() -> ClockSampler | None:
    """The process's sampler of the current CUDA device, started on first use; None without NVML."""
    global _sampler
    if _sampler is None:
        import torch

        if not torch.cuda.is_available():
            return None
        cuda_index = torch.cuda.current_device()
        try:                           # NVML counts every GPU; CUDA only the visible ones
            index = torch.cuda._get_nvml_device_index(cuda_index)
        except Exception:
            index = cuda_index
        reader = nvml_reader(index)
        if reader is None:
            return None
        _sampler = ClockSampler(reader).start()
    return _sampler
