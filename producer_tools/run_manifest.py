"""The local run manifest of ``alpamayo-producer publish``: ``<runs-dir>/<run_id>.jsonl``, one line
per acknowledged request, read back to resume a run and by ``audit``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from producer_tools.common import ToolError, fsync_dir

__all__ = ["RunManifest"]


class RunManifest:
    """``<runs-dir>/<run_id>.jsonl``: a header line, then one line per acknowledged request.

    Lines: ``{"kind": "run", ...}`` (first: run_id, tasks, k, ...), ``{"kind": "session", ...}``
    (each publish invocation, with ``planned``: the requests its source plans for the run, and
    ``resume_command``), ``{"kind": "published", "request_id", "scene_id", "task", "k", "topic",
    "partition", "offset", "bytes", "image_refs", "ts"}``. A torn last line (crash mid-write)
    is ignored on reading.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header: dict | None = None
        self.records: list[dict] = []
        self.sessions: list[dict] = []
        self._f = None
        self._last_sync = 0.0
        if self.path.exists():
            self._load()

    @classmethod
    def for_run(cls, runs_dir: str | os.PathLike, run_id: str) -> "RunManifest":
        return cls(Path(runs_dir) / f"{run_id}.jsonl")

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue  # torn line
                kind = obj.get("kind")
                if kind == "run" and self.header is None:
                    self.header = obj
                elif kind == "published":
                    self.records.append(obj)
                elif kind == "session":
                    self.sessions.append(obj)

    @property
    def exists(self) -> bool:
        return self.header is not None

    @property
    def run_id(self) -> str | None:
        return self.header.get("run_id") if self.header else None

    def _latest(self, key: str):
        return next((s[key] for s in reversed(self.sessions) if s.get(key) is not None), None)

    @property
    def planned(self) -> int | None:
        """Requests the run plans (its latest session's source); None when no session knew."""
        return self._latest("planned")

    @property
    def resume_command(self) -> str | None:
        return self._latest("resume_command")

    def published_ids(self) -> set[str]:
        return {r["request_id"] for r in self.records}

    def open(self, header: dict, **session) -> None:
        """Start a session (creating the run with ``header`` when new); ``session``: extra fields
        of the session line (``planned``, ``resume_command``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        if not new and self.header is None:
            raise ToolError(f"{self.path} exists but has no run header: not a run manifest")
        if not new:
            # a torn last line must not glue onto the next record
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                if f.tell() > 0:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        with open(self.path, "ab") as g:
                            g.write(b"\n")
        self._f = open(self.path, "a", encoding="utf-8")
        if new:
            self.header = {"kind": "run", **header}
            self._write(self.header)
            self.sync()
            fsync_dir(self.path.parent)
        line = {"kind": "session", "started_at": time.time(), "pid": os.getpid(), "resumed": not new,
                "already_published": len(self.records), **session}
        self.sessions.append(line)
        self._write(line)

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def append(self, record: dict) -> None:
        rec = {"kind": "published", **record}
        self.records.append(rec)
        self._write(rec)
        now = time.monotonic()
        if now - self._last_sync > 1.0:
            self.sync()

    def sync(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None
