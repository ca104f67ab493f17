"""Reports and plots: fact/meta-action shares over many seeds and a bird's-eye plot grid."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from worker.scenes.facts import sample_facts
from worker.scenes.road import arc_point, arc_points
from worker.scenes.structs import LANE_WIDTH, LEAD_LENGTH, ROAD_HALF_WIDTH, Scene


def distribution_report(n: int = 500, seed0: int = 0) -> dict[str, dict[str, float]]:
    """Shares of the main fact categories and meta actions over seeds seed0 .. seed0+n-1
    (facts and plans only; no rendering)."""
    counts: dict[str, dict[str, int]] = {}

    def bump(key: str, val: str) -> None:
        counts.setdefault(key, {})
        counts[key][val] = counts[key].get(val, 0) + 1

    for i in range(n):
        f, p = sample_facts(np.random.default_rng(seed0 + i))
        bump("traffic_light", f.traffic_light)
        bump("lead", f.lead_relation)
        bump("pedestrian", f.pedestrian_side if f.pedestrian_crossing else "none")
        bump("blocked_lane", f.blocked_lane_kind)
        bump("road", "straight" if f.road_curvature == 0 else "left" if f.road_curvature > 0 else "right")
        bump("ego_speed", "<2" if f.ego_speed < 2 else "2-8" if f.ego_speed < 8 else "8-14" if f.ego_speed < 14 else ">=14")
        bump("longitudinal", p.longitudinal)
        bump("lateral", p.lateral)
        bump("lane", p.lane)
    return {k: {v: c / n for v, c in sorted(d.items())} for k, d in counts.items()}


def bev_plot(scenes: Sequence[Scene], predictions: Sequence | None = None,
             path: str | os.PathLike = "bev.png", *, ncols: int | None = None,
             title: str | None = None) -> Path:  # fmt: skip
    """Bird's-eye grid written to `path` (PNG): see `bev_figure`."""
    import matplotlib.pyplot as plt  # heavy optional dependency: only plots need it

    fig = bev_figure(scenes, predictions, ncols=ncols, title=title)
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


SAMPLE_COLORS = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _draw_road(ax, sc: Scene) -> None:
    """The scene's lanes, stop line, lead vehicle, pedestrian and blocked lane at t0."""
    f = sc.facts
    fu = np.asarray(sc.ego_future_xyz)
    k = f.road_curvature
    s = np.linspace(-30.0, max(40.0, float(fu[-1, 0]) + 10.0), 80)
    for dlat in (-ROAD_HALF_WIDTH, -0.5 * LANE_WIDTH, 0.5 * LANE_WIDTH, ROAD_HALF_WIDTH):
        x, y = arc_points(k, s, dlat)
        ax.plot(-y, x, color="0.8", lw=0.8, ls="-" if abs(dlat) > 2 else "--", zorder=0)
    if f.traffic_light != "none":
        x0, y0 = arc_point(k, f.stop_line_distance, -ROAD_HALF_WIDTH)
        x1, y1 = arc_point(k, f.stop_line_distance, ROAD_HALF_WIDTH)
        ax.plot([-y0, -y1], [x0, x1], color={"green": "g", "yellow": "y", "red": "r"}[f.traffic_light], lw=2,
                label=f"stop line ({f.traffic_light} light)")
    if f.lead_present:
        x, y = arc_point(k, f.lead_gap + LEAD_LENGTH / 2, 0.0)
        ax.plot([-y], [x], marker="s", ms=7, color="k", ls="none", label="lead vehicle (t0)")
    if f.pedestrian_crossing:
        x, y = arc_point(k, f.pedestrian_distance, 0.0)
        ax.plot([-y], [x], marker="*", ms=9, color="m", ls="none", label="pedestrian")
    if f.blocked_lane:
        dlat = 0.0 if f.blocked_lane_kind == "ego" else (LANE_WIDTH if f.blocked_lane_side == "left" else -LANE_WIDTH)
        x, y = arc_point(k, f.blocked_distance, dlat)
        ax.plot([-y], [x], marker="X", ms=8, color="orange", ls="none", label="blocked lane")


def bev_figure(scenes: Sequence[Scene | None], predictions: Sequence | None = None, *, ncols: int | None = None,
               title: str | None = None, panel_titles: Sequence[str] | None = None):
    """Bird's-eye grid, one panel per scene, axes in metres (forward up, left to the left): ego
    history (grey), ground-truth future (blue), each predicted sample in its own colour and
    labelled (per scene an array-like of shape (K, 64, >=2) or (64, >=2), or None), lead vehicle
    at t0, stop line, pedestrian and blocked lane; a legend per panel and `title` (e.g. the
    profile) above the grid. A scene of None (ground truth unknown) shows its predictions only;
    `panel_titles` replace the scene ids above the panels. Returns the matplotlib figure."""
    import matplotlib  # heavy optional dependency: only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(scenes))
    ncols = ncols or int(math.ceil(math.sqrt(n)))
    nrows = int(math.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 3.9 * nrows + (0.4 if title else 0)), squeeze=False)
    for idx, ax in enumerate(axes.flat):
        if idx >= len(scenes):
            ax.axis("off")
            continue
        sc = scenes[idx]
        if sc is not None:
            _draw_road(ax, sc)
        if predictions is not None and idx < len(predictions) and predictions[idx] is not None:
            pr = np.asarray(predictions[idx], dtype=np.float64)
            if pr.ndim == 2:
                pr = pr[None]
            for j, smp in enumerate(pr):
                ax.plot(-smp[:, 1], smp[:, 0], color=SAMPLE_COLORS[j % len(SAMPLE_COLORS)], lw=1.1, alpha=0.8,
                        label=f"sample {j + 1}")
        if sc is not None:
            h, fu = np.asarray(sc.ego_history_xyz), np.asarray(sc.ego_future_xyz)
            ax.plot(-h[:, 1], h[:, 0], color="0.4", lw=2, label="ego history")
            ax.plot(-fu[:, 1], fu[:, 0], color="tab:blue", lw=1.6, label="ground truth (6.4 s)")
        ax.plot([0], [0], marker="o", ms=4, color="k", ls="none")
        ax.set_aspect("equal", adjustable="datalim")
        head = panel_titles[idx] if panel_titles is not None else (sc.scene_id if sc is not None else "")
        what = f"{sc.facts.traffic_light} light, lead {sc.facts.lead_relation}" if sc is not None \
            else "ground truth unknown"
        ax.set_title(f"{head}\n{what}", fontsize=7)
        ax.set_xlabel("lateral (m, left +)", fontsize=6)
        ax.set_ylabel("forward (m)", fontsize=6)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5, loc="upper left", framealpha=0.7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
