"""Batching policy: (task, K) groups, size and wait limits, oldest-first, no starvation."""

import asyncio
import time
from dataclasses import dataclass

import pytest

from worker.batcher import Batcher


@dataclass(eq=False)
class J:
    name: str
    task: str = "trajectory"
    k: int = 1
    tp: tuple = ("req", 0)


def make(size=4, wait_ms=100):
    return Batcher(lambda j: (j.task, j.k), max_batch_size=size, max_wait_ms=wait_ms, clock=lambda: 0.0)


def names(batch):
    return [j.name for j in batch[1]]


def test_groups_by_task_and_k_and_never_mixes():
    b = make(size=8, wait_ms=0)
    b.put(J("a", k=1), now=0.0)
    b.put(J("b", k=2), now=0.1)
    b.put(J("c", task="vqa", k=1), now=0.2)
    b.put(J("d", k=1), now=0.3)
    seen = []
    while (got := b.pick(now=1.0)) is not None:
        key, items = got
        assert {(j.task, j.k) for j in items} == {key}
        seen.append((key, [j.name for j in items]))
    assert seen == [(("trajectory", 1), ["a", "d"]), (("trajectory", 2), ["b"]), (("vqa", 1), ["c"])]
    assert len(b) == 0


def test_full_group_is_ready_at_once_partial_group_waits_for_max_wait():
    b = make(size=3, wait_ms=100)
    for i in range(2):
        b.put(J(f"p{i}"), now=0.0)
    assert b.pick(now=0.05) is None                     # partial, not yet waited 100 ms
    assert b.next_deadline() == pytest.approx(0.1)
    b.put(J("p2"), now=0.06)
    assert names(b.pick(now=0.06)) == ["p0", "p1", "p2"]  # full: no waiting
    b.put(J("q"), now=1.0)
    assert b.pick(now=1.099) is None
    assert names(b.pick(now=1.1)) == ["q"]


def test_batch_never_exceeds_max_size_and_keeps_arrival_order():
    b = make(size=3, wait_ms=0)
    for i in range(7):
        b.put(J(f"j{i}"), now=i * 0.001)
    out = []
    while (got := b.pick(now=1.0)) is not None:
        assert len(got[1]) <= 3
        out.append(names(got))
    assert out == [["j0", "j1", "j2"], ["j3", "j4", "j5"], ["j6"]]


def test_oldest_group_first_so_a_rare_k_is_not_starved_by_a_busy_one():
    """K=1 is flooded (always a full batch ready); one K=3 job arrives in the middle. It must be
    served right after the K=1 jobs that arrived before it, not after the whole flood."""
    b = make(size=2, wait_ms=50)
    t = 0.0
    for i in range(6):
        b.put(J(f"k1-{i}", k=1), now=t)
        t += 0.001
    b.put(J("k3", k=3), now=t)
    for i in range(6, 40):
        t += 0.001
        b.put(J(f"k1-{i}", k=1), now=t)
    order = []
    now = t + 0.1                                      # everything has waited long enough
    while (got := b.pick(now=now)) is not None:
        order.append(names(got))
        if got[0] == ("trajectory", 1):                # the flood keeps coming
            for _ in range(2):
                t += 0.0001
                b.put(J(f"late-{t}"), now=now)
        if len(order) > 60:
            break
    k3_at = next(i for i, batch in enumerate(order) if batch == ["k3"])
    assert k3_at == 3, order[:6]                       # after the 3 full batches of the 6 older jobs


def test_a_waiting_partial_group_goes_before_newer_full_group():
    b = make(size=2, wait_ms=20)
    b.put(J("old", k=2), now=0.0)
    b.put(J("n1", k=1), now=0.015)
    b.put(J("n2", k=1), now=0.016)
    assert names(b.pick(now=0.016)) == ["n1", "n2"]    # old K=2 not ready yet, full K=1 is
    b.put(J("n3", k=1), now=0.017)
    b.put(J("n4", k=1), now=0.018)
    assert names(b.pick(now=0.021)) == ["old"]         # K=2 now ready and oldest
    assert names(b.pick(now=0.021)) == ["n3", "n4"]


def test_remove_takes_out_jobs_of_revoked_partitions():
    b = make(size=4, wait_ms=0)
    b.put(J("a", tp=("req", 0)), now=0)
    b.put(J("b", tp=("req", 1)), now=0)
    b.put(J("c", k=2, tp=("req", 1)), now=0)
    b.put(J("d", k=2, tp=("req", 0)), now=0)
    gone = b.remove(lambda j: j.tp == ("req", 1))
    assert sorted(j.name for j in gone) == ["b", "c"]
    assert len(b) == 2
    left = []
    while (got := b.pick(now=1)) is not None:
        left += names(got)
    assert sorted(left) == ["a", "d"]


def test_flush_makes_partial_groups_ready_and_close_ends_get():
    b = make(size=8, wait_ms=10_000)
    b.put(J("a"), now=0)
    assert b.pick(now=0) is None
    b.flush(True)
    assert names(b.pick(now=0)) == ["a"]
    b.close()
    with pytest.raises(RuntimeError):
        b.put(J("x"))


async def test_async_get_waits_for_the_deadline_then_returns():
    b = Batcher(lambda j: (j.task, j.k), max_batch_size=4, max_wait_ms=80)
    t0 = time.monotonic()
    b.put(J("a"))
    key, items = await asyncio.wait_for(b.get(), 2)
    waited = time.monotonic() - t0
    assert [j.name for j in items] == ["a"] and 0.07 <= waited < 1.0


async def test_async_get_wakes_when_a_group_fills():
    b = Batcher(lambda j: (j.task, j.k), max_batch_size=2, max_wait_ms=10_000)
    getter = asyncio.create_task(b.get())
    await asyncio.sleep(0.05)
    assert not getter.done()
    b.put(J("a"))
    b.put(J("b"))
    key, items = await asyncio.wait_for(getter, 1)
    assert [j.name for j in items] == ["a", "b"]


async def test_async_get_returns_none_once_closed_and_empty():
    b = Batcher(lambda j: (j.task, j.k), max_batch_size=2, max_wait_ms=10_000)
    b.put(J("a"))
    b.close()
    assert [j.name for j in (await b.get())[1]] == ["a"]
    assert await asyncio.wait_for(b.get(), 1) is None


def test_a_group_past_its_wait_waits_longer_while_records_are_in_intake():
    """After a restart over a backlog the first batch must not be the few scenes decoded in the
    first max_wait: while records are still in intake a partial group waits for them (up to
    INCOMING_WAIT_S more), and is ready as soon as intake is empty or the group is full."""
    from worker.batcher import INCOMING_WAIT_S

    pending = [3]
    b = Batcher(lambda j: (j.task, j.k), max_batch_size=4, max_wait_ms=100, clock=lambda: 0.0,
                incoming=lambda: pending[0])
    b.put(J("a"), now=0.0)
    assert b.pick(now=0.5) is None                              # past 100 ms, but 3 records are coming
    assert b.next_deadline(now=0.5) == pytest.approx(0.1 + INCOMING_WAIT_S)
    b.put(J("b"), now=0.6)
    pending[0] = 0                                              # intake empty: ready at once
    assert names(b.pick(now=0.7)) == ["a", "b"]
    pending[0] = 5
    b.put(J("c"), now=1.0)
    assert b.pick(now=1.0 + INCOMING_WAIT_S) is None
    assert names(b.pick(now=1.1 + INCOMING_WAIT_S)) == ["c"]    # the extra wait is bounded
    for i in range(4):
        b.put(J(f"f{i}"), now=2.0 + INCOMING_WAIT_S)
    assert len(b.pick(now=2.0 + INCOMING_WAIT_S)[1]) == 4       # a full group never waits


def test_full_only_picks_nothing_but_a_full_group():
    b = make(size=2, wait_ms=0)
    b.put(J("a"), now=0.0)
    assert b.pick(now=5.0, full_only=True) is None              # ready by time, but not full
    b.put(J("b"), now=0.0)
    assert names(b.pick(now=0.0, full_only=True)) == ["a", "b"]
    b.put(J("c"), now=0.0)
    b.flush(True)                                               # draining: every group counts
    assert names(b.pick(now=0.0, full_only=True)) == ["c"]


def test_picking_ahead_never_takes_a_full_group_past_an_older_one_ready_by_time():
    """The demo showed it: a full trajectory group picked ahead again and again while two vqa
    requests, older and past their wait, waited (their latency 1.7 s -> 5.8 s)."""
    b = make(size=2, wait_ms=100)
    b.put(J("v", task="vqa"), now=0.0)
    b.put(J("t0"), now=0.05)
    b.put(J("t1"), now=0.06)
    assert names(b.pick(now=0.07, full_only=True)) == ["t0", "t1"]   # vqa not ready yet: the full group goes
    b.put(J("t2"), now=0.08)
    b.put(J("t3"), now=0.09)
    assert b.pick(now=0.2, full_only=True) is None                 # vqa is ready by time and older
    assert names(b.pick(now=0.2)) == ["v"]                         # it goes first when the engine asks
    assert names(b.pick(now=0.2, full_only=True)) == ["t2", "t3"]


async def test_a_cancelled_full_only_wait_takes_nothing():
    b = Batcher(lambda j: (j.task, j.k), max_batch_size=2, max_wait_ms=0)
    waiter = asyncio.create_task(b.get(full_only=True))
    b.put(J("a"))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert names(await asyncio.wait_for(b.get(), 1)) == ["a"]
