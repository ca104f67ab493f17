"""The figures of one chaos run (one table row) and their table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class Figures:
    scenario: str
    guarantee: str
    published: int = 0
    results: int = 0
    dead_letters: int = 0
    answered: int = 0                 # distinct request ids with at least one output
    lost: int = 0
    duplicated: int = 0               # raw: output rows beyond the first per request id
    duplicated_after_dedup: int | None = None   # one row per request id (None: no dedup offered)
    lake_duplicates: int = 0          # one Kafka record twice in the lake
    worker_kills: int = 0
    sink_kills: int = 0
    broker_faults: int = 0
    worker_restarts: int = 0
    sink_restarts: int = 0
    broker_restarts: int = 0
    unplanned_exits: int = 0
    kills_requested: int = 0
    final_exit_code: int | None = None
    sink_exit_code: int | None = None
    wall_s: float = 0.0
    settle_s: float | None = None     # from the last fault until settled
    rss_start_mb: float | None = None
    rss_end_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_slope_mb_per_h: float | None = None
    gpu_mem_start_mb: float | None = None
    gpu_mem_end_mb: float | None = None
    sink_rss_start_mb: float | None = None
    sink_rss_end_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.worker_kills + self.sink_kills + self.broker_faults

    @property
    def restarts(self) -> int:
        return self.worker_restarts + self.sink_restarts + self.broker_restarts

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(kills=self.kills, restarts=self.restarts, ok=self.ok)
        return d

    def check(self) -> "Figures":
        """Fill ``failures`` from the figures (the guarantees each scenario promises)."""
        f = self.failures
        if self.lost:
            f.append(f"{self.lost} published request(s) have neither a result nor a dead letter")
        if self.lake_duplicates:
            f.append(f"{self.lake_duplicates} Kafka record(s) are twice in the lake")
        if self.guarantee == "exactly_once" and self.duplicated:
            f.append(f"exactly_once: {self.duplicated} duplicate output(s)")
        if self.duplicated_after_dedup:
            f.append(f"{self.duplicated_after_dedup} duplicate(s) left after deduplication")
        if self.worker_kills + self.sink_kills < self.kills_requested:
            f.append(f"only {self.worker_kills + self.sink_kills} of {self.kills_requested} kills landed mid-run")
        if self.final_exit_code not in (0, None):
            f.append(f"the final SIGTERM drain exited {self.final_exit_code}, not 0")
        if self.sink_exit_code not in (0, None):
            f.append(f"the sink's SIGTERM exit was {self.sink_exit_code}, not 0")
        return self


TABLE_COLUMNS = [
    ("scenario", lambda f: f.scenario), ("guarantee", lambda f: f.guarantee),
    ("published", lambda f: f.published), ("results", lambda f: f.results),
    ("dead letters", lambda f: f.dead_letters), ("lost", lambda f: f.lost),
    ("duplicated", lambda f: f.duplicated),
    ("after dedup", lambda f: "n/a" if f.duplicated_after_dedup is None else f.duplicated_after_dedup),
    ("lake dup", lambda f: f.lake_duplicates), ("kills", lambda f: _kills_text(f)),
    ("restarts", lambda f: _restarts_text(f)), ("exits", lambda f: f.unplanned_exits),
    ("wall s", lambda f: f"{f.wall_s:.0f}"), ("ok", lambda f: "yes" if f.ok else "NO"),
]


def _breakdown(total: int, worker: int, sink: int, broker: int) -> str:
    """'12 (10 worker, 2 sink)': the parts are named when there are several or a broker is one."""
    parts = [f"{n} {what}" for n, what in ((worker, "worker"), (sink, "sink"), (broker, "broker")) if n]
    return f"{total}" + (f" ({', '.join(parts)})" if len(parts) > 1 or broker else "")


def _kills_text(f: Figures) -> str:
    return _breakdown(f.kills, f.worker_kills, f.sink_kills, f.broker_faults)


def _restarts_text(f: Figures) -> str:
    return _breakdown(f.restarts, f.worker_restarts, f.sink_restarts, f.broker_restarts)


def format_table(figs: Iterable[Figures]) -> str:
    """The figures as a Markdown table (plus one line per failure and per RSS measurement)."""
    figs = list(figs)
    head = [c for c, _ in TABLE_COLUMNS]
    rows = [[str(fn(f)) for _, fn in TABLE_COLUMNS] for f in figs]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    for f in figs:
        mem = []
        if f.rss_start_mb is not None:
            mem.append(f"worker RSS {f.rss_start_mb} -> {f.rss_end_mb} MB (peak {f.rss_peak_mb} MB"
                       + (f", slope {f.rss_slope_mb_per_h:+.1f} MB/h" if f.rss_slope_mb_per_h is not None else "")
                       + ")")
        if f.sink_rss_start_mb is not None:
            mem.append(f"sink RSS {f.sink_rss_start_mb} -> {f.sink_rss_end_mb} MB")
        if f.gpu_mem_start_mb is not None:
            mem.append(f"GPU memory {f.gpu_mem_start_mb} -> {f.gpu_mem_end_mb} MB")
        if f.settle_s is not None:
            mem.append(f"settled {f.settle_s:.0f}s after the last fault")
        if mem:
            out.append(f"- {f.scenario}/{f.guarantee}: " + "; ".join(mem))
        for k, v in f.extra.items():
            if k.startswith("_"):
                continue
            out.append(f"- {f.scenario}/{f.guarantee}: {k}: {v}")
        for msg in f.failures:
            out.append(f"- {f.scenario}/{f.guarantee}: FAILED: {msg}")
    return "\n".join(out)
