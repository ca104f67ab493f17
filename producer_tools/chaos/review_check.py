"""The review topic in a chaos run: created beside the run's topics, and checked at the end.

The worker publishes a result whose uncertainty reaches ``ALPAMAYO_REVIEW_THRESHOLD`` to the
review topic too, in the result's transaction (exactly_once) or acknowledged before the offset
commit (at_least_once). At the end of the run the review topic is read to its end
(read_committed) and compared with the lake: the expected request ids are the lake's results
whose uncertainty, recomputed from their samples (``worker.uncertainty``), reaches the threshold.
*review lost* = expected ids without a review record, *review unexpected* = review records of
other ids, *review duplicated* = review records beyond the first per id (0 under exactly_once).
"""

from __future__ import annotations

from collections import Counter

from aiokafka import TopicPartition

import schemas as S
from producer_tools.chaos.broker import Broker, Topics, _consumer
from producer_tools.chaos.figures import Figures
from producer_tools.lake import read_lake
from producer_tools.topics import create_topics, plan_topics
from worker.uncertainty import uncertainty_block

__all__ = ["review_topic", "create_review_topic", "check_review_topic"]

_COLUMNS = ["request_id", "pred_trajectories", "uncertainty_checker_disagreement_m", "meta_actions", "auto_labels"]


def review_topic(topics: Topics) -> str:
    return topics.res.rsplit(".", 1)[0] + ".review"


async def create_review_topic(broker: Broker, topics: Topics, replication_factor: int = 1) -> str:
    """The review topic, planned like the results topic (same partitions and configs)."""
    name = review_topic(topics)
    kafka = broker.options(topics.req, name, topics.dl)
    plans = [p for p in plan_topics(kafka, partitions=topics.partitions, replication_factor=replication_factor,
                                    max_message_bytes=2 << 20) if p["role"] == "results"]
    await create_topics(kafka, plans, timeout_s=60)
    return name


async def _review_ids(broker: Broker, topic: str, partitions: int) -> Counter:
    c = await _consumer(broker, isolation_level="read_committed")
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends, ids = await c.end_offsets(tps), Counter()
        while any([await c.position(tp) < ends[tp] for tp in tps]):
            for recs in (await c.getmany(timeout_ms=500)).values():
                ids.update(S.decode_result(r.value, r.headers).request_id for r in recs)
        return ids
    finally:
        await c.stop()


async def check_review_topic(broker: Broker, topics: Topics, lake: str, threshold: float, fig: Figures) -> None:
    """Review figures into ``fig.extra`` and failures into ``fig.failures``."""
    ids = await _review_ids(broker, review_topic(topics), topics.partitions)
    rows = read_lake(lake, "results", columns=_COLUMNS, dedupe=True).to_pylist()
    expected = set()
    for r in rows:
        block = uncertainty_block(r["pred_trajectories"], r["meta_actions"], r["auto_labels"],
                                  r.get("uncertainty_checker_disagreement_m"))
        if block is not None and block["uncertainty"] >= threshold:
            expected.add(r["request_id"])
    lost, unexpected = expected - set(ids), set(ids) - expected
    duplicated = sum(c - 1 for c in ids.values() if c > 1)
    fig.extra["review"] = (f"{sum(ids.values())} records for {len(expected)} of {len(rows)} results at or above "
                           f"{threshold:g}; lost {len(lost)}, duplicated {duplicated}, unexpected {len(unexpected)}")
    fig.extra["_review"] = {"expected": len(expected), "records": sum(ids.values()), "lost": len(lost),
                            "duplicated": duplicated, "unexpected": len(unexpected)}
    if lost or unexpected:
        fig.failures.append(f"review topic: {len(lost)} doubtful results missing (e.g. {sorted(lost)[:3]}), "
                            f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:3]})")
    if duplicated and fig.guarantee == "exactly_once":
        fig.failures.append(f"review topic: {duplicated} duplicated records under exactly_once")
