"""Groups jobs that can share one forward batch: same task family and same K.

Policy
------
* A group (task, K) is *ready* when it holds ``max_batch_size`` jobs, when its oldest job has
  waited ``max_batch_wait_ms``, or while flushing (drain on SIGTERM).
* Among ready groups the one whose oldest job is oldest goes first, and a batch takes that
  group's jobs in arrival order. So a K that is rarely requested waits at most for the jobs that
  arrived before it (plus its own wait time), never behind a busy K indefinitely.
* A batch holds at most ``max_batch_size`` jobs.
* While records are still in intake (``incoming``: fetched, being decoded), a group past its
  wait time waits for them up to INCOMING_WAIT_S longer, unless it is full: after a restart over
  a backlog the first batch is then as full as the later ones, not the few scenes decoded in the
  first ``max_batch_wait_ms`` (measured on the H200: a partial first batch cost one batch's time in
  ten).
* ``get(full_only=True)`` returns the next batch only when it is a full group: the worker picks
  the next batch ahead, while the engine runs the current one, only when waiting could not have
  filled it further, and never past an older group that is ready by time.

The engine pulls (:meth:`Batcher.get`) only when it is free, so while a batch runs the next one
fills up; jobs that already waited through a batch are ready at once.

The policy (:meth:`Batcher.pick`, :meth:`Batcher.next_deadline`) is synchronous and takes the
time as an argument, for tests; :meth:`Batcher.get` is the asyncio wrapper.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Batcher", "INCOMING_WAIT_S"]

INCOMING_WAIT_S = 2.0      # longest extra wait of a group for records still in intake (a batch of 16
                           # full-HD scenes took ~2.5 s through intake on the H200 with 2 intake threads)

T = TypeVar("T")


class Batcher(Generic[T]):
    def __init__(self, key: Callable[[T], Hashable], max_batch_size: int = 8, max_wait_ms: float = 20.0,
                 clock: Callable[[], float] = time.monotonic, incoming: Callable[[], int] = lambda: 0):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.key = key
        self.max_batch_size = int(max_batch_size)
        self.max_wait_s = max(0.0, float(max_wait_ms)) / 1000.0
        self.clock = clock
        self.incoming = incoming
        self._groups: dict[Hashable, deque[tuple[float, int, T]]] = {}
        self._seq = itertools.count()
        self._size = 0
        self._flushing = False
        self._closed = False
        self._event: asyncio.Event | None = None

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def groups(self) -> dict[Hashable, int]:
        return {k: len(q) for k, q in self._groups.items()}

    def put(self, item: T, now: float | None = None) -> None:
        if self._closed:
            raise RuntimeError("batcher is closed")
        now = self.clock() if now is None else now
        self._groups.setdefault(self.key(item), deque()).append((now, next(self._seq), item))
        self._size += 1
        self._wake()

    def remove(self, predicate: Callable[[T], bool]) -> list[T]:
        """Take out every queued item matching ``predicate`` (e.g. jobs of revoked partitions)."""
        out: list[T] = []
        for k in list(self._groups):
            q = self._groups[k]
            keep = deque(e for e in q if not predicate(e[2]))
            out.extend(e[2] for e in q if predicate(e[2]))
            if keep:
                self._groups[k] = keep
            else:
                del self._groups[k]
        self._size -= len(out)
        return out

    def flush(self, on: bool = True) -> None:
        """While on, every non-empty group is ready at once (draining)."""
        self._flushing = on
        self._wake()

    def notify(self) -> None:
        """Something outside the queue changed (a record left intake without a job): re-check."""
        self._wake()

    def close(self) -> None:
        """No more puts; :meth:`get` returns what is queued, then None."""
        self._closed = True
        self._flushing = True
        self._wake()

    # ------------------------------------------------------------------ policy
    def _ready(self, q: deque, now: float) -> bool:
        if self._flushing or len(q) >= self.max_batch_size:
            return True
        waited = now - q[0][0]
        if waited < self.max_wait_s:
            return False
        return waited >= self.max_wait_s + INCOMING_WAIT_S or not self.incoming()

    def pick(self, now: float | None = None, full_only: bool = False) -> tuple[Hashable, list[T]] | None:
        """The next batch if one is ready: (group key, items); else None. full_only: only when
        that next batch is a full group (or any while flushing), so picking ahead never takes a
        full group past an older one that is ready by time."""
        now = self.clock() if now is None else now
        best = None
        for k, q in self._groups.items():
            if q and self._ready(q, now) and (best is None or q[0][:2] < self._groups[best][0][:2]):
                best = k
        if best is None or (full_only and not self._flushing and len(self._groups[best]) < self.max_batch_size):
            return None
        q = self._groups[best]
        items = [q.popleft()[2] for _ in range(min(self.max_batch_size, len(q)))]
        if not q:
            del self._groups[best]
        self._size -= len(items)
        return best, items

    def next_deadline(self, now: float | None = None) -> float | None:
        """Clock time at which the oldest waiting group becomes ready by time (None when empty);
        past its wait time while records are in intake, the end of its extra wait."""
        now = self.clock() if now is None else now
        out = None
        for q in self._groups.values():
            if q:
                d = q[0][0] + self.max_wait_s
                if d <= now and self.incoming():
                    d += INCOMING_WAIT_S
                out = d if out is None else min(out, d)
        return out

    # ------------------------------------------------------------------ asyncio
    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()

    async def get(self, full_only: bool = False) -> tuple[Hashable, list[T]] | None:
        """Wait for the next ready batch (full_only: a full group, `pick`); None once closed and
        empty. Cancelling the wait loses nothing (a pick takes jobs only when it returns them)."""
        if self._event is None:
            self._event = asyncio.Event()
        while True:
            picked = self.pick(full_only=full_only)
            if picked is not None:
                return picked
            if self._closed and self._size == 0:
                return None
            deadline = None if full_only else self.next_deadline()     # time never makes a full group the next
            self._event.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except TimeoutError:
                pass
