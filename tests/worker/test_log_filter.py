"""RepeatFilter: a reconnect storm from aiokafka becomes one line per interval with a count."""

import logging

from worker.log_filter import RepeatFilter


def record(name, msg, *args, level=logging.ERROR):
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_repeats_are_held_back_and_counted():
    now = [0.0]
    f = RepeatFilter(interval_s=10.0, clock=lambda: now[0])
    passed = []
    for attempt in range(160):                      # 20 s of reconnect errors, 8 per second
        r = record("aiokafka.conn", "Unable to connect to node %s (attempt %d)", 1, attempt)
        if f.filter(r):
            passed.append(r.getMessage())
        now[0] += 0.125
    assert len(passed) == 2
    assert passed[0] == "Unable to connect to node 1 (attempt 0)"
    assert passed[1].startswith("Unable to connect to node 1 (attempt 80) [79 more like this in the last 10s")


def test_other_messages_loggers_and_levels_pass():
    f = RepeatFilter(clock=lambda: 0.0)
    assert f.filter(record("aiokafka.conn", "a %s", 1))
    assert f.filter(record("aiokafka.conn", "b %s", 1))                     # another message
    assert f.filter(record("aiokafka.consumer", "a %s", 1))                 # another logger
    assert not f.filter(record("aiokafka.conn", "a %s", 2))                 # a repeat
    for _ in range(3):
        assert f.filter(record("alpamayo.worker", "same line"))             # not aiokafka
        assert f.filter(record("aiokafka.conn", "info %s", 1, level=logging.INFO))   # below WARNING
