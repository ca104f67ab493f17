"""worker.stats: the periodic stats line (deltas of the Prometheus counters, silent when idle) and
one warning per dead-letter code and interval."""

import logging

import schemas as S
from worker.metrics import WorkerMetrics
from worker.stats import StatsLog


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def _dead_letter(code: S.ErrorCode, rid: str, message: str = "bad bytes") -> S.DeadLetter:
    return S.DeadLetter(request_id=rid, error_code=code, error_field="$.images[2]", error_message=message,
                        original_value=b"", original_size=0, source=S.SourceCoordinates(topic="req", partition=0,
                                                                                         offset=1),
                        worker_id="w", failed_at=0.0)


def test_stats_line_reports_the_interval_and_is_silent_when_idle():
    m, clock, now = WorkerMetrics(spec_counters=True), Clock(), {"queue": 0, "in_flight": 0}
    stats = StatsLog(m, 10.0, queue_depth=lambda: now["queue"], in_flight=lambda: now["in_flight"], clock=clock)
    clock.t += 10
    assert stats.line() is None                                   # no traffic: no line
    m.results.labels(task="trajectory").inc(20)
    m.results.labels(task="vqa").inc(5)
    m.dead_letters.labels(code="bad_image").inc(2)
    m.dead_letters.labels(code="k_not_served").inc()
    m.spec_draft.labels(method="dflash2").inc(700)
    m.spec_accepted.labels(method="dflash2").inc(280)
    m.spec_steps.labels(method="dflash2").inc(100)
    m.gpu_memory.set(3 * 2**30)
    now.update(queue=4, in_flight=9)
    clock.t += 10
    assert stats.line() == ("stats: 2.5 results/s, queue 4, in flight 9, dead letters 3 (bad_image 2, "
                            "k_not_served 1), acceptance rate 0.40, mean acceptance length 3.80, GPU memory 3.0 GiB")
    now["queue"] = 1                                              # still working, nothing new published
    clock.t += 5
    assert stats.line() == "stats: 0.0 results/s, queue 1, in flight 9, dead letters 0, GPU memory 3.0 GiB"


def test_one_dead_letter_warning_per_code_and_interval(caplog):
    clock = Clock()
    stats = StatsLog(WorkerMetrics(spec_counters=False), 10.0, queue_depth=lambda: 0, in_flight=lambda: 0,
                     clock=clock)
    caplog.set_level(logging.WARNING, logger="alpamayo.worker.stats")
    for i in range(5):
        stats.dead_letter(_dead_letter(S.ErrorCode.BAD_IMAGE, f"r{i}"))
    stats.dead_letter(_dead_letter(S.ErrorCode.K_NOT_SERVED, "k", "x" * 500))
    clock.t += 11
    stats.dead_letter(_dead_letter(S.ErrorCode.BAD_IMAGE, "r9"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "dead letter bad_image at $.images[2] (request r0): bad bytes"
    assert lines[1].startswith("dead letter k_not_served at $.images[2] (request k): xxx") and len(lines[1]) < 300
    assert lines[2] == "dead letter bad_image at $.images[2] (request r9): bad bytes [4 more bad_image since the last warning]"
    assert len(lines) == 3
