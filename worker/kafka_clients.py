"""How the worker's Kafka clients are configured: security settings, the startup preflight, the
producer's and consumer's keyword arguments (static membership only when the operator sets an
instance id), and the exactly_once producers, one per assigned input partition
(:class:`PartitionProducers`, see docs/architecture.md "Exactly-once across rebalances").

:func:`security_kwargs` is the one builder of the SASL/SSL settings: the producer tools'
Kafka clients are built with it as well.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaConnectionError, KafkaError, SaslAuthenticationFailed
from aiokafka.helpers import create_ssl_context

from worker.config import DEFAULT_SASL_MECHANISM, ConfigError, Settings

log = logging.getLogger("alpamayo.worker")

OPEN_RETRY_S = 30.0
"""exactly_once: how long a partition's producer is tried again while no broker answers (a restart)."""

__all__ = ["KafkaSecurity", "security_kwargs", "instance_id", "transactional_id", "producer_kwargs",
           "consumer_kwargs", "kafka_preflight", "PartitionProducers"]


class KafkaSecurity(Protocol):
    """The security fields of worker.config.Settings (and of the producer tools' Kafka options)."""

    security_protocol: str
    sasl_mechanism: str | None
    sasl_username: str | None
    sasl_password: str | None
    ssl_cafile: str | Path | None


def security_kwargs(sec: KafkaSecurity) -> dict[str, Any]:
    """Keyword arguments of any aiokafka client (producer, consumer, admin, connection) for the
    configured security protocol: ``security_protocol``, plus ``ssl_context`` (SSL, SASL_SSL)
    and the SASL mechanism and credentials (SASL_*)."""
    kw: dict[str, Any] = {"security_protocol": sec.security_protocol}
    if sec.security_protocol in ("SSL", "SASL_SSL"):
        kw["ssl_context"] = create_ssl_context(cafile=str(sec.ssl_cafile) if sec.ssl_cafile else None)
    if sec.security_protocol.startswith("SASL"):
        kw.update(sasl_mechanism=sec.sasl_mechanism or DEFAULT_SASL_MECHANISM,
                  sasl_plain_username=sec.sasl_username, sasl_plain_password=sec.sasl_password)
    return kw


def instance_id(settings: Settings) -> str | None:
    """The static group member id: ALPAMAYO_GROUP_INSTANCE_ID, else None (dynamic membership).
    Never derived from the host name: two workers on one host (one per GPU) would claim the same
    static member and take each other's partitions."""
    return settings.group_instance_id


def transactional_id(group_id: str, topic: str, partition: int) -> str:
    """exactly_once: the transactional id of input partition ``topic:partition`` of the group. Whoever
    owns the partition next starts a producer of the same id, which fences the previous owner."""
    return f"{group_id}.{topic}.{partition}"


def producer_kwargs(settings: Settings, tp: tuple[str, int] | None = None) -> dict[str, Any]:
    """Idempotent, acks=all; with ``tp`` (exactly_once) transactional with :func:`transactional_id`."""
    kw = dict(bootstrap_servers=settings.bootstrap_servers, client_id=f"alpamayo-{settings.worker_id}", acks="all",
              enable_idempotence=True, linger_ms=5, **security_kwargs(settings))
    if tp is not None:
        kw["transactional_id"] = transactional_id(settings.group_id, *tp)
    return kw


class PartitionProducers:
    """exactly_once: one started transactional producer per assigned input partition.

    :meth:`open` on assignment: starting a producer sends InitProducerId, which bumps the epoch of
    the partition's transactional id - the previous owner's producer (a zombie paused past the
    session timeout) is fenced and its open transaction aborted before the new owner reads the
    committed offset. :meth:`close` on revocation. ``factory``: the producer class (tests)."""

    def __init__(self, settings: Settings, factory=AIOKafkaProducer):
        self.settings = settings
        self.factory = factory
        self._producers: dict[tuple[str, int], Any] = {}

    def for_partition(self, tp: tuple[str, int]):
        return self._producers.get(tp)

    @property
    def partitions(self) -> list[tuple[str, int]]:
        return list(self._producers)

    async def open(self, tps, retry_s: float = OPEN_RETRY_S) -> None:
        """Start the producers of ``tps`` (concurrently); a broker that cannot be reached (a
        restart) is tried again every second for ``retry_s``; raises if one still fails to start."""
        deadline = asyncio.get_running_loop().time() + retry_s
        while True:
            new = [tp for tp in tps if tp not in self._producers]
            producers = {tp: self.factory(**producer_kwargs(self.settings, tp)) for tp in new}
            results = await asyncio.gather(*(p.start() for p in producers.values()), return_exceptions=True)
            failed = None
            for (tp, p), res in zip(producers.items(), results, strict=True):
                if isinstance(res, BaseException):
                    failed = failed or res
                    await _stop_quietly(p)
                else:
                    self._producers[tp] = p
            if failed is None:
                return
            if not isinstance(failed, KafkaConnectionError) or asyncio.get_running_loop().time() >= deadline:
                raise failed
            log.warning("starting the producers of %s: %s; trying again", sorted(new), failed)
            await asyncio.sleep(1.0)

    async def close(self, tps) -> None:
        """Stop the producers of ``tps`` (an open transaction of theirs is aborted)."""
        await asyncio.gather(*(_stop_quietly(self._producers.pop(tp)) for tp in tps if tp in self._producers))

    async def close_all(self) -> None:
        await self.close(list(self._producers))


async def _stop_quietly(producer, timeout: float = 15.0) -> None:
    try:
        await asyncio.wait_for(producer.stop(), timeout)
    except Exception:  # closing is best effort: the next owner's InitProducerId fences it anyway
        pass


def consumer_kwargs(settings: Settings, revoke_timeout_s: float) -> dict[str, Any]:
    """Manual commits, static membership when an instance id is set, read_committed; fetches sized
    to the largest accepted request; a rebalance timeout that leaves a revoke ``revoke_timeout_s``
    to finish its batch."""
    s = settings
    return dict(
        bootstrap_servers=s.bootstrap_servers, group_id=s.group_id, group_instance_id=instance_id(s),
        client_id=f"alpamayo-{s.worker_id}", enable_auto_commit=False, auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_partition_fetch_bytes=max(1 << 20, min(s.max_request_bytes + (64 << 10), 128 << 20)),
        rebalance_timeout_ms=int((revoke_timeout_s + 30) * 1000), **security_kwargs(s))


async def kafka_preflight(settings: Settings, timeout: float = 20.0, *, client_id: str | None = None,
                          address_names: str = "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS") -> None:
    """Open one connection to a bootstrap server with the configured security, before minutes of
    model loading. Refused credentials or an untrusted broker certificate raise ConfigError (one
    line, exit 2) at once. No reachable broker: retry for ALPAMAYO_KAFKA_WAIT_S (a line "waiting
    for Kafka at ..." every 5 s), then ConfigError naming ``address_names`` (the producer tools
    name their --bootstrap-servers flag too)."""
    sec = security_kwargs(settings)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.kafka_wait_s
    next_note = loop.time() + 5.0
    last = ""
    while True:
        for hostport in settings.bootstrap_servers.split(","):
            host, _, port = hostport.strip().rpartition(":")
            try:
                conn = await asyncio.wait_for(create_conn(
                    host, int(port), client_id=client_id or f"alpamayo-{settings.worker_id}-preflight",
                    request_timeout_ms=int(timeout * 1000), security_protocol=sec["security_protocol"],
                    ssl_context=sec.get("ssl_context"), sasl_mechanism=sec.get("sasl_mechanism"),
                    sasl_plain_username=sec.get("sasl_plain_username"),
                    sasl_plain_password=sec.get("sasl_plain_password")), timeout)
            except SaslAuthenticationFailed:
                raise ConfigError(
                    f"Kafka at {hostport} refused the credentials of user {settings.sasl_username!r} "
                    f"({settings.sasl_mechanism}): check ALPAMAYO_KAFKA_SASL_USERNAME and ALPAMAYO_KAFKA_SASL_PASSWORD"
                ) from None
            except ssl.SSLCertVerificationError as exc:
                raise ConfigError(
                    f"Kafka at {hostport}: the broker certificate is not trusted ({exc.verify_message}): set "
                    "ALPAMAYO_KAFKA_SSL_CAFILE to the CA certificate (PEM) that signed it") from None
            except (OSError, KafkaError, asyncio.TimeoutError, ssl.SSLError) as exc:
                if settings.security_protocol == "PLAINTEXT" and "closed" in str(exc):
                    raise ConfigError(
                        f"Kafka at {hostport} closed a PLAINTEXT connection at once: the listener probably needs "
                        "TLS/SASL (set ALPAMAYO_KAFKA_SECURITY_PROTOCOL)") from None
                last = f"{hostport}: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                continue                       # unreachable: try the next one
            conn.close()
            return
        if loop.time() >= deadline:
            raise ConfigError(
                f"no Kafka broker answered at {settings.bootstrap_servers} within {settings.kafka_wait_s:g} s "
                f"({last}): check {address_names}, or set ALPAMAYO_KAFKA_WAIT_S to wait longer")
        if loop.time() >= next_note:
            log.warning("waiting for Kafka at %s (%s)", settings.bootstrap_servers, last)
            next_note = loop.time() + 5.0
        await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
