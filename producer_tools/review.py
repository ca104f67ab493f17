"""``alpamayo-producer review --lake DIR [--run-id RUN] --out DIR``: a run's doubtful scenes.

Reads the results of the lake (one row per request), computes each result's uncertainty from its
samples with the worker's own function (``worker.uncertainty.uncertainty_block``: the trajectories,
meta actions and auto labels the lake keeps are what the worker scored), and lists the results
at or above the threshold (``--threshold``, default ``ALPAMAYO_REVIEW_THRESHOLD``), most doubtful
first. Each doubtful result with trajectories gets a bird's-eye plot in ``--out``
(``worker.scenes.plots.bev_figure``): every sample, and the ground truth when the scene is known,
i.e. a scene file of ``--scenes-dir`` with the result's ``scene_id`` label, or a synthetic scene
(``synth-<seed>``, regenerated from its seed). Also writes ``review.json`` and ``review.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from producer_tools.common import ToolError
from producer_tools.lake import read_lake
from worker.scenes import generate_scene, read_scene
from worker.scenes.plots import bev_figure
from worker.uncertainty import uncertainty_block

__all__ = ["doubtful_results", "review_run", "format_table"]

_COLUMNS = ["request_id", "run_id", "task", "num_samples", "labels", "pred_trajectories", "meta_actions",
            "auto_labels", "uncertainty_checker_disagreement_m"]
_SYNTHETIC_ID = re.compile(r"synth-(\d+)")


def _scene_id(row: dict) -> str | None:
    labels = row.get("labels") or []
    return (dict(labels) if isinstance(labels, list) else labels).get("scene_id")


def doubtful_results(lake: str, run_id: str | None, threshold: float) -> list[dict[str, Any]]:
    """The run's results whose uncertainty is at or above ``threshold``, most doubtful first."""
    rows = read_lake(lake, "results", run_id=run_id, columns=_COLUMNS, dedupe=True).to_pylist()
    out = []
    for r in rows:
        block = uncertainty_block(r.get("pred_trajectories"), r.get("meta_actions"), r.get("auto_labels"),
                                  r.get("uncertainty_checker_disagreement_m"))
        if block is not None and block["uncertainty"] >= threshold:
            out.append({"request_id": r["request_id"], "run_id": r.get("run_id"), "task": r["task"],
                        "k": r["num_samples"], "scene_id": _scene_id(r), **block,
                        "_trajectories": r.get("pred_trajectories")})
    return sorted(out, key=lambda d: (-d["uncertainty"], d["request_id"]))


def _ground_truth(scene_id: str | None, scenes_dir: Path | None):
    if scene_id is None:
        return None
    if scenes_dir is not None:
        for path in scenes_dir.glob("*.msgpack"):
            if path.stem == scene_id or path.stem.endswith(scene_id):
                return read_scene(path)
    m = _SYNTHETIC_ID.fullmatch(scene_id)
    return generate_scene(int(m.group(1))) if m else None


def _fmt(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def format_table(items: list[dict[str, Any]]) -> str:
    lines = ["| uncertainty | task | K | request_id | scene_id | lateral spread m | checker disagreement m "
             "| meta agreement | label agreement | plot |", "|" + "---|" * 10]
    for d in items:
        lines.append(f"| {d['uncertainty']:.3f} | {d['task']} | {d['k']} | {d['request_id']} | {d['scene_id'] or '–'} "
                     f"| {_fmt(d.get('lateral_spread_m'))} | {_fmt(d.get('checker_disagreement_m'))} "
                     f"| {_fmt(d.get('meta_action_agreement'))} "
                     f"| {_fmt(d.get('auto_label_agreement'))} | {d.get('plot') or '–'} |")
    return "\n".join(lines)


def review_run(lake: str, out: str, run_id: str | None = None, threshold: float | None = None,
               scenes_dir: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """List the doubtful results and plot them; returns the summary (also written to ``out``)."""
    import matplotlib.pyplot as plt  # heavy optional dependency: only the plots need it

    from worker.config import load_settings

    if threshold is None:
        threshold = load_settings().review_threshold
    if not 0.0 <= threshold <= 1.0:
        raise ToolError(f"--threshold {threshold} is not an uncertainty: use a number in [0, 1]")
    sdir = Path(scenes_dir) if scenes_dir else None
    if sdir is not None and not sdir.is_dir():
        raise ToolError(f"--scenes-dir {scenes_dir} is not a directory")
    items = doubtful_results(lake, run_id, threshold)
    shown = items if limit is None else items[:limit]
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(shown):
        traj = d.pop("_trajectories")
        if traj is None:
            continue
        scene = _ground_truth(d["scene_id"], sdir)
        d["ground_truth"] = scene is not None
        fig = bev_figure([scene], [traj], ncols=1, panel_titles=[
            f"{d['request_id']}\nuncertainty {d['uncertainty']:.2f}, K={d['k']}"])
        name = f"{i + 1:03d}-{re.sub(r'[^A-Za-z0-9._-]', '_', d['request_id'])}.png"
        fig.savefig(dest / name, dpi=90)
        plt.close(fig)
        d["plot"] = name
    for d in items[len(shown):]:
        d.pop("_trajectories")
    table = format_table(shown)
    summary = {"lake": str(lake), "run_id": run_id, "threshold": threshold, "doubtful": len(items),
               "shown": len(shown), "results": items, "table": table}
    (dest / "review.json").write_text(json.dumps(summary, indent=1))
    (dest / "review.md").write_text(f"# Doubtful results (uncertainty >= {threshold:g})\n\n"
                                    f"Run `{run_id or 'all'}`: {len(items)} doubtful results.\n\n{table}\n")
    return summary
