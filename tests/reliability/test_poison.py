"""Poison pills (``python -m producer_tools.chaos poison``) through a real worker on the session's
Kafka: oversized keys and headers and values at the limits each end as the result or dead letter
their kind allows, nothing is lost and the worker stays up. Short run here (one request of each
kind); ``--scenes 40`` and more with the CLI."""

from __future__ import annotations

from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import format_table
from producer_tools.chaos.poison import KINDS, run_poison


async def test_poison_one_of_each_kind_through_a_real_worker(kafka_bootstrap, tmp_path):
    fig = await run_poison(Broker(kafka_bootstrap), scenes=len(KINDS), work=tmp_path, timeout=300)
    print("\n" + format_table([fig]))
    assert fig.published == len(KINDS) and fig.lost == 0 and fig.duplicated == 0
    assert fig.extra["_wrong"] == []
    assert fig.results == list(KINDS.values()).count("result")
    assert fig.unplanned_exits == 0 and fig.worker_restarts == 0 and fig.final_exit_code == 0
    assert fig.ok, fig.failures
