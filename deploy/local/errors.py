"""The one exception of the local Kafka: raised by every module of deploy/local."""

from __future__ import annotations


class LocalKafkaError(RuntimeError):
    """The local cluster could not be prepared, started or stopped (message says where to look)."""
