"""The worker against a real Apache Kafka (the conftest's local KRaft broker): processes killed,
groups rebalanced, shutdowns drained.

1. SIGKILL with non-contiguous completed work (checked at the kill), exactly_once inside an open
   transaction (checked: its records are aborted), then a restart: everything answered; with
   exactly_once never two committed outputs (read_committed), and all offsets committed;
2. rebalances with a backlog in flight (a member joins and leaves, then a second worker takes
   partitions holding queued work): exactly_once, exactly one output each; at_least_once, nothing
   lost and a duplicate only where a revoke left its record uncommitted; each worker serves its own;
3. SIGTERM: 503 while loading, drain of everything fetched, exit 0, offsets committed, nothing
   re-delivered to the restarted worker.

Subprocess workers (``python -m worker serve``) on the baseline profile, tiny random checkpoint.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import signal
import time
from collections import defaultdict

import pytest

import schemas as S
from worker.scenes.request import build_request

from tests.worker.kafka_harness import (L, Proc, collect, committed_offsets, free_port, http_get, metric_values,
                                        produce, request_item, trajectory_requests, unique, worker_env)

pytestmark = pytest.mark.kafka


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        p.cleanup()


# --------------------------------------------------------------------------------------------
# 1. SIGKILL mid-run, restart: every request answered; exactly_once: never two committed results
# --------------------------------------------------------------------------------------------


def engine_done(w: Proc) -> set[str]:
    """Request ids whose engine batch finished (the worker's DEBUG "batch done" lines)."""
    done = set()
    for m in re.finditer(r"batch done: (\[.*\])", w.log_path.read_text(errors="replace")):
        done |= {rid for rid, _ in ast.literal_eval(m.group(1))}
    return done


async def kill_in_an_open_transaction(w: Proc, bootstrap, topics, timeout=60.0, settle=0.3) -> int:
    """SIGKILL the worker while one of its transactions is open. Watches the output topics until one
    holds records of an open transaction (high watermark past the last stable offset), SIGSTOPs the
    worker at once and reads the offsets again `settle` seconds later: still open, the worker is
    killed; else (the commit was already on its way to the coordinator, whose markers then land a
    moment after the stop) SIGCONT and watch on. Returns the number of stops."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    tps = [TopicPartition(t, 0) for t in topics]
    readers = [AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=iso, enable_auto_commit=False)
               for iso in ("read_uncommitted", "read_committed")]
    for r in readers:
        await r.start()

    async def open_txn() -> bool:
        high, stable = [await r.end_offsets(tps) for r in readers]
        return any(high[tp] > stable[tp] for tp in tps)

    try:
        deadline = time.monotonic() + timeout
        stops = 0
        while time.monotonic() < deadline:
            if not await open_txn():
                continue
            stops += 1
            w.signal(signal.SIGSTOP)
            await asyncio.sleep(settle)
            if await open_txn():
                w.signal(signal.SIGKILL)
                return stops
            w.signal(signal.SIGCONT)
        raise AssertionError(f"no open transaction caught in {stops} stops")
    finally:
        for r in readers:
            await r.stop()


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
async def test_sigkill_mid_run_and_restart_answers_everything(
        guarantee, kafka_bootstrap, topic_factory, tiny, scene, tmp_path, procs):
    """Every request is answered after a SIGKILL and a restart; exactly_once: never two committed
    outputs for one request (read_committed), at_least_once: possibly two, never none.

    Partition 0 starts with the only K=2 request, whose batch waits for a mate published after the
    restart, while the K=1 requests behind it complete: the kill lands while the partition's
    completed work is not contiguous (checked: the engine finished some of them, not offset 0) -
    the case where committing results beyond the committed offset would duplicate them after the
    restart. Partition 1 gets a stream of K=1 requests; exactly_once: the kill lands while one of
    its transactions is open (the output topic's high watermark past its last stable offset while
    the worker is SIGSTOPped), and its records are seen aborted after the restart."""
    ckpt, _ = tiny
    req_t, res_t, dl_t = [await topic_factory(p, prefix=n) for n, p in (("req", 2), ("res", 1), ("dl", 1))]
    lone, mate = [build_request(scene, "trajectory", 2, request_id=f"kill-p0-k2-{i}", temperature=0.7, seed=i)
                  for i in range(2)]
    p0 = [lone] + trajectory_requests(scene, 3, "kill-p0")
    await produce(kafka_bootstrap, req_t, [request_item(r) for r in p0], partition_of=lambda i: 0)
    group = unique(f"g-kill-{guarantee}")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, group, unique("w-kill"), free_port(), ckpt,
                     ALPAMAYO_PROCESSING_GUARANTEE=guarantee, NIM_ALPAMAYO_TRAJ_SAMPLES="1,2",
                     ALPAMAYO_MAX_BATCH_WAIT_MS="60000", ALPAMAYO_LOG_LEVEL="DEBUG")
    first = Proc(env, tmp_path / "first.log")
    procs.append(first)
    await first.wait_ready()
    p1: list = []
    killed = asyncio.Event()

    async def stream_p1():                     # keeps partition 1's transactions coming until the kill
        while not killed.is_set() and len(p1) < 300:
            (req,) = trajectory_requests(scene, 1, f"kill-p1-{len(p1)}")
            await produce(kafka_bootstrap, req_t, [request_item(req)], partition_of=lambda i: 1)
            p1.append(req)
            await asyncio.sleep(0.05)

    streaming = asyncio.create_task(stream_p1())
    try:
        deadline = time.monotonic() + 120
        while not ({r.request_id for r in p0[1:]} & engine_done(first)):
            assert time.monotonic() < deadline, first.tail()
            await asyncio.sleep(0.1)
        if guarantee == "exactly_once":
            tries = await kill_in_an_open_transaction(first, kafka_bootstrap, [res_t, dl_t])
            print(f"killed in an open transaction after {tries} SIGSTOPs")
        else:
            first.signal(signal.SIGKILL)
        assert await first.wait_exit(30) == -signal.SIGKILL
    finally:
        killed.set()
        await streaming
    done_at_kill = engine_done(first)
    assert lone.request_id not in done_at_kill and {r.request_id for r in p0[1:]} & done_at_kill, \
        "partition 0's completed work was not non-contiguous at the kill"
    reqs = p0 + [mate] + list(p1)
    after_kill = await collect(kafka_bootstrap, res_t, dl_t, partitions=1, expected=[], timeout=3,
                               stop_when=lambda o: False)
    assert len(after_kill.by_id) < len(reqs), "the kill did not land mid-run"

    # same static member (and transactional ids); no long batch wait: the mate comes now, and an odd
    # K=1 request left over must not wait for a mate that never comes
    second = Proc({**env, "ALPAMAYO_MAX_BATCH_WAIT_MS": "200"}, tmp_path / "second.log")
    procs.append(second)
    await second.wait_ready()
    # a serving process moves what it loaded out of the garbage collector's reach (process.load_and_freeze)
    assert re.search(r"objects frozen for the garbage collector: [1-9]\d*", second.log_path.read_text(errors="replace"))
    await produce(kafka_bootstrap, req_t, [request_item(mate)], partition_of=lambda i: 0)
    out = await collect(kafka_bootstrap, res_t, dl_t, partitions=1, expected=[r.request_id for r in reqs],
                        timeout=150, settle=2.0)
    assert set(out.by_id) == {r.request_id for r in reqs}
    assert all(isinstance(m, S.InferResult) for v in out.by_id.values() for m in v)
    if guarantee == "exactly_once":
        dup = {i: len(v) for i, v in out.by_id.items() if len(v) != 1}
        assert dup == {}, f"requests with more than one committed output: {dup}"
        raw = await collect(kafka_bootstrap, res_t, dl_t, partitions=1, expected=[r.request_id for r in reqs],
                            timeout=30, isolation="read_uncommitted")
        aborted = sum(map(len, raw.by_id.values())) - len(reqs)
        print(f"{aborted} output records of aborted transactions, {len(p1)} requests streamed to partition 1")
        assert aborted > 0, "the kill did not land in an open transaction"
    second.signal(signal.SIGTERM)
    assert await second.wait_exit(90) == 0, second.tail()
    assert await committed_offsets(kafka_bootstrap, group, req_t, [0, 1]) == {0: len(p0) + 1, 1: len(p1)}


# --------------------------------------------------------------------------------------------
# 2. rebalances in the middle of work lose and repeat nothing; two workers split the partitions
#    and together answer everything
# --------------------------------------------------------------------------------------------


async def held_partitions(w: Proc) -> set[int]:
    """The partitions a worker holds: the labels of its consumer-lag series."""
    text = (await http_get(w.url + "/v1/metrics"))[1].decode()
    return {int(dict(k)["partition"]) for k in metric_values(text, "alpamayo_consumer_lag")}


async def join_and_leave(bootstrap, group, topic, timeout=60.0) -> set[int]:
    """A plain consumer joins the group (eager rebalance), holds partitions until assigned, then
    leaves without committing anything (a second rebalance). Returns what it was assigned."""
    from aiokafka import AIOKafkaConsumer

    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        deadline = time.monotonic() + timeout
        while not c.assignment():
            assert time.monotonic() < deadline, "the probe member never got an assignment"
            await asyncio.sleep(0.05)
        return {tp.partition for tp in c.assignment()}
    finally:
        await c.stop()


def revoke_lines(w: Proc) -> list[str]:
    return [ln for ln in w.log_path.read_text(errors="replace").splitlines() if "revoked [" in ln]


def assert_duplicates_only_where_uncommitted(out, coords: dict[str, tuple[int, int]], workers) -> None:
    """at_least_once: a request answered twice must have been left uncommitted by a revoke of its
    partition: the revoke's log line shows a committed offset at or below its record (an earlier
    record of the partition unfinished, or a failed commit)."""
    dups = {rid: coords[rid] for rid, v in out.by_id.items() if len(v) > 1}
    text = "\n".join(w.log_path.read_text(errors="replace") for w in workers)
    revoked_at: dict[int, list] = defaultdict(list)         # partition -> committed offsets at its revokes
    for m in re.finditer(r"revoked \[.*?\]: committed up to (\{.*?\}), abandoned", text):
        for tp, off in ast.literal_eval(m.group(1)).items():
            revoked_at[int(tp.rsplit(":", 1)[1])].append(off)
    for rid, (part, off) in dups.items():
        assert any(c is None or c <= off for c in revoked_at[part]), \
            f"{rid} (partition {part}, offset {off}) answered twice though committed at every revoke: " \
            f"{revoked_at[part]}"


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
async def test_rebalances_mid_run_lose_nothing_and_two_workers_split_the_partitions(
        guarantee, kafka_bootstrap, topic_factory, tiny, scene, tmp_path, procs):
    """1. While w-a works through a backlog, a plain member joins the group and leaves again (two eager
    rebalances, the first meeting queued work); 2. w-b joins while w-a holds queued work of the
    partitions moving to w-b (p0 or p1, each with a lone request waiting for its batch mate), and
    the two split the partitions. exactly_once: every request exactly one output (read_committed);
    at_least_once: every request answered, twice only where a revoke left its record uncommitted
    (at_least_once publishes a result as soon as it is ready, but commits only up to the
    partition's first unfinished record: results behind the lone request are re-delivered).
    Requests published after the split are served by the worker holding their partition."""
    ckpt, _ = tiny
    req_t, res_t, dl_t = [await topic_factory(4, prefix=p) for p in ("req", "res", "dl")]
    group = unique("g-pair")
    names = [unique("w-a"), unique("w-b")]
    # A lone K=2 request waits 30 s for a mate, far longer than the group takes to rebalance: the first
    # revoke meets queued work whatever the speed of the machine (a backlog of K=1 work alone
    # can drain before the group settles). Its mate is published after the probe has left.
    envs = [worker_env(kafka_bootstrap, req_t, res_t, dl_t, group, name, free_port(), ckpt,
                       ALPAMAYO_PROCESSING_GUARANTEE=guarantee, NIM_ALPAMAYO_TRAJ_SAMPLES="1,2,3",
                       ALPAMAYO_MAX_BATCH_WAIT_MS="30000") for name in names]
    a = Proc(envs[0], tmp_path / "w-a.log")
    procs.append(a)
    await a.wait_ready()

    def assert_answered(out, reqs):
        assert set(out.by_id) == {r.request_id for r in reqs}, "a rebalance with work in flight lost a request"
        if guarantee == "exactly_once":
            dup = {i: len(v) for i, v in out.by_id.items() if len(v) != 1}
            assert dup == {}, f"requests with more than one committed output: {dup}"
        else:
            assert_duplicates_only_where_uncommitted(out, coords, procs)

    # phase 1: while w-a works through a backlog, a member joins (rebalance: everything revoked
    # and reassigned) and leaves again (second rebalance)
    lone, mate = trajectory_requests(scene, 2, "pair1-k2", k=2)
    first = [lone] + trajectory_requests(scene, 16, "pair1")
    coords = await produce(kafka_bootstrap, req_t, [request_item(r) for r in first], partition_of=lambda i: i % 4)
    await collect(kafka_bootstrap, res_t, dl_t, partitions=4, expected=[], timeout=120,
                  stop_when=lambda o: len(o.by_id) >= 2)
    probe_held = await join_and_leave(kafka_bootstrap, group, req_t)
    assert probe_held and probe_held < {0, 1, 2, 3}
    coords |= await produce(kafka_bootstrap, req_t, [request_item(mate)], partition_of=lambda i: 0)
    first.append(mate)
    out = await collect(kafka_bootstrap, res_t, dl_t, partitions=4, expected=[r.request_id for r in first],
                        timeout=180, settle=1.0)
    assert_answered(out, first)
    deadline = time.monotonic() + 30            # the leave's rebalance may land after the last result
    while len(revoke_lines(a)) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    revokes = revoke_lines(a)
    assert len(revokes) >= 2, revokes
    abandoned, _ = map(int, re.search(r"abandoned (\d+) queued, (\d+) unfinished", revokes[0]).groups())
    assert abandoned > 0, revokes[0]                     # the first revoke met queued work

    # phase 2: w-b joins while w-a holds a lone K=2 request on p0 and a lone K=3 request on p1 (the
    # round-robin assignor gives p0 and p1 to different members: one of them moves to w-b)
    lone2, mate2 = trajectory_requests(scene, 2, "pair2-k2", k=2)
    lone3, mate3 = trajectory_requests(scene, 2, "pair2-k3", k=3)
    coords |= await produce(kafka_bootstrap, req_t, [request_item(r) for r in (lone2, lone3)],
                            partition_of=lambda i: i)
    before = len(revoke_lines(a))
    b = Proc(envs[1], tmp_path / "w-b.log")
    procs.append(b)
    await b.wait_ready()
    deadline = time.monotonic() + 60
    while True:
        held = [await held_partitions(a), await held_partitions(b)]
        if all(held) and held[0].isdisjoint(held[1]) and held[0] | held[1] == {0, 1, 2, 3}:
            break
        assert time.monotonic() < deadline, f"partitions never split: {held}"
        await asyncio.sleep(0.5)
    assert len(revoke_lines(a)) > before and held[1] & {0, 1}, "no partition with queued work moved to w-b"
    second = trajectory_requests(scene, 8, "pair2") + [mate2, mate3]
    coords |= await produce(kafka_bootstrap, req_t, [request_item(r) for r in second],
                            partition_of=lambda i: i % 4 if i < 8 else i - 8)
    second += [lone2, lone3]
    expected = first + second
    out = await collect(kafka_bootstrap, res_t, dl_t, partitions=4, expected=[r.request_id for r in expected],
                        timeout=150, settle=1.0)
    assert_answered(out, expected)
    served = defaultdict(set)
    for r in second:
        res = out.by_id[r.request_id][-1]
        assert isinstance(res, S.InferResult)
        served[res.lineage.worker_id].add(res.lineage.partition)
    assert served == {names[0]: held[0], names[1]: held[1]}
    for w in (a, b):
        w.signal(signal.SIGTERM)
    for w in (a, b):
        assert await w.wait_exit(90) == 0, w.tail()


# --------------------------------------------------------------------------------------------
# 3. SIGTERM drains in-flight work and commits; nothing is re-delivered after a restart
# --------------------------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_work_commits_and_nothing_is_redelivered(
        kafka_bootstrap, topic_factory, tiny, scene, tmp_path, procs):
    ckpt, _ = tiny
    req_t, res_t, dl_t = [await topic_factory(1, prefix=p) for p in ("req", "res", "dl")]
    n = 10
    reqs = trajectory_requests(scene, n, "term")
    await produce(kafka_bootstrap, req_t, [request_item(r) for r in reqs])
    group = unique("g-term")
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, group, unique("w-term"), free_port(), ckpt)
    first = Proc(env, tmp_path / "first.log")
    procs.append(first)
    statuses = await first.wait_ready()
    assert 503 in statuses, "the side port must answer 503 while the model loads"

    # baseline profile: no speculative fields, no speculative counters
    model = json.loads((await http_get(first.url + "/v1/models"))[1])["data"][0]
    assert (model["profile"], model["speculative_decoding"], model["speculative_model"], model["k_values"]) == (
        "bf16", None, None, [1])
    text = (await http_get(first.url + "/v1/metrics"))[1].decode()
    assert "alpamayo_spec_decode" not in text and "alpamayo_ready 1.0" in text
    assert (await http_get(first.url + "/v1/health/live"))[0] == 200

    partial = await collect(kafka_bootstrap, res_t, dl_t, partitions=1, expected=[], timeout=120,
                            stop_when=lambda o: len(o.by_id) >= 1)
    first.signal(signal.SIGTERM)
    assert await first.wait_exit(90) == 0, first.tail()
    assert len(partial.by_id) < n, "SIGTERM came after all work was done: nothing was in flight"
    out = await collect(kafka_bootstrap, res_t, dl_t, partitions=1, expected=[r.request_id for r in reqs], timeout=10)
    assert {i: len(v) for i, v in out.by_id.items()} == {r.request_id: 1 for r in reqs}  # drained, not dropped
    assert await committed_offsets(kafka_bootstrap, group, req_t, [0]) == {0: n}
    assert "drained: every fetched record published and committed" in first.tail(80)

    # restart: nothing old comes back; a new request is answered (after anything re-delivered)
    second = Proc(env, tmp_path / "second.log")
    procs.append(second)
    await second.wait_ready()
    await produce(kafka_bootstrap, req_t, [request_item(trajectory_requests(scene, 1, "after")[0])])
    out = await collect(kafka_bootstrap, res_t, dl_t, partitions=1, expected=["after-0"], timeout=120)
    assert {i: len(v) for i, v in out.by_id.items()} == {**{r.request_id: 1 for r in reqs}, "after-0": 1}
    second.signal(signal.SIGTERM)
    assert await second.wait_exit(90) == 0, second.tail()
