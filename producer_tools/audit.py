"""``alpamayo-producer audit RUN_ID --lake DIR``: did every published request of a run land?

Reconciles the run manifest written by ``publish`` (``<runs-dir>/<run_id>.jsonl``, or
``--manifest FILE``) with the lake's results and dead letters of that run:

* ``missing``: published, with neither a result nor a dead letter in the lake;
* ``failed``: dead-lettered and without a result (``recovered``: dead-lettered, then a result,
  e.g. after ``dlq replay``);
* ``duplicated``: more than one result record for one request id (a redelivery: the worker
  processed the request twice; harmless, the rows are identical up to timings);
* ``lake_duplicates``: one Kafka record (topic, partition, offset) present twice in the lake,
  which exactly-once sinking must never produce;
* ``unexpected``: ids of the run in the lake that the manifest does not list;
* ``undecodable``: rows the sink could not decode.

Exit status: 0 when complete, 1 when anything is missing or a lake duplicate exists (also for
failures and redeliveries with ``--strict``), 2 on usage errors.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from producer_tools.common import ToolError
from producer_tools.lake import read_lake
from producer_tools.run_manifest import RunManifest

__all__ = ["AuditReport", "audit_run", "reconcile", "format_report"]


@dataclass
class AuditReport:
    run_id: str
    published: int
    results: int = 0
    dead_letters: int = 0
    landed: int = 0
    missing: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    failed_codes: dict[str, int] = field(default_factory=dict)
    recovered: list[str] = field(default_factory=list)
    duplicated: dict[str, int] = field(default_factory=dict)
    lake_duplicates: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    undecodable: int = 0
    republished: int = 0
    manifest: str | None = None

    @property
    def complete(self) -> bool:
        return not self.missing and not self.lake_duplicates

    def exit_code(self, strict: bool = False) -> int:
        if not self.complete:
            return 1
        if strict and (self.failed or self.duplicated or self.unexpected or self.undecodable):
            return 1
        return 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["complete"] = self.complete
        return d


def reconcile(run_id: str, published_ids: list[str], result_rows: list[dict], dead_letter_rows: list[dict],
              manifest: str | None = None) -> AuditReport:
    """The audit logic over plain rows (``request_id``, ``kafka_topic``, ``kafka_partition``,
    ``kafka_offset``, ``decode_error``; dead letters also ``error_code``)."""
    pub_counts = Counter(published_ids)
    published = set(pub_counts)
    rep = AuditReport(run_id=run_id, published=len(published), manifest=manifest,
                      republished=sum(c - 1 for c in pub_counts.values() if c > 1))
    coords = Counter()
    res_ids: Counter = Counter()
    for r in result_rows:
        coords[("r", r["kafka_topic"], r["kafka_partition"], r["kafka_offset"])] += 1
        if r.get("decode_error") and not r.get("task"):
            rep.undecodable += 1
            continue
        if r.get("request_id"):
            res_ids[r["request_id"]] += 1
    dl_ids: dict[str, list[str]] = {}
    for r in dead_letter_rows:
        coords[("d", r["kafka_topic"], r["kafka_partition"], r["kafka_offset"])] += 1
        if r.get("decode_error") and not r.get("error_field"):
            rep.undecodable += 1
        if r.get("request_id"):
            dl_ids.setdefault(r["request_id"], []).append(r.get("error_code") or "unknown")
    rep.results = len(result_rows)
    rep.dead_letters = len(dead_letter_rows)
    rep.lake_duplicates = sorted(f"{t}:{p}:{o} x{n}" for (_k, t, p, o), n in coords.items() if n > 1)
    seen = set(res_ids) | set(dl_ids)
    rep.landed = len(published & seen)
    rep.missing = sorted(published - seen)
    rep.failed = sorted(i for i in dl_ids if i not in res_ids and i in published)
    codes: Counter = Counter()
    for i in rep.failed:
        codes[dl_ids[i][-1]] += 1
    rep.failed_codes = dict(sorted(codes.items()))
    rep.recovered = sorted(i for i in dl_ids if i in res_ids)
    rep.duplicated = {i: n for i, n in sorted(res_ids.items()) if n > 1}
    rep.unexpected = sorted(seen - published)
    return rep


def audit_run(run_id: str, lake: str, manifest_path: str | None = None, runs_dir: str = "runs",
              use_manifest: bool = True) -> AuditReport:
    published: list[str] = []
    mpath = None
    if use_manifest:
        m = RunManifest(manifest_path) if manifest_path else RunManifest.for_run(runs_dir, run_id)
        mpath = str(m.path)
        if not m.exists:
            raise ToolError(f"no run manifest at {m.path} (give --manifest FILE, or --no-manifest to audit the lake only)")
        if m.run_id != run_id:
            raise ToolError(f"{m.path} is the manifest of run {m.run_id!r}, not {run_id!r}")
        published = [r["request_id"] for r in m.records]
    cols_r = ["request_id", "task", "kafka_topic", "kafka_partition", "kafka_offset", "decode_error"]
    cols_d = ["request_id", "error_code", "error_field", "kafka_topic", "kafka_partition", "kafka_offset",
              "decode_error"]
    results = read_lake(lake, "results", run_id=run_id, columns=cols_r).to_pylist()
    dls = read_lake(lake, "dead_letters", run_id=run_id, columns=cols_d).to_pylist()
    if not use_manifest:
        published = sorted({r["request_id"] for r in results + dls if r.get("request_id")})
    return reconcile(run_id, published, results, dls, manifest=mpath)


def _sample(ids, n: int = 20) -> str:
    ids = list(ids)
    more = f" ... (+{len(ids) - n})" if len(ids) > n else ""
    return ", ".join(ids[:n]) + more


def format_report(rep: AuditReport) -> str:
    lines = [
        f"run {rep.run_id}: {'COMPLETE' if rep.complete else 'INCOMPLETE'}",
        f"  published {rep.published} request ids ({rep.manifest or 'from the lake'})",
        f"  landed    {rep.landed} (results rows {rep.results}, dead-letter rows {rep.dead_letters})",
        f"  missing   {len(rep.missing)}" + (f": {_sample(rep.missing)}" if rep.missing else ""),
        f"  failed    {len(rep.failed)}" + (f" {json.dumps(rep.failed_codes)}: {_sample(rep.failed)}" if rep.failed else ""),
        f"  recovered {len(rep.recovered)} (dead-lettered, then a result)",
        f"  duplicated {len(rep.duplicated)} request ids with more than one result record"
        + (f": {_sample(f'{k} x{v}' for k, v in rep.duplicated.items())}" if rep.duplicated else ""),
        f"  lake duplicates {len(rep.lake_duplicates)}" + (f": {_sample(rep.lake_duplicates)}" if rep.lake_duplicates else ""),
    ]
    if rep.unexpected:
        lines.append(f"  unexpected {len(rep.unexpected)} ids not in the manifest: {_sample(rep.unexpected)}")
    if rep.undecodable:
        lines.append(f"  undecodable rows {rep.undecodable}")
    if rep.republished:
        lines.append(f"  republished {rep.republished} (sent again after an unrecorded acknowledgement)")
    return "\n".join(lines)
