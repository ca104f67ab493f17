"""How large an output record may be, and how a dead letter is cut to fit.

The worker reads the limits once at startup (:func:`read_output_limits`): ``max.message.bytes``
of the result and dead-letter topics (admin ``describe_configs``; a topic without an override
reports the broker's default) and the producer's ``max_request_size``. An output fits when
aiokafka's own size estimate of its record (batch header + record overhead + key + value +
headers: what the producer checks, and an upper bound of the batch the broker checks) is within
the smaller of the two.

A result that does not fit becomes an ``oversize`` dead letter (no new error code: see the
versioning rules in docs/contract.md). A dead letter that does not fit is cut by
:func:`fit_dead_letter`: header names and values and the key are kept as short prefixes, headers
beyond a budget are dropped, a ``alpamayo-truncated`` header is appended to ``original_headers``
as the marker (it survives the lake, whose table has no column for it), and the value keeps the
prefix that still fits. A cut dead letter cannot be replayed (``dlq replay`` refuses it).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from schemas import (CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK, TRUNCATION_HEADER, ContractError, DeadLetter, ErrorCode,
                     dead_letter_key, encode_dead_letter)

__all__ = ["OutputLimits", "record_size", "producer_max_request_size", "read_output_limits", "check_result_fits",
           "fit_dead_letter",
           "BROKER_DEFAULT_MESSAGE_BYTES", "KEPT_KEY_BYTES", "KEPT_HEADER_BYTES",
           "KEPT_HEADER_NAME_CHARS"]

log = logging.getLogger("alpamayo.output_limits")

BROKER_DEFAULT_MESSAGE_BYTES = 1_048_588
"""Kafka's default ``message.max.bytes``: the limit assumed when a topic's config cannot be read."""
KEPT_KEY_BYTES = 1024
"""The prefix of an original key kept when a dead letter is cut."""
KEPT_HEADER_BYTES = 1024
"""The prefix of each original header value kept when a dead letter is cut."""
KEPT_HEADER_NAME_CHARS = 256
"""The prefix of each original header name kept when a dead letter is cut."""
_HEADERS_SHARE = 8
"""A cut dead letter keeps headers up to 1/8 of the record limit (the value gets the rest)."""


@dataclass(frozen=True)
class OutputLimits:
    """Largest record (aiokafka's estimate, :func:`record_size`) per output topic."""

    result_bytes: int
    dead_letter_bytes: int


def record_size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Upper bound of the record's size in its own batch, as the producer computes it."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)


def producer_max_request_size(producer_kw: dict) -> int:
    """``max_request_size`` of a producer built with these keyword arguments (aiokafka's default
    when they leave it out)."""
    default = inspect.signature(AIOKafkaProducer.__init__).parameters["max_request_size"].default
    return int(producer_kw.get("max_request_size", default))


async def read_output_limits(client_kw: dict, result_topic: str, dead_letter_topic: str,
                             max_request_size: int, review_topic: str | None = None) -> OutputLimits:
    """``min(max.message.bytes of the topic, max_request_size)`` per output topic; a result must
    also fit the review topic when there is one. A topic whose config cannot be read (not created
    yet, no DescribeConfigs ACL) gets the broker default, with a warning."""
    topics = (result_topic, dead_letter_topic) + ((review_topic,) if review_topic else ())
    found: dict[str, int] = {}
    admin = AIOKafkaAdminClient(**client_kw)
    try:
        await admin.start()
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])
        for resp in responses:
            for res in resp.resources:
                error_code, name, entries = res[0], res[3], res[4]
                value = {e[0]: e[1] for e in entries}.get("max.message.bytes")
                if error_code == 0 and value is not None:
                    found[name] = int(value)
    except Exception as exc:  # the limits are a safeguard: fall back rather than refuse to start
        log.warning("reading max.message.bytes of %s failed (%s: %s)", topics, type(exc).__name__, exc)
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
    for t in topics:
        if t not in found:
            log.warning("max.message.bytes of %s unknown: assuming the broker default %d", t,
                        BROKER_DEFAULT_MESSAGE_BYTES)
    limit = {t: min(found.get(t, BROKER_DEFAULT_MESSAGE_BYTES), max_request_size) for t in topics}
    limits = OutputLimits(min(limit[result_topic], limit.get(review_topic, limit[result_topic])),
                          limit[dead_letter_topic])
    log.info("output record limits: results %d bytes, dead letters %d bytes", limits.result_bytes,
             limits.dead_letter_bytes)
    return limits


def check_result_fits(key: bytes, value: bytes, headers: list[tuple[str, bytes]], max_bytes: int) -> None:
    """Raises an ``oversize`` ContractError (the result becomes a dead letter) when the result's
    record exceeds ``max_bytes``."""
    size = record_size(key, value, headers)
    if size > max_bytes:
        raise ContractError(ErrorCode.OVERSIZE, "$", f"the result is {size} bytes as a Kafka record, above the "
                            f"{max_bytes}-byte limit of the results topic and producer")


def _encoded_size(dl: DeadLetter, content_type: str) -> tuple[int, bytes, list[tuple[str, bytes]]]:
    value, headers = encode_dead_letter(dl, content_type)
    return record_size(dead_letter_key(dl), value, headers), value, headers


def fit_dead_letter(dl: DeadLetter, max_bytes: int, content_type: str = CONTENT_TYPE_MSGPACK
                    ) -> tuple[DeadLetter, bytes, list[tuple[str, bytes]]]:
    """(the dead letter, its encoded value, its headers), cut so that its record fits ``max_bytes``
    once encoded as ``content_type`` (JSON carries the bytes as base64: 4 characters per 3 bytes).
    Unchanged when it fits already. Raises ValueError when even the cut one does not fit (a limit
    smaller than the dead letter's own fields)."""
    if len(dl.original_value) < max_bytes:     # (a larger value cannot fit: skip encoding it whole)
        size, value, headers = _encoded_size(dl, content_type)
        if size <= max_bytes:
            return dl, value, headers
    cut: list[str] = []
    key = dl.original_key
    if key is not None and len(key) > KEPT_KEY_BYTES:
        cut.append(f"key={len(key)}")
        key = key[:KEPT_KEY_BYTES]
    kept: list[tuple[str, bytes]] = []
    budget = max_bytes // _HEADERS_SHARE
    total = sum(len(k.encode()) + len(v) for k, v in dl.original_headers)
    for name, val in dl.original_headers:
        short = (name[:KEPT_HEADER_NAME_CHARS], val[:KEPT_HEADER_BYTES])
        budget -= len(short[0].encode()) + len(short[1]) + 16
        if budget < 0:
            break
        kept.append(short)
    if kept != dl.original_headers:
        cut.append(f"headers={total}")
    marker = [(TRUNCATION_HEADER, ",".join(cut).encode())] if cut else []
    original = dl.original_value
    dl = msgspec.structs.replace(dl, original_key=key, original_headers=kept + marker, original_value=b"",
                                 original_size=dl.original_size if dl.original_size is not None else len(original))
    room = max_bytes - _encoded_size(dl, content_type)[0] - 16      # msgpack's bin length prefix grows with the value
    if room < 0:      # a tiny limit: keep only the marker
        dl = msgspec.structs.replace(dl, original_key=None,
                                     original_headers=[(TRUNCATION_HEADER, f"key={len(dl.original_key or b'')},"
                                                                           f"headers={total}".encode())])
        room = max_bytes - _encoded_size(dl, content_type)[0] - 16
    if content_type == CONTENT_TYPE_JSON:
        room = room * 3 // 4 - 3
    dl = msgspec.structs.replace(dl, original_value=original[:max(0, room)],
                                 original_value_truncated=dl.original_value_truncated or len(original) > room)
    size, value, headers = _encoded_size(dl, content_type)
    if size > max_bytes:
        raise ValueError(f"a dead letter without its original bytes is {size} bytes, above the {max_bytes}-byte "
                         "limit")
    return dl, value, headers
