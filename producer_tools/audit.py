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

The verdict and the exit status:

* ``COMPLETE`` (exit 0): every planned request has a result (with ``--strict``, redeliveries,
  unexpected ids and undecodable rows exit 1 as well);
* ``FAILED`` (exit 1): every planned request landed, but n of them only as dead letters (counted
  by code), or the lake holds a Kafka record twice;
* ``INCOMPLETE`` (exit 3): n of the N planned requests have landed; the rest were never
  published (an interrupted or ``--limit`` ed publish: the report shows the command that resumes
  it) or are published without an output yet (the worker or the sink is behind or down).

N is the run's planned total, kept in the run manifest by ``publish``; runs published without
one (older manifests, the chaos harness) plan what they published. Exit 2: usage errors.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from producer_tools.common import ToolError
from producer_tools.lake import read_lake
from producer_tools.run_manifest import RunManifest

__all__ = ["AuditReport", "audit_run", "reconcile", "format_report", "EXIT_CODES"]

EXIT_CODES = {"COMPLETE": 0, "FAILED": 1, "INCOMPLETE": 3}


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
    planned: int | None = None          # the run's planned total (None: what was published)
    resume_command: str | None = None

    @property
    def unpublished(self) -> int:
        return max(0, (self.planned or 0) - self.published)

    @property
    def verdict(self) -> str:
        if self.missing or self.unpublished:
            return "INCOMPLETE"
        if self.failed or self.lake_duplicates:
            return "FAILED"
        return "COMPLETE"

    @property
    def complete(self) -> bool:
        return self.verdict == "COMPLETE"

    def exit_code(self, strict: bool = False) -> int:
        verdict = self.verdict
        if verdict != "COMPLETE":
            return EXIT_CODES[verdict]
        return 1 if strict and (self.duplicated or self.unexpected or self.undecodable) else 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(verdict=self.verdict, complete=self.complete, unpublished=self.unpublished)
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
    mpath = m = None
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
    rep = reconcile(run_id, published, results, dls, manifest=mpath)
    if m is not None:
        rep.planned, rep.resume_command = m.planned, m.resume_command
    return rep


def _sample(ids, n: int = 20) -> str:
    ids = list(ids)
    more = f" ... (+{len(ids) - n})" if len(ids) > n else ""
    return ", ".join(ids[:n]) + more


def _headline(rep: AuditReport) -> str:
    planned = rep.planned if rep.planned is not None else rep.published
    codes = ", ".join(f"{c} {n}" for c, n in rep.failed_codes.items())
    if rep.verdict == "COMPLETE":
        return f"COMPLETE: every one of the {planned} planned requests has a result"
    if rep.verdict == "FAILED":
        return (f"FAILED: {len(rep.failed)} of {planned} planned requests dead-lettered ({codes})" if rep.failed
                else f"FAILED: {len(rep.lake_duplicates)} Kafka records are in the lake twice")
    why = []
    if rep.unpublished:
        why.append(f"{rep.unpublished} never published (resume: {rep.resume_command or 'publish again with --run-id ' + rep.run_id})")
    if rep.missing:
        why.append(f"{len(rep.missing)} published without an output yet (is a worker serving and a sink running?)")
    if rep.failed:
        why.append(f"{len(rep.failed)} dead-lettered ({codes})")
    return f"INCOMPLETE: {rep.landed} of {planned} planned requests landed; " + "; ".join(why)


def format_report(rep: AuditReport) -> str:
    lines = [
        f"run {rep.run_id}: {_headline(rep)}",
        f"  planned   {rep.planned if rep.planned is not None else '-'} requests",
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
