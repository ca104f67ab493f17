"""``alpamayo-producer report --lake DIR --out DIR [--run-id RUN]``: summary and plots over a lake.

Writes ``report.md`` (per-task counts, latency p50/p95 of ``total_ms`` and of the decode stage,
DFlash2 acceptance, dead letters by code, per profile), ``report.json`` and the PNGs
``task_counts.png``, ``latency.png`` (per-task total latency distributions by profile) and
``acceptance_over_time.png`` (per-result draft acceptance rate and mean acceptance length
against completion time, with a rolling mean).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from producer_tools.common import percentile
from producer_tools.lake import read_lake

__all__ = ["summarise_lake", "lake_report"]

_R_COLS = ["request_id", "run_id", "task", "num_samples", "total_ms", "decode_ms", "queue_ms", "model_profile",
           "spec_draft_acceptance_rate", "spec_mean_acceptance_length", "spec_num_draft_tokens",
           "spec_num_accepted_draft_tokens", "spec_num_spec_steps", "completed_at", "decode_error"]
_D_COLS = ["request_id", "run_id", "error_code", "failed_at"]


def summarise_lake(lake: str, run_id: str | None = None) -> dict[str, Any]:
    res = read_lake(lake, "results", run_id=run_id, columns=_R_COLS).to_pylist()
    dls = read_lake(lake, "dead_letters", run_id=run_id, columns=_D_COLS).to_pylist()
    res = [r for r in res if r.get("task")]
    by: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in res:
        by[(r["task"], r.get("model_profile") or "?")].append(r)
    rows = []
    for (task, prof), rs in sorted(by.items()):
        tot = [r["total_ms"] for r in rs if r.get("total_ms") is not None]
        dec = [r["decode_ms"] for r in rs if r.get("decode_ms") is not None]
        drafted = sum(r.get("spec_num_draft_tokens") or 0 for r in rs)
        acc = sum(r.get("spec_num_accepted_draft_tokens") or 0 for r in rs)
        steps = sum(r.get("spec_num_spec_steps") or 0 for r in rs)
        rows.append({
            "task": task, "profile": prof, "results": len(rs), "distinct_requests": len({r["request_id"] for r in rs}),
            "total_p50_ms": percentile(tot, 50), "total_p95_ms": percentile(tot, 95),
            "decode_p50_ms": percentile(dec, 50), "decode_p95_ms": percentile(dec, 95),
            "draft_acceptance_rate": acc / drafted if drafted else None,
            "mean_acceptance_length": 1 + acc / steps if steps else None,
        })
    return {
        "lake": str(lake), "run_id": run_id, "results": len(res), "dead_letters": len(dls),
        "runs": sorted({r["run_id"] for r in res + dls if r.get("run_id")}),
        "per_task": rows,
        "dead_letters_by_code": dict(Counter(d.get("error_code") or "?" for d in dls).most_common()),
        "_results": res,
    }


def _f(v, spec=".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def _markdown(s: dict[str, Any], plots: dict[str, str]) -> str:
    lines = [f"# Lake report: {s['lake']}" + (f" (run {s['run_id']})" if s["run_id"] else ""), "",
             f"{s['results']} results, {s['dead_letters']} dead letters, {len(s['runs'])} run(s).", "",
             "| task | profile | results | distinct requests | total p50 ms | total p95 ms | decode p50 ms "
             "| decode p95 ms | acceptance rate | mean acceptance length |",
             "|" + "---|" * 10]
    for r in s["per_task"]:
        lines.append(f"| {r['task']} | {r['profile']} | {r['results']} | {r['distinct_requests']} "
                     f"| {_f(r['total_p50_ms'])} | {_f(r['total_p95_ms'])} | {_f(r['decode_p50_ms'])} "
                     f"| {_f(r['decode_p95_ms'])} | {_f(r['draft_acceptance_rate'], '.3f')} "
                     f"| {_f(r['mean_acceptance_length'], '.2f')} |")
    if s["dead_letters_by_code"]:
        lines += ["", "Dead letters by code: " + ", ".join(f"`{k}` {v}" for k, v in s["dead_letters_by_code"].items())]
    lines += ["", "Plots: " + ", ".join(f"[{k}]({Path(v).name})" for k, v in plots.items()), ""]
    return "\n".join(lines)


def lake_report(lake: str, out: str, run_id: str | None = None, window: int = 20) -> dict[str, Any]:
    import matplotlib  # heavy optional dependency: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarise_lake(lake, run_id)
    res = s.pop("_results")
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}

    counts = Counter(r["task"] for r in res)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    tasks = sorted(counts)
    ax.bar(tasks, [counts[t] for t in tasks], color="tab:blue", label="results")
    dl = s["dead_letters_by_code"]
    if dl:
        ax.bar(["dead letters"], [sum(dl.values())], color="tab:red", label="dead letters")
    if not tasks and not dl:
        ax.text(0.5, 0.5, "empty lake", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("records")
    ax.set_title("results per task")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    plots["task_counts"] = str(outp / "task_counts.png")
    fig.savefig(plots["task_counts"], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.4))
    groups = sorted({(r["task"], r.get("model_profile") or "?") for r in res})
    data = [[r["total_ms"] for r in res if (r["task"], r.get("model_profile") or "?") == g and r.get("total_ms") is not None]
            for g in groups]
    if groups and any(data):
        ax.boxplot([d or [0.0] for d in data], showfliers=True)
        ax.set_xticks(range(1, len(groups) + 1), [f"{t}\n{p}" for t, p in groups], fontsize=7)
    else:
        ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("total latency (ms)")
    ax.set_title("end-to-end latency per task and profile")
    fig.tight_layout()
    plots["latency"] = str(outp / "latency.png")
    fig.savefig(plots["latency"], dpi=90)
    plt.close(fig)

    spec = sorted((r for r in res if r.get("spec_draft_acceptance_rate") is not None and r.get("completed_at")),
                  key=lambda r: r["completed_at"])
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    if spec:
        ts = [r["completed_at"] for r in spec]
        ar = np.array([r["spec_draft_acceptance_rate"] for r in spec])
        ml = np.array([r["spec_mean_acceptance_length"] for r in spec])
        w = max(1, min(window, len(spec)))
        kern = np.ones(w) / w
        a1.plot(ts, ar, ".", ms=3, alpha=0.5, color="tab:orange")
        a2.plot(ts, ml, ".", ms=3, alpha=0.5, color="tab:green")
        if len(spec) >= w:
            a1.plot(ts[w - 1:], np.convolve(ar, kern, "valid"), color="tab:red", label=f"rolling mean ({w})")
            a2.plot(ts[w - 1:], np.convolve(ml, kern, "valid"), color="tab:olive", label=f"rolling mean ({w})")
            a1.legend(fontsize=7)
        fig.autofmt_xdate()
    else:
        a1.text(0.5, 0.5, "no speculative-decoding metrics in the lake", ha="center", va="center",
                transform=a1.transAxes)
    a1.set_ylabel("acceptance rate")
    a2.set_ylabel("mean acceptance length")
    a1.set_title("DFlash2 acceptance over time")
    fig.tight_layout()
    plots["acceptance_over_time"] = str(outp / "acceptance_over_time.png")
    fig.savefig(plots["acceptance_over_time"], dpi=90)
    plt.close(fig)

    (outp / "report.md").write_text(_markdown(s, plots))
    s["plots"] = plots
    s["markdown"] = str(outp / "report.md")
    (outp / "report.json").write_text(json.dumps(s, indent=1, default=str))
    return s
