"""``alpamayo-producer dlq list`` / ``dlq replay``: what was dead-lettered, by code; re-publish
selected dead letters after a fix.

``dlq list`` prints one row per error code: how many, whether the code is retryable, how many of
them the replay ledger says were replayed, and one sample message.

Dead letters come from the lake (``--lake DIR``, the ``dead_letters`` table the sink writes) or
straight from the dead-letter topic (``--from-topic``; read from the beginning up to the end
offsets seen at start, ``read_committed``). Selection: ``--code`` (repeatable),
``--run-id``, ``--request-id`` (repeatable), ``--retryable-only``, ``--limit``.

Each selected dead letter's ORIGINAL request bytes (``original_value``) are sent unchanged to the
request topic with the original key and headers, plus lineage headers:

* ``replay-of``: ``topic:partition:offset`` of the dead-letter record (the contract's
  ``Lineage.replay_of``),
* ``replay-of-key``: the dead letter's Kafka key (request id, or the source coordinates),
* ``attempt``: the dead letter's ``attempt + 1``.

Dead letters whose original was cut to fit the dead-letter topic (a truncated value, or the
``alpamayo-truncated`` marker the worker appends to cut key/headers) cannot be replayed and are
reported. Replays are
recorded in ``<runs-dir>/dlq-replays.jsonl`` and not repeated unless ``--force``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

import schemas as S
from producer_tools.common import KafkaOptions, ToolError, client_kwargs

__all__ = ["HEADER_REPLAY_OF", "HEADER_REPLAY_OF_KEY", "HEADER_ATTEMPT", "DeadLetterItem", "from_lake",
           "from_topic", "select", "replay_headers", "replay", "by_code", "format_by_code"]

HEADER_REPLAY_OF = S.HEADER_REPLAY_OF
HEADER_REPLAY_OF_KEY = "replay-of-key"
HEADER_ATTEMPT = S.HEADER_ATTEMPT
_LINEAGE_HEADERS = {HEADER_REPLAY_OF, HEADER_REPLAY_OF_KEY, HEADER_ATTEMPT}


@dataclass
class DeadLetterItem:
    coords: str                      # topic:partition:offset of the dead-letter record
    key: bytes | None                # the dead letter's Kafka key
    request_id: str | None
    run_id: str | None
    error_code: str | None
    attempt: int
    original_value: bytes
    truncated: bool
    original_key: bytes | None
    original_headers: list[tuple[str, bytes]]
    error_message: str | None = None

    @property
    def retryable(self) -> bool:
        try:
            return S.ErrorCode(self.error_code).retryable
        except ValueError:
            return False


def _item_from_dl(dl: S.DeadLetter, coords: str, key: bytes | None) -> DeadLetterItem:
    return DeadLetterItem(coords=coords, key=key, request_id=dl.request_id, run_id=dl.run_id,
                          error_code=dl.error_code.value, attempt=dl.attempt, original_value=dl.original_value,
                          truncated=dl.original_cut, original_key=dl.original_key,
                          original_headers=list(dl.original_headers), error_message=dl.error_message)


def from_lake(lake: str, run_id: str | None = None) -> list[DeadLetterItem]:
    from producer_tools.lake import read_lake  # pyarrow: heavy, only the --lake source needs it

    rows = read_lake(lake, "dead_letters", run_id=run_id).to_pylist()
    out = []
    for r in rows:
        if r.get("decode_error") and r.get("original_value") is None:
            continue
        headers = [(h["key"], h["value"] or b"") for h in (r.get("original_headers") or [])]
        out.append(DeadLetterItem(
            coords=f"{r['kafka_topic']}:{r['kafka_partition']}:{r['kafka_offset']}", key=r.get("kafka_key"),
            request_id=r.get("request_id"), run_id=r.get("run_id"), error_code=r.get("error_code"),
            attempt=int(r.get("attempt") or 1), original_value=r.get("original_value") or b"",
            truncated=bool(r.get("original_value_truncated")) or any(k == S.TRUNCATION_HEADER for k, _ in headers),
            original_key=r.get("original_key"), original_headers=headers, error_message=r.get("error_message")))
    out.sort(key=lambda d: d.coords)
    return out


async def _partitions(kafka: KafkaOptions, topic: str) -> list[int]:
    admin = AIOKafkaAdminClient(**client_kwargs(kafka))
    await admin.start()
    try:
        if topic not in await admin.list_topics():
            raise ToolError(f"topic {topic} does not exist")
        meta = await admin.describe_topics([topic])
    finally:
        await admin.close()
    parts = sorted(p["partition"] for p in meta[0].get("partitions", []))
    if not parts:
        raise ToolError(f"topic {topic} has no partitions")
    return parts


async def from_topic(kafka: KafkaOptions, topic: str | None = None, timeout_s: float = 60.0) -> list[DeadLetterItem]:
    """Every decodable dead letter on the topic, up to the end offsets at start."""
    topic = topic or kafka.dead_letter_topic
    consumer = AIOKafkaConsumer(**client_kwargs(kafka), group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed", max_partition_fetch_bytes=32 << 20)
    out: list[DeadLetterItem] = []
    try:
        await consumer.start()
        parts = await _partitions(kafka, topic)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        remaining = {tp for tp in tps if ends[tp] > await consumer.position(tp)}
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise ToolError(f"reading {topic} did not reach the end offsets within {timeout_s}s")
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset >= ends[tp]:
                        continue
                    try:
                        dl = S.decode_dead_letter(rec.value, list(rec.headers or ()))
                    except S.ContractError:
                        continue
                    out.append(_item_from_dl(dl, f"{rec.topic}:{rec.partition}:{rec.offset}", rec.key))
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()
    return out


def select(items: Iterable[DeadLetterItem], codes: Sequence[str] = (), run_ids: Sequence[str] = (),
           request_ids: Sequence[str] = (), retryable_only: bool = False, limit: int | None = None
           ) -> list[DeadLetterItem]:
    out = []
    for d in items:
        if codes and d.error_code not in codes:
            continue
        if run_ids and d.run_id not in run_ids:
            continue
        if request_ids and d.request_id not in request_ids:
            continue
        if retryable_only and not d.retryable:
            continue
        out.append(d)
        if limit is not None and len(out) >= limit:
            break
    return out


def replay_headers(d: DeadLetterItem) -> list[tuple[str, bytes]]:
    """Original headers (minus earlier lineage headers) + replay-of, replay-of-key, attempt."""
    hs = [(k, v) for k, v in d.original_headers if k.lower() not in _LINEAGE_HEADERS]
    hs.append((HEADER_REPLAY_OF, d.coords.encode()))
    if d.key is not None:
        hs.append((HEADER_REPLAY_OF_KEY, bytes(d.key)))
    hs.append((HEADER_ATTEMPT, str(d.attempt + 1).encode()))
    return hs


def _ledger_path(runs_dir: str) -> Path:
    return Path(runs_dir) / "dlq-replays.jsonl"


def _replayed(runs_dir: str) -> set[str]:
    p = _ledger_path(runs_dir)
    done = set()
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                done.add(json.loads(line)["dead_letter"])
            except (ValueError, KeyError):
                continue
    return done


def by_code(items: Iterable[DeadLetterItem], runs_dir: str = "runs") -> list[dict[str, Any]]:
    """One row per error code (most frequent first): code, count, retryable, replayed (per the
    replay ledger in ``runs_dir``), a sample message."""
    done = _replayed(runs_dir)
    rows: dict[str, dict[str, Any]] = {}
    for d in items:
        code = d.error_code or "unknown"
        row = rows.setdefault(code, {"code": code, "count": 0, "retryable": d.retryable, "replayed": 0,
                                     "sample": d.error_message or ""})
        row["count"] += 1
        row["replayed"] += d.coords in done
        row["sample"] = row["sample"] or d.error_message or ""
    return sorted(rows.values(), key=lambda r: (-r["count"], r["code"]))


def format_by_code(rows: Sequence[dict[str, Any]], width: int = 72) -> str:
    head = ("code", "count", "retryable", "replayed", "sample message")
    cells = [head] + [(r["code"], str(r["count"]), "yes" if r["retryable"] else "no", str(r["replayed"]),
                       r["sample"] if len(r["sample"]) <= width else r["sample"][: width - 3] + "...") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4] for c in cells]
    total = sum(r["count"] for r in rows)
    return "\n".join([lines[0].rstrip(), *lines[1:], f"{total} dead letters, {len(rows)} codes"])


async def replay(kafka: KafkaOptions, items: Sequence[DeadLetterItem], *, to_topic: str | None = None,
                 runs_dir: str = "runs", force: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """Re-publish the dead letters' original bytes; returns a summary."""
    topic = to_topic or kafka.request_topic
    done = set() if force else _replayed(runs_dir)
    summary: dict[str, Any] = {"topic": topic, "selected": len(items), "replayed": 0, "already_replayed": 0,
                               "truncated": [], "dry_run": dry_run, "records": []}
    todo = []
    for d in items:
        if d.truncated:
            summary["truncated"].append(d.coords)
        elif d.coords in done:
            summary["already_replayed"] += 1
        elif not d.original_value:
            summary["truncated"].append(d.coords)
        else:
            todo.append(d)
    if dry_run or not todo:
        summary["records"] = [{"dead_letter": d.coords, "request_id": d.request_id, "code": d.error_code,
                               "attempt": d.attempt + 1} for d in todo]
        return summary
    producer = AIOKafkaProducer(**client_kwargs(kafka), acks="all", enable_idempotence=True,
                                max_request_size=max(1 << 20, max(len(d.original_value) for d in todo) + (64 << 10)))
    ledger = _ledger_path(runs_dir)
    ledger.parent.mkdir(parents=True, exist_ok=True)
    await producer.start()
    try:
        with open(ledger, "a", encoding="utf-8") as f:
            for d in todo:
                key = d.original_key if d.original_key is not None else (
                    d.request_id.encode() if d.request_id else None)
                md = await producer.send_and_wait(topic, d.original_value, key=key, headers=replay_headers(d))
                rec = {"dead_letter": d.coords, "request_id": d.request_id, "code": d.error_code,
                       "attempt": d.attempt + 1, "topic": md.topic, "partition": md.partition,
                       "offset": md.offset, "ts": time.time()}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                summary["records"].append(rec)
                summary["replayed"] += 1
    finally:
        await producer.stop()
    return summary
