"""Two workers in one group against the session's real Kafka (``producer_tools.chaos.takeover``).

* ``zombie``: exactly_once worker A is SIGSTOPped holding work past the session timeout, B takes
  its partitions over and answers everything, A resumes: its late transaction is fenced, nothing
  is lost and nothing is duplicated under read_committed.
* ``same-host``: two workers with the default identity (no instance id, as one per GPU on one host)
  both serve, without a fencing error or an exit, and lose nothing.

Short runs here; longer ones: ``python -m producer_tools.chaos zombie|same-host --scenes N``.
"""

from __future__ import annotations

import pytest

from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import format_table
from producer_tools.chaos.takeover import run_same_host, run_zombie


async def test_zombie_paused_past_the_session_timeout_never_publishes_its_late_work(kafka_bootstrap, tmp_path):
    """A resumes with a batch in hand; which comes first after SIGCONT is a race of A's own threads,
    and both endings are safe (the harness's docstring): its late transaction meets B's producers
    and is fenced (A exits 1 and is restarted), or its rebalance callback revokes the partitions and
    the late work is discarded unpublished (A stays up). The fence itself is shown deterministically
    by tests/worker/test_partition_producers.py."""
    fig = await run_zombie(Broker(kafka_bootstrap), scenes=24, work=tmp_path, timeout=240)
    print("\n" + format_table([fig]), fig.extra)
    assert fig.published == 24 and fig.lost == 0 and fig.answered == 24
    assert fig.duplicated == 0 and fig.lake_duplicates == 0
    after = fig.extra["zombie after SIGCONT"]
    if after.startswith("fenced"):
        assert "exited [1]" in after and fig.unplanned_exits == 1, fig.extra    # stopped by itself
    else:
        assert after.startswith("no late transaction: its partitions revoked first"), fig.extra
        assert "still running" in after and fig.unplanned_exits == 0, fig.extra
    assert fig.final_exit_code == 0 and fig.ok, fig.failures


@pytest.mark.parametrize("guarantee", ["exactly_once"])
async def test_two_workers_with_the_default_identity_both_serve(guarantee, kafka_bootstrap, tmp_path):
    fig = await run_same_host(Broker(kafka_bootstrap), scenes=24, guarantee=guarantee, work=tmp_path, timeout=240)
    print("\n" + format_table([fig]), fig.extra)
    assert fig.published == 24 and fig.lost == 0 and fig.answered == 24 and fig.duplicated == 0
    assert all(n > 0 for n in fig.extra["results per worker"]), fig.extra
    assert fig.unplanned_exits == 0 and fig.final_exit_code == 0 and fig.ok, fig.failures
