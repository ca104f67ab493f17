"""Broker faults mid-run (``python -m producer_tools.chaos broker-restart|leader-kill``).

Each test starts its own local Kafka (it stops and starts brokers; the session's shared broker
is left alone):

* a single-node broker stopped mid-run and started again a few seconds later;
* a 3-broker KRaft cluster on loopback (topics with replication factor 3, min.insync.replicas 2):
  the leader of request partition 0 is SIGKILLed mid-run, the second half of the scenes is
  published while it is down, and it comes back later.

In both, the worker (exactly_once: transactions across the fault) and the sink must carry on by
themselves - no restart of either, no manual step - and the audit must find nothing lost and
nothing duplicated. Longer versions are opt-in (``ALPAMAYO_LONG_TESTS=1`` or the CLI).
"""

from __future__ import annotations

import os

import pytest

from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import Figures, format_table
from producer_tools.chaos.pipeline import partition_repairs
from producer_tools.chaos.scenarios import run_broker_restart, run_leader_kill

pytestmark = pytest.mark.kafka
LONG = os.environ.get("ALPAMAYO_LONG_TESTS") == "1"


def assert_rode_through(fig: Figures, scenes: int) -> None:
    print("\n" + format_table([fig]))
    assert fig.broker_faults == 1 and fig.broker_restarts == 1
    assert fig.published == scenes and fig.lost == 0 and fig.answered == scenes
    assert fig.lake_duplicates == 0
    if fig.guarantee == "exactly_once":
        assert fig.duplicated == 0
    assert fig.unplanned_exits == 0 and fig.worker_restarts == 0, "the worker gave up during the fault"
    assert fig.extra["sink unplanned exits"] == 0 and fig.sink_restarts == 0, "the sink gave up during the fault"
    assert fig.extra["audit"].startswith("COMPLETE")
    assert fig.final_exit_code == 0 and fig.sink_exit_code == 0
    assert fig.ok, fig.failures


def test_the_figures_name_the_partition_repairs_of_the_worker_logs(tmp_path):
    """A run that rode through because the worker repaired a partition itself says so."""
    repair = ("failed transaction on req:0 (KafkaError: Unexpected error during batch delivery): "
              "re-opening the partition")
    (tmp_path / "worker-1.log").write_text("2026-12-02 04:10:00,000 INFO alpamayo.worker: assigned ['req:0']\n"
                                           f"2026-12-02 04:10:05,000 WARNING alpamayo.worker: {repair}\n")
    assert partition_repairs([tmp_path / "worker-1.log", tmp_path / "worker-2.log"]) == [repair]


async def test_single_broker_restart_mid_run(tmp_path):
    broker = await Broker.start_local(f"pytest-chaos-restart-{os.getpid()}", nodes=1)
    try:
        fig = await run_broker_restart(broker, scenes=60, guarantee="exactly_once", down_s=3.0, work=tmp_path,
                                       timeout=300)
    finally:
        await broker.close()
    assert_rode_through(fig, 60)


@pytest.mark.multinode
async def test_leader_of_a_request_partition_killed_mid_run_on_three_brokers(tmp_path):
    if os.environ.get("ALPAMAYO_SKIP_MULTINODE") == "1":
        pytest.skip("ALPAMAYO_SKIP_MULTINODE=1")
    broker = await Broker.start_local(f"pytest-chaos-3node-{os.getpid()}", nodes=3)
    try:
        fig = await run_leader_kill(broker, scenes=60, guarantee="exactly_once", down_s=8.0, work=tmp_path,
                                    timeout=300)
    finally:
        await broker.close()
    assert "SIGKILLed" in fig.extra["broker fault"]
    assert_rode_through(fig, 60)


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long broker-fault runs: ALPAMAYO_LONG_TESTS=1")
@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
async def test_long_broker_faults(guarantee, tmp_path):
    one = await Broker.start_local(f"pytest-chaos-restart-long-{os.getpid()}", nodes=1)
    try:
        fig = await run_broker_restart(one, scenes=300, guarantee=guarantee, down_s=20.0, hard=True,
                                       work=tmp_path / "restart", timeout=900)
    finally:
        await one.close()
    assert_rode_through(fig, 300)
    three = await Broker.start_local(f"pytest-chaos-3node-long-{os.getpid()}", nodes=3)
    try:
        fig = await run_leader_kill(three, scenes=300, guarantee=guarantee, down_s=30.0, work=tmp_path / "leader",
                                    timeout=900)
    finally:
        await three.close()
    assert_rode_through(fig, 300)
