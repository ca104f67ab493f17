"""The dead-letter message (``alpamayo.dead-letters``): why a request failed, plus its original bytes.

A dead letter keeps the original value, key and headers so that a replay tool can re-publish the
request unchanged (or after a fix), unless it had to be cut to fit the dead-letter topic
(:attr:`DeadLetter.original_cut`). Keyed by ``request_id`` when it could be read, otherwise by
the source coordinates ``topic:partition:offset`` (see :func:`dead_letter_key`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Annotated

import msgspec
from msgspec import Meta

from .errors import ContractError, ErrorCode
from .request import SCHEMA_VERSION

__all__ = ["SourceCoordinates", "DeadLetter", "dead_letter_from_error", "dead_letter_key", "normalize_headers",
           "TRUNCATION_HEADER", "HEADER_REPLAY_OF", "HEADER_ATTEMPT"]

TRUNCATION_HEADER = "alpamayo-truncated"
"""The last of ``original_headers`` when the worker cut the original key or headers to fit the
dead-letter topic; its value says what was cut and the full sizes, e.g. ``key=2000,headers=1200042``."""
HEADER_REPLAY_OF = "replay-of"
"""Request header written by ``dlq replay``: ``topic:partition:offset`` of the dead letter replayed."""
HEADER_ATTEMPT = "attempt"
"""Request header written by ``dlq replay``: the delivery attempt (the dead letter's ``attempt + 1``)."""


class SourceCoordinates(msgspec.Struct, kw_only=True, frozen=True):
    """Kafka coordinates of the failed request record."""

    topic: Annotated[str, Meta(description="Request topic.")]
    partition: Annotated[int, Meta(ge=0, description="Request partition.")]
    offset: Annotated[int, Meta(ge=0, description="Request offset.")]

    def __str__(self) -> str:
        return f"{self.topic}:{self.partition}:{self.offset}"


class DeadLetter(msgspec.Struct, kw_only=True, frozen=True):
    """A request that produced no result."""

    schema_version: Annotated[int, Meta(description="Contract version of this message.")] = SCHEMA_VERSION
    request_id: Annotated[str | None, Meta(description="The request's id when it could be read.")] = None
    run_id: Annotated[str | None, Meta(description="The request's run_id when it could be read.")] = None
    error_code: Annotated[ErrorCode, Meta(description="Stable error code (see the codes table).")]
    error_field: Annotated[str, Meta(description="JSON path of the offending value ('$' = whole message).")] = "$"
    error_message: Annotated[str, Meta(description="One human-readable line.")] = ""
    original_value: Annotated[
        bytes, Meta(description="The request's value bytes (possibly truncated, see below).")
    ] = b""
    original_value_truncated: Annotated[
        bool, Meta(description="True when original_value holds only a prefix of the request.")
    ] = False
    original_size: Annotated[
        Annotated[int, Meta(ge=0)] | None, Meta(description="Length of the full request value.")
    ] = None
    original_key: Annotated[bytes | None, Meta(description="The request's Kafka key.")] = None
    original_headers: Annotated[
        list[tuple[str, bytes]], Meta(description="The request's Kafka headers (null values as b'').")
    ] = []
    source: Annotated[SourceCoordinates, Meta(description="Kafka coordinates of the request.")]
    attempt: Annotated[int, Meta(ge=1, description="Delivery attempt that failed (1 = first).")] = 1
    replay_of: Annotated[
        str | None, Meta(description="'topic:partition:offset' of the dead letter the failed request replayed.")
    ] = None
    worker_id: Annotated[str, Meta(description="Worker that gave up.")]
    failed_at: Annotated[float, Meta(description="Unix seconds of the failure.")]

    @property
    def original_cut(self) -> bool:
        """True when the original value, key or headers were cut: the request cannot be replayed."""
        return self.original_value_truncated or any(k == TRUNCATION_HEADER for k, _ in self.original_headers)

    @property
    def retryable(self) -> bool:
        """Whether the code may be transient (claim check, inference, internal)."""
        return self.error_code.retryable

    def to_error(self) -> ContractError:
        """The :class:`ContractError` this dead letter records."""
        return ContractError(
            self.error_code, self.error_field, self.error_message, request_id=self.request_id, run_id=self.run_id
        )


def normalize_headers(headers: Iterable[tuple[str, bytes | str | None]] | None) -> list[tuple[str, bytes]]:
    """Kafka headers as ``[(str, bytes)]``: None values become b'', str values are utf-8 encoded."""
    out: list[tuple[str, bytes]] = []
    for name, value in headers or ():
        if value is None:
            value = b""
        elif isinstance(value, str):
            value = value.encode("utf-8")
        out.append((str(name), bytes(value)))
    return out


def dead_letter_from_error(
    error: ContractError | BaseException,
    *,
    value: bytes | None,
    key: bytes | None = None,
    headers: Iterable[tuple[str, bytes | None]] | None = None,
    topic: str,
    partition: int,
    offset: int,
    worker_id: str,
    attempt: int = 1,
    replay_of: str | None = None,
    failed_at: float | None = None,
    max_value_bytes: int | None = None,
) -> DeadLetter:
    """Build a :class:`DeadLetter` for a failed record.

    A non-ContractError exception becomes ``internal_error``. ``max_value_bytes`` caps
    ``original_value`` (so the dead letter fits the dead-letter topic's message size); the cap is
    recorded in ``original_value_truncated``/``original_size``.
    """
    if not isinstance(error, ContractError):
        error = ContractError(ErrorCode.INTERNAL_ERROR, "$", f"{type(error).__name__}: {error}"[:2000])
    raw = bytes(value) if value is not None else b""
    truncated = max_value_bytes is not None and len(raw) > max_value_bytes
    return DeadLetter(
        request_id=error.request_id,
        run_id=error.run_id,
        error_code=error.code,
        error_field=error.field,
        error_message=error.message,
        original_value=raw[:max_value_bytes] if truncated else raw,
        original_value_truncated=truncated,
        original_size=len(raw),
        original_key=key,
        original_headers=normalize_headers(headers),
        source=SourceCoordinates(topic=topic, partition=partition, offset=offset),
        attempt=attempt,
        replay_of=replay_of,
        worker_id=worker_id,
        failed_at=time.time() if failed_at is None else failed_at,
    )


def dead_letter_key(dl: DeadLetter) -> bytes:
    """Kafka key of a dead letter: request_id (utf-8) when known, else ``topic:partition:offset``."""
    return (dl.request_id if dl.request_id is not None else str(dl.source)).encode("utf-8")
