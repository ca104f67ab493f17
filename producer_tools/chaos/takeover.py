"""Two workers in one group: ``zombie`` (a paused worker's partitions taken over, then it resumes)
and ``same-host`` (two workers with the default configuration, as one per GPU on one host).

``zombie`` (exactly_once; static members ``pod-a`` and ``pod-b``, as pods named by Kubernetes):
worker A is SIGSTOPped while it holds fetched, unanswered records and
its engine is computing, for longer than the session timeout; worker B takes A's partitions over
(its per-partition producers fence A's) and answers everything; A is SIGCONTed. Promise: nothing
lost, nothing duplicated under read_committed, and A's late work never published: either its
late transaction is fenced (its log names the fencing; A then exits 1 by itself and is restarted
by the harness, a supervisor, which is expected; the final drain is the restarted A's), or A's
rebalance callback runs first and revokes the partitions, discarding the work (its log has the
revoke line; A stays up as a member again).

``same-host``: both workers without ``ALPAMAYO_GROUP_INSTANCE_ID`` and ``ALPAMAYO_WORKER_ID``
(the defaults of two containers or processes on one host). Promise: both serve (each publishes
results), neither exits by itself nor logs a fencing error, nothing lost (exactly_once: nothing
duplicated).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from pathlib import Path

from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import Figures
from producer_tools.chaos.pipeline import DEFAULT_PARTITIONS, Pipeline, _work_dir
from producer_tools.chaos.processes import Managed, _http_text, make_worker
from producer_tools.common import metric_sum

log = logging.getLogger("alpamayo.chaos")

DEFAULT_IDENTITY = {"ALPAMAYO_GROUP_INSTANCE_ID": "", "ALPAMAYO_WORKER_ID": ""}
FENCED = re.compile(r"ProducerFenced|InvalidProducerEpoch|fenced", re.IGNORECASE)
REVOKED = re.compile(r"revoked \[[^\]]*\]: committed up to")          # worker.service's revoke line
SESSION_TIMEOUT_S = 10.0       # aiokafka's default session.timeout.ms (the worker keeps it)
ZOMBIE_EXIT_WAIT_S = 120.0     # a fenced zombie stops: its consumer leaves within the rebalance timeout


def second_worker(pl: Pipeline, name: str, **env: str) -> Managed:
    """Another worker of the pipeline's group, configured as the pipeline's own (plus ``env``)."""
    w = make_worker(pl.broker, pl.topics, pl.work, checkpoint=Path(pl.worker.env["NIM_FT_CHECKPOINT"]),
                    group=pl.group, guarantee=pl.guarantee, reasoning_tokens=pl.reasoning_tokens,
                    batch_size=pl.batch_size, device=pl.device, extra={**pl.worker_extra, **env})
    w.name = name
    return w


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])       # utime + stime


async def _busy(pid: int, window_s: float = 0.2) -> bool:
    """The process used at least half a core over ``window_s`` (its engine is computing)."""
    t0 = _cpu_ticks(pid)
    await asyncio.sleep(window_s)
    return (_cpu_ticks(pid) - t0) / os.sysconf("SC_CLK_TCK") >= 0.5 * window_s


def _logs(w: Managed) -> str:
    return "\n".join(w.log_path(n).read_text(errors="replace") for n in range(1, w.starts + 1)
                     if w.log_path(n).exists())


async def _start_both(pl: Pipeline, b: Managed, timeout: float) -> None:
    await pl.start_worker(timeout)
    b.supervise = True
    b.start()
    await b.wait_ready(timeout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:          # both hold partitions (their lag series)
        texts = [_http_text(w.ready_url() + "/v1/metrics") or "" for w in (pl.worker, b)]
        if all("alpamayo_consumer_lag{" in t for t in texts):
            return
        await asyncio.sleep(0.5)
    pl.fig.failures.append("the two workers did not split the partitions within 60s")


async def run_zombie(broker: Broker, *, scenes: int = 40, guarantee: str = "exactly_once",
                     work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                     pause_s: float = SESSION_TIMEOUT_S + 8.0, timeout: float = 600.0, reasoning_tokens: int = 4,
                     batch_size: int = 2) -> Figures:
    work = _work_dir(work, "zombie")
    async with Pipeline(broker, scenario="zombie", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, reasoning_tokens=reasoning_tokens, batch_size=batch_size,
                        worker_extra={"ALPAMAYO_GROUP_INSTANCE_ID": "pod-a"}) as pl:
        f = pl.fig
        b = second_worker(pl, "worker-b", ALPAMAYO_GROUP_INSTANCE_ID="pod-b")
        try:
            pl.start_sink()
            await _start_both(pl, b, timeout)
            a = pl.worker
            warm = min(4, scenes - 1)                 # both workers' transactional producers in use
            await pl.publish(0, warm)
            await pl.wait_answered(warm, timeout)
            await pl.publish(warm, scenes)
            # A holds work: it has fetched records of the run and its engine is computing them. Watched
            # from the moment of publishing (CPU time, sampled every 0.1 s), not from the lag gauge: that
            # is refreshed every 2 s and a short run is over in less (CI once paused A after the last answer)
            deadline = time.monotonic() + timeout
            while pl.monitor.answered < scenes and time.monotonic() < deadline:
                if a.pid and await _busy(a.pid, 0.1):
                    break
            before = pl.monitor.answered
            if before >= scenes:
                f.failures.append("the run was answered before the zombie could be paused")
            a_pid = a.pid
            a.supervise = False                       # a stopped process is not an exit
            os.kill(a_pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            f.worker_kills += 1
            f.extra["zombie"] = f"A SIGSTOPped at {before}/{scenes} answered, its engine busy"
            answered_by_b = await pl.wait_answered(scenes, timeout)
            await asyncio.sleep(max(0.0, pause_s - (time.monotonic() - t_stop)))
            if not answered_by_b:
                f.failures.append("worker B did not answer the run while A was paused")
            f.extra["paused"] = f"{time.monotonic() - t_stop:.1f}s (session timeout {SESSION_TIMEOUT_S:.0f}s)"
            seen = len(_logs(a))                      # A's log so far: the revoke lines of the initial split
            os.kill(a_pid, signal.SIGCONT)
            a.supervise = True                        # a fenced zombie exits; restarted as a pod would be
            t_cont = time.monotonic()
            # A's late work ends one of two ways, both safe: it meets B's producers and is fenced (A
            # exits), or A's rebalance callback runs first, revokes the partitions and discards it
            # unpublished (A stays up: no need to wait out ZOMBIE_EXIT_WAIT_S for an exit)
            revoked_at = None
            while time.monotonic() - t_cont < ZOMBIE_EXIT_WAIT_S and not a.unplanned_exits:
                tail = _logs(a)[seen:]
                if not FENCED.search(tail) and REVOKED.search(tail):     # fenced: wait for its exit
                    revoked_at = revoked_at or time.monotonic()
                    if time.monotonic() - revoked_at > 3.0:              # no late transaction after it
                        break
                await asyncio.sleep(0.2)
            waited = time.monotonic() - t_cont
            exited = f"exited {a.exit_codes} after {waited:.0f}s" if a.unplanned_exits else \
                f"still running {waited:.0f}s after SIGCONT"
            fenced = FENCED.search(_logs(a)[seen:])
            revoked = REVOKED.search(_logs(a)[seen:])
            f.extra["zombie after SIGCONT"] = (f"fenced ({fenced.group(0)}), {exited}" if fenced else
                                               f"no late transaction: its partitions revoked first ({revoked.group(0)}),"
                                               f" {exited}" if revoked else f"neither fenced nor revoked, {exited}")
            if not (fenced or revoked):
                f.failures.append("the zombie resumed without its late transaction being fenced or its partitions revoked")
            if a.unplanned_exits:
                await a.wait_ready(timeout)           # the restarted A rejoins; the final drain is its
            await pl.settle(timeout)
            f.extra["worker B exit"] = await b.terminate(120)
            if f.extra["worker B exit"] != 0:
                f.failures.append(f"worker B's drain exited {f.extra['worker B exit']}")
            return await pl.finish()
        finally:
            await b.close()


async def run_same_host(broker: Broker, *, scenes: int = 40, guarantee: str = "exactly_once",
                        work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                        timeout: float = 600.0, reasoning_tokens: int = 4, batch_size: int = 2) -> Figures:
    work = _work_dir(work, "same-host")
    async with Pipeline(broker, scenario="same-host", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, reasoning_tokens=reasoning_tokens, batch_size=batch_size,
                        worker_extra=dict(DEFAULT_IDENTITY)) as pl:
        f = pl.fig
        b = second_worker(pl, "worker-b")
        try:
            pl.start_sink()
            await _start_both(pl, b, timeout)
            await pl.publish(0, scenes)
            await pl.settle(timeout)
            served = [metric_sum(w.ready_url(), "alpamayo_results_total{") if w.alive else 0.0
                      for w in (pl.worker, b)]
            f.extra["results per worker"] = [int(x) for x in served]
            if not all(served):
                f.failures.append(f"not both workers served: results per worker {served}")
            f.extra["worker B exit"] = await b.terminate(120)
            fig = await pl.finish()
            for w in (pl.worker, b):
                if FENCED.search(_logs(w)):
                    fig.failures.append(f"{w.name} logged a fencing error")
            exits = pl.worker.unplanned_exits + b.unplanned_exits
            fig.unplanned_exits = exits
            if exits:
                fig.failures.append(f"{exits} unplanned worker exit(s)")
            if f.extra["worker B exit"] != 0:
                fig.failures.append(f"worker B's drain exited {f.extra['worker B exit']}")
            return fig
        finally:
            await b.close()
