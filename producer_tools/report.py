"""``alpamayo-producer report --lake DIR --out DIR [--run-id RUN] [--force]``: summary and plots over a lake.

Writes ``report.md`` (per task, K, temperature and profile: counts, latency p50/p95 of ``total_ms``,
of the queue and of the compute, DFlash2 acceptance; dead letters by code; every plot with a
caption saying what it shows; the results' uncertainty per group), ``report.json`` and the PNGs
``task_counts.png``, ``latency.png`` (mean queue and mean compute time stacked, per group),
``acceptance_over_time.png`` (draft acceptance rate and mean acceptance length against seconds
since the first result, one series and one rolling mean per K and temperature: a change of
workload is not a regression) and ``uncertainty.png`` (its distribution per task and K, and
best-of-K ADE against it where the requests carried ground truth).

The temperature of a request is in the lake only when the sink ran with ``--requests`` (the
result does not carry it); otherwise groups show ``T=?``. A missing lake is refused; an earlier
report in ``--out`` is not overwritten without ``--force``.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from producer_tools.common import ToolError, percentile
from producer_tools.lake import read_lake

__all__ = ["summarise_lake", "lake_report"]

_R_COLS = ["request_id", "run_id", "task", "num_samples", "total_ms", "decode_ms", "queue_ms", "model_profile",
           "spec_draft_acceptance_rate", "spec_mean_acceptance_length", "spec_num_draft_tokens",
           "spec_num_accepted_draft_tokens", "spec_num_spec_steps", "completed_at", "decode_error", "uncertainty",
           "pred_trajectories"]
_D_COLS = ["request_id", "run_id", "error_code", "failed_at"]
_OUTPUTS = ("report.md", "report.json", "task_counts.png", "latency.png", "acceptance_over_time.png",
            "uncertainty.png")


def _group(r: dict) -> tuple[str, int, str, str]:
    """(task, K, temperature, profile): results of one group are comparable."""
    t = r.get("temperature")
    return (r["task"], int(r.get("num_samples") or 0), "?" if t is None else f"{t:g}", r.get("model_profile") or "?")


def _by(rows: list[dict], key) -> dict:
    out: dict = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def summarise_lake(lake: str, run_id: str | None = None) -> dict[str, Any]:
    if not any((Path(lake) / t).is_dir() for t in ("results", "dead_letters")):
        raise ToolError(f"--lake {lake}: no lake there (neither {lake}/results nor {lake}/dead_letters exists); "
                        "point --lake at the directory the sink writes")
    res = read_lake(lake, "results", run_id=run_id, columns=_R_COLS).to_pylist()
    dls = read_lake(lake, "dead_letters", run_id=run_id, columns=_D_COLS).to_pylist()
    reqs = {r["request_id"]: r for r in read_lake(lake, "requests", run_id=run_id,
                                                    columns=["request_id", "temperature", "ego_future_xyz"]).to_pylist()}
    temps = {k: r["temperature"] for k, r in reqs.items()}
    res = [{**r, "temperature": temps.get(r["request_id"]),
            "min_ade_m": _min_ade(r.get("pred_trajectories"), (reqs.get(r["request_id"]) or {}).get("ego_future_xyz"))}
           for r in res if r.get("task")]
    rows = []
    for g, rs in sorted(_by(res, _group).items()):
        tot = [r["total_ms"] for r in rs if r.get("total_ms") is not None]
        que = [r["queue_ms"] for r in rs if r.get("queue_ms") is not None]
        comp = [r["total_ms"] - r["queue_ms"] for r in rs if r.get("total_ms") is not None and r.get("queue_ms") is not None]
        drafted = sum(r.get("spec_num_draft_tokens") or 0 for r in rs)
        acc = sum(r.get("spec_num_accepted_draft_tokens") or 0 for r in rs)
        steps = sum(r.get("spec_num_spec_steps") or 0 for r in rs)
        unc = [r["uncertainty"] for r in rs if r.get("uncertainty") is not None]
        rows.append({
            "task": g[0], "k": g[1], "temperature": g[2], "profile": g[3], "results": len(rs),
            "distinct_requests": len({r["request_id"] for r in rs}),
            "total_p50_ms": percentile(tot, 50), "total_p95_ms": percentile(tot, 95),
            "queue_p50_ms": percentile(que, 50), "compute_p50_ms": percentile(comp, 50),
            "compute_p95_ms": percentile(comp, 95),
            "queue_mean_ms": float(np.mean(que)) if que else None,
            "compute_mean_ms": float(np.mean(comp)) if comp else None,
            "draft_acceptance_rate": acc / drafted if drafted else None,
            "mean_acceptance_length": 1 + acc / steps if steps else None,
            "with_uncertainty": len(unc), "uncertainty_p50": percentile(unc, 50), "uncertainty_p90": percentile(unc, 90),
        })
    return {
        "lake": str(lake), "run_id": run_id, "results": len(res), "dead_letters": len(dls),
        "runs": sorted({r["run_id"] for r in res + dls if r.get("run_id")}),
        "temperatures_known": bool(temps),
        "per_task": rows,
        "dead_letters_by_code": dict(Counter(d.get("error_code") or "?" for d in dls).most_common()),
        "_results": res,
    }


def _min_ade(pred, truth) -> float | None:
    """Best-of-K average displacement (x/y, metres) of K x 64 x 3 predictions against the 64 x 3
    ground truth the request carried (``publish --ground-truth``, sink ``--requests``); None without."""
    if not pred or not truth:
        return None
    p, t = np.asarray(pred, dtype=np.float64)[..., :2], np.asarray(truth, dtype=np.float64)[:, :2]
    return float(np.linalg.norm(p - t[None], axis=-1).mean(axis=1).min())


def _f(v, spec=".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


_CAPTIONS = {
    "task_counts": "Result records per task, and all dead letters in one red bar (by code in the text above).",
    "latency": "Mean time per request of each task / K / temperature / profile group: queue (record time to "
               "engine start: waiting for a batch slot) stacked under compute (engine start to result). "
               "The bars' heights are the mean total latency; p50/p95 are in the table.",
    "acceptance_over_time": "DFlash2 draft acceptance rate (top) and mean acceptance length (bottom) of each "
                            "trajectory result against seconds since the first result in the lake, one colour "
                            "per K and temperature (dots: results; line: rolling mean of that series only).",
    "uncertainty": "Left: the distribution of the results' `uncertainty` (K >= 2 only; docs/uncertainty.md), "
                   "one histogram per task and K. Right, where the requests carried ground truth: each "
                   "result's best-of-K ADE against its uncertainty (a useful uncertainty puts the large "
                   "errors on the right).",
}


def _markdown(s: dict[str, Any], plots: dict[str, str]) -> str:
    lines = [f"# Lake report: {s['lake']}" + (f" (run {s['run_id']})" if s["run_id"] else ""), "",
             f"{s['results']} results, {s['dead_letters']} dead letters, {len(s['runs'])} run(s).", "",
             "| task | K | temperature | profile | results | distinct requests | total p50 ms | total p95 ms "
             "| queue p50 ms | compute p50 ms | compute p95 ms | acceptance rate | mean acceptance length |",
             "|" + "---|" * 13]
    for r in s["per_task"]:
        lines.append(f"| {r['task']} | {r['k']} | {r['temperature']} | {r['profile']} | {r['results']} "
                     f"| {r['distinct_requests']} | {_f(r['total_p50_ms'])} | {_f(r['total_p95_ms'])} "
                     f"| {_f(r['queue_p50_ms'])} | {_f(r['compute_p50_ms'])} | {_f(r['compute_p95_ms'])} "
                     f"| {_f(r['draft_acceptance_rate'], '.3f')} | {_f(r['mean_acceptance_length'], '.2f')} |")
    if not s["temperatures_known"]:
        lines += ["", "Temperature `?`: the lake has no requests table (run the sink with `--requests`)."]
    unc_rows = [r for r in s["per_task"] if r["with_uncertainty"]]
    if unc_rows:
        lines += ["", "## Uncertainty (results with K >= 2)", "",
                  "| task | K | temperature | profile | results with uncertainty | p50 | p90 |", "|" + "---|" * 7]
        lines += [f"| {r['task']} | {r['k']} | {r['temperature']} | {r['profile']} | {r['with_uncertainty']} "
                  f"| {_f(r['uncertainty_p50'], '.3f')} | {_f(r['uncertainty_p90'], '.3f')} |" for r in unc_rows]
    if s["dead_letters_by_code"]:
        lines += ["", "Dead letters by code: " + ", ".join(f"`{k}` {v}" for k, v in s["dead_letters_by_code"].items())]
    for k, v in plots.items():
        lines += ["", f"![{k}]({Path(v).name})", "", f"*{k}*: {_CAPTIONS[k]}"]
    lines.append("")
    return "\n".join(lines)


def lake_report(lake: str, out: str, run_id: str | None = None, window: int = 20, force: bool = False) -> dict[str, Any]:
    s = summarise_lake(lake, run_id)             # refuses a missing lake before anything is written
    outp = Path(out)
    earlier = [n for n in _OUTPUTS if (outp / n).exists()]
    if earlier and not force:
        raise ToolError(f"--out {out} already holds a report ({', '.join(earlier)}): pass --force to overwrite it, "
                        "or choose another --out")
    import matplotlib  # heavy optional dependency: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = s.pop("_results")
    outp.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        plots[name] = str(outp / f"{name}.png")
        fig.savefig(plots[name], dpi=90)
        plt.close(fig)

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
    save(fig, "task_counts")

    rows = [r for r in s["per_task"] if r["queue_mean_ms"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 3.6))
    if rows:
        x = np.arange(len(rows))
        q = np.array([r["queue_mean_ms"] for r in rows])
        c = np.array([r["compute_mean_ms"] for r in rows])
        ax.bar(x, q, color="tab:gray", label="queue (mean)")
        ax.bar(x, c, bottom=q, color="tab:blue", label="compute (mean)")
        ax.set_xticks(x, [f"{r['task']}\nK={r['k']} T={r['temperature']}\n{r['profile']}" for r in rows], fontsize=7)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("ms per request")
    ax.set_title("latency: queue vs compute, per task / K / temperature")
    save(fig, "latency")

    spec = sorted((r for r in res if r.get("spec_draft_acceptance_rate") is not None and r.get("completed_at")),
                  key=lambda r: r["completed_at"])
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 4.8), sharex=True)
    if spec:
        t0 = spec[0]["completed_at"]
        series: dict[tuple, list[dict]] = defaultdict(list)
        for r in spec:
            series[_group(r)[1:]].append(r)
        for i, (g, rs) in enumerate(sorted(series.items())):
            colour = f"C{i % 10}"
            ts = np.array([(r["completed_at"] - t0).total_seconds() for r in rs])
            w = min(window, max(1, len(rs) - 1))       # the rolling mean has 2 points or more: a visible line
            name = f"K={g[0]} T={g[1]} {g[2]}"
            for ax, col in ((a1, "spec_draft_acceptance_rate"), (a2, "spec_mean_acceptance_length")):
                v = np.array([r[col] for r in rs])
                ax.plot(ts, v, ".", ms=3, alpha=0.4, color=colour, label=None if len(rs) > 1 else name)
                if len(rs) > 1:
                    ax.plot(ts[w - 1:], np.convolve(v, np.ones(w) / w, "valid"), "-", color=colour,
                            label=f"{name}: rolling mean of {w}")
        a1.legend(fontsize=6)
        a2.legend(fontsize=6)
        a2.set_xlabel(f"seconds since the first result ({t0:%Y-%m-%d %H:%M:%S} UTC)")
    else:
        a1.text(0.5, 0.5, "no speculative-decoding metrics in the lake", ha="center", va="center",
                transform=a1.transAxes)
    a1.set_ylabel("acceptance rate")
    a2.set_ylabel("mean acceptance length")
    a1.set_title("DFlash2 acceptance over time, per K and temperature")
    save(fig, "acceptance_over_time")

    unc = [r for r in res if r.get("uncertainty") is not None]
    fig, (h, sc) = plt.subplots(1, 2, figsize=(9, 3.4))
    if unc:
        for i, (g, rs) in enumerate(sorted(_by(unc, lambda r: (r["task"], int(r["num_samples"] or 0))).items())):
            h.hist([r["uncertainty"] for r in rs], bins=np.linspace(0, 1, 21), histtype="step", color=f"C{i % 10}",
                   label=f"{g[0]} K={g[1]} ({len(rs)})")
        h.legend(fontsize=6)
        known = [r for r in unc if r.get("min_ade_m") is not None]
        if known:
            sc.scatter([r["uncertainty"] for r in known], [r["min_ade_m"] for r in known], s=8, alpha=0.6)
        else:
            sc.text(0.5, 0.5, "no ground truth in the lake\n(publish --ground-truth, sink --requests)",
                    ha="center", va="center", transform=sc.transAxes, fontsize=8)
    else:
        h.text(0.5, 0.5, "no results with K >= 2", ha="center", va="center", transform=h.transAxes)
    h.set_xlabel("uncertainty")
    h.set_ylabel("results")
    sc.set_xlabel("uncertainty")
    sc.set_ylabel("minADE over K (m)")
    h.set_title("uncertainty per task and K")
    sc.set_title("error against uncertainty")
    save(fig, "uncertainty")

    (outp / "report.md").write_text(_markdown(s, plots))
    s["plots"] = plots
    s["markdown"] = str(outp / "report.md")
    (outp / "report.json").write_text(json.dumps(s, indent=1, default=str))
    return s
