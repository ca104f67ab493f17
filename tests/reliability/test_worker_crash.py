"""Crash harness (``python -m producer_tools.chaos crash``) against the session's real Kafka.

A run of scenes through a ``python -m worker serve`` subprocess (tiny random checkpoint on CPU,
reasoning capped at 4 tokens) while the worker is SIGKILLed at random moments mid-run and
restarted (same static member id, so exactly_once fences the zombie's transaction); the sink
subprocess lands the outputs in a Parquet lake and ``audit`` reconciles the run manifest with it:

* exactly_once: every published request has exactly one result or dead letter in the lake;
* at_least_once: every published request has at least one; the raw duplicate count (the same
  request answered twice after a re-delivery) is reported;
* never a Kafka record twice in the lake, the final SIGTERM drains (exit 0).

Short runs here (60 scenes, 3 kills, both guarantees); the full run (1,000 scenes, 10 worker
kills + 2 sink kills) is opt-in: ``ALPAMAYO_LONG_TESTS=1`` or the CLI.
"""

from __future__ import annotations

import os
import random

import pytest

from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import Figures, format_table
from producer_tools.chaos.pipeline import GUARANTEES, _thresholds
from producer_tools.chaos.scenarios import run_crash

LONG = os.environ.get("ALPAMAYO_LONG_TESTS") == "1"


# --------------------------------------------------------------------------------------------
# the harness's own verdicts (no Kafka): a loss or a duplicate can never pass
# --------------------------------------------------------------------------------------------


def _clean(**kw) -> Figures:
    base = dict(scenario="crash", guarantee="exactly_once", published=10, results=10, answered=10,
                worker_kills=3, kills_requested=3, final_exit_code=0, sink_exit_code=0)
    base.update(kw)
    return Figures(**base)


def test_figures_check_fails_on_each_broken_guarantee():
    assert _clean().check().ok
    assert not _clean(lost=1).check().ok
    assert not _clean(lake_duplicates=1).check().ok
    assert not _clean(duplicated=1).check().ok                                # exactly_once
    assert _clean(guarantee="at_least_once", duplicated=2, results=12).check().ok
    assert not _clean(worker_kills=2).check().ok                              # a kill that did not land
    assert not _clean(final_exit_code=1).check().ok                           # the drain failed
    assert not _clean(sink_exit_code=-9).check().ok
    assert not _clean(duplicated_after_dedup=1, guarantee="at_least_once").check().ok


def test_kill_points_are_spread_over_the_run():
    rng = random.Random(3)
    for total, n in [(60, 3), (1000, 10), (100, 1)]:
        pts = _thresholds(total, n, rng, hi=0.75)
        assert len(pts) == n and pts == sorted(pts)
        assert all(0.05 * total <= p <= 0.75 * total for p in pts)
        assert len(set(pts)) == n
    assert _thresholds(60, 0, rng) == []


def test_table_has_the_figures_the_issue_asks_for():
    text = format_table([_clean(guarantee="at_least_once", duplicated=1, results=11)])
    head = text.splitlines()[0]
    for col in ("published", "results", "dead letters", "lost", "duplicated", "kills", "restarts"):
        assert f" {col} " in head, col


# --------------------------------------------------------------------------------------------
# the short crash runs
# --------------------------------------------------------------------------------------------


def assert_crash_figures(fig: Figures, scenes: int, kills: int, sink_kills: int = 0) -> None:
    print("\n" + format_table([fig]))
    assert fig.published == scenes
    assert fig.worker_kills == kills and fig.sink_kills == sink_kills, "every kill lands mid-run"
    assert fig.worker_restarts == kills and fig.unplanned_exits == 0
    assert fig.lost == 0 and fig.answered == scenes, fig.extra.get("lost ids (sample)")
    assert fig.lake_duplicates == 0
    assert fig.results + fig.dead_letters == scenes + fig.duplicated
    assert fig.dead_letters == 0                                   # valid scenes: results only
    if fig.guarantee == "exactly_once":
        assert fig.duplicated == 0
    assert fig.extra["audit"].startswith("COMPLETE")
    assert fig.final_exit_code == 0 and fig.sink_exit_code == 0
    assert fig.ok, fig.failures


@pytest.mark.parametrize("guarantee", GUARANTEES)
async def test_worker_sigkilled_three_times_mid_run_loses_nothing(guarantee, kafka_bootstrap, tmp_path):
    """K = 2 requests with a review topic: the doubtful results land there too, none lost or
    duplicated under exactly_once."""
    fig = await run_crash(Broker(kafka_bootstrap), scenes=60, kills=3, guarantee=guarantee, seed=11,
                          work=tmp_path, timeout=300, review_threshold=0.5)
    assert_crash_figures(fig, 60, 3)
    review = fig.extra["_review"]
    assert 0 < review["expected"] < 60 and review["lost"] == review["unexpected"] == 0, fig.extra["review"]
    if guarantee == "exactly_once":
        assert review["duplicated"] == 0 and review["records"] == review["expected"]


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="full crash run: ALPAMAYO_LONG_TESTS=1")
@pytest.mark.parametrize("guarantee", GUARANTEES)
async def test_full_crash_run_1000_scenes_10_kills(guarantee, kafka_bootstrap, tmp_path):
    fig = await run_crash(Broker(kafka_bootstrap), scenes=1000, kills=10, sink_kills=2, guarantee=guarantee,
                          seed=1, work=tmp_path, timeout=1800)
    assert_crash_figures(fig, 1000, 10, 2)
