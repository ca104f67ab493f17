"""Startup refusals: a configuration, checkpoint or DFlash2 head the worker will not run with.

Every refusal derives from :class:`Refusal`; the entry points print the first line of its
message and exit 2 before anything is fetched. The raisers (``worker.config``,
``worker.model.config``, ``worker.dflash.head``, ``worker.kafka_clients``) all import it from
here, so the service recognises a refusal with ``isinstance``.
"""

from __future__ import annotations

__all__ = ["Refusal"]


class Refusal(Exception):
    """A startup refusal; its message says, in one line, what is wrong and what to change."""

    def line(self) -> str:
        """The message's first line (what a command prints when it refuses)."""
        return str(self).splitlines()[0] if str(self) else type(self).__name__
