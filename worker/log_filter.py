"""Keeps a broker outage from flooding the logs: aiokafka logs one WARNING/ERROR line per
reconnect attempt (about 2,950 lines in the worker for a 26 s outage). `RepeatFilter` lets the
first line of a repeated message through, then at most one per interval carrying the count it held
back. A message is "the same" when logger, level and format string match (arguments such as the
attempt number may differ)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable


class RepeatFilter(logging.Filter):
    def __init__(self, prefix: str = "aiokafka", interval_s: float = 10.0, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 1024):
        super().__init__()
        self.prefix, self.interval_s, self.level, self.clock, self.max_keys = prefix, interval_s, level, clock, max_keys
        self._seen: dict[tuple, list] = {}      # key -> [time let through, held back since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level or not record.name.startswith(self.prefix):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            state = self._seen.get(key)
            if state is not None and now - state[0] < self.interval_s:
                state[1] += 1
                return False
            if len(self._seen) >= self.max_keys:
                self._seen.clear()
            self._seen[key] = [now, 0]
        if state is not None and state[1]:
            record.msg = f"{record.msg} [{state[1]} more like this in the last {now - state[0]:.0f}s not shown]"
        return True


def install(interval_s: float = 10.0) -> None:
    """Add a RepeatFilter for aiokafka to every handler of the root logger (handler filters see
    the records of child loggers such as ``aiokafka.conn``; logger filters would not)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(interval_s=interval_s))
