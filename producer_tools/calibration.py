"""``alpamayo-producer qualify --uncertainty``: how well the result's ``uncertainty`` finds bad labels.

Held-out synthetic scenes (seeds ``CALIBRATION_SEED0 + seed + i``, far from the demo checkpoint's
training seeds 0..599 and its report's 50,000..50,039) run through the runtime as trajectory
requests, K samples at temperature ``EVAL_TEMPERATURE`` with the worker's per-request seed, once
per K. Per scene: ``uncertainty`` (``worker.uncertainty``, the same function the worker
publishes) and minADE@K (best sample's mean x/y distance to the ground-truth future, metres).

Per K: AUROC of ``uncertainty`` for "minADE > ``BAD_MIN_ADE_M``" (the probability that a bad
scene scores above a good one; ties count half; 0.5 = chance) and the Spearman rank correlation
of uncertainty and minADE. The bar: AUROC >= ``AUROC_BAR`` at K = 6.

Writes ``uncertainty_calibration.json`` (per K summary and per scene values) and
``uncertainty_calibration.md`` (the table) into ``--out``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from producer_tools.common import ToolError
from worker.demo_cache import demo_checkpoint
from worker.scenes import DEFAULT_IMAGE_SIZE, generate_scene
from worker.scenes.request import runtime_request
from worker.uncertainty import uncertainty_block

__all__ = ["CalibrationOptions", "calibrate", "auroc", "spearman", "format_table", "BAD_MIN_ADE_M", "AUROC_BAR",
           "CALIBRATION_SEED0"]

BAD_MIN_ADE_M = 2.0           # a result whose best sample is this far off (mean over waypoints) is a bad label
AUROC_BAR = 0.75              # at BAR_K
BAR_K = 6
CALIBRATION_SEED0 = 900_000
EVAL_TEMPERATURE = 0.6        # the contract's default temperature
CHUNK = 16                    # scenes per runtime batch


@dataclass
class CalibrationOptions:
    out: str = "qualification"
    checkpoint: str | None = None
    device: str | None = None
    scenes: int = 64
    seed: int = 0
    ks: Sequence[int] = (3, 6)
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE
    progress: bool = True
    cache_root: str | None = None
    trajectory_max_new: int | None = None   # reasoning cap (None: the release's 256)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def auroc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """P(score of a positive > score of a negative), ties half (Mann-Whitney); None without both classes."""
    s, y = np.asarray(scores, np.float64), np.asarray(positive, bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    r = _ranks(s)
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (Pearson of average ranks); None when either side is constant."""
    ra, rb = _ranks(np.asarray(a, np.float64)), _ranks(np.asarray(b, np.float64))
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _checkpoint(opts: CalibrationOptions) -> Path:
    if opts.checkpoint:
        return Path(opts.checkpoint)
    return demo_checkpoint()                          # shipped, verified against its manifest


def _summary(k: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    u = [r["uncertainty"] for r in rows]
    ade = [r["min_ade_m"] for r in rows]
    bad = [a > BAD_MIN_ADE_M for a in ade]
    area = auroc(u, bad)
    return {"k": k, "scenes": len(rows), "bad_share": float(np.mean(bad)), "auroc": area,
            "spearman": spearman(u, ade), "mean_uncertainty": float(np.mean(u)),
            "mean_min_ade_m": float(np.mean(ade)),
            "meets_bar": None if k != BAR_K else bool(area is not None and area >= AUROC_BAR)}


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"| K | scenes | minADE > {BAD_MIN_ADE_M:g} m | mean minADE m | mean uncertainty | AUROC | Spearman "
             f"| bar (AUROC >= {AUROC_BAR} at K={BAR_K}) |", "|" + "---|" * 8]
    for r in rows:
        bar = "–" if r["meets_bar"] is None else ("meets" if r["meets_bar"] else "MISSES")
        lines.append(f"| {r['k']} | {r['scenes']} | {100 * r['bad_share']:.0f}% | {r['mean_min_ade_m']:.2f} "
                     f"| {r['mean_uncertainty']:.3f} | {_fmt(r['auroc'], '.3f')} | {_fmt(r['spearman'], '.3f')} "
                     f"| {bar} |")
    return "\n".join(lines)


def calibrate(opts: CalibrationOptions) -> dict[str, Any]:
    """Run the calibration; returns the summary (also written to ``out``)."""
    # torch and the runtime: heavy, loaded only when a calibration runs
    from worker.engine import default_seed
    from worker.model.runtime import AlpamayoRuntime

    if opts.scenes < 2:
        raise ToolError("--scenes must be at least 2 (AUROC compares scenes)")
    if any(k < 2 for k in opts.ks):
        raise ToolError("uncertainty needs K >= 2 samples: use --k values of 2 or more")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = _checkpoint(opts)
    rt = AlpamayoRuntime.load(ckpt, device=opts.device)
    if opts.trajectory_max_new is not None:
        rt.trajectory_max_new = int(opts.trajectory_max_new)
    seeds = [CALIBRATION_SEED0 + opts.seed + i for i in range(opts.scenes)]
    scenes = [generate_scene(s, opts.image_size) for s in seeds]
    per_k: dict[int, list[dict[str, Any]]] = {}
    bar = tqdm(total=len(scenes) * len(opts.ks), unit="scene", desc="calibrate", disable=not opts.progress,
               file=sys.stderr)
    try:
        for k in opts.ks:
            rows = per_k[k] = []
            for start in range(0, len(scenes), CHUNK):
                part = scenes[start:start + CHUNK]
                reqs = []
                for sc in part:
                    rid = f"{sc.scene_id}:trajectory:k{k}"
                    reqs.append(runtime_request(sc, "trajectory", request_id=rid, num_samples=k,
                                                temperature=EVAL_TEMPERATURE, seed=default_seed(rid)))
                for sc, res in zip(part, rt.run(reqs)):
                    if res.error is not None:
                        raise ToolError(f"{res.request_id}: the runtime failed: {res.error[0]}: {res.error[1]}")
                    gt = np.asarray(sc.ego_future_xyz, np.float64)[:, :2]
                    err = np.linalg.norm(np.asarray(res.trajectories, np.float64)[:, :, :2] - gt[None], axis=-1)
                    block = uncertainty_block(res.trajectories, checker_disagreement_m=res.checker_disagreement_m)
                    rows.append({"scene_id": sc.scene_id, "min_ade_m": float(err.mean(axis=1).min()), **block})
                bar.update(len(part))
    finally:
        bar.close()
    summary_rows = [_summary(k, per_k[k]) for k in opts.ks]
    table = format_table(summary_rows)
    meta = {"checkpoint": str(ckpt), "device": str(rt.device), "scenes": len(scenes), "seeds": [seeds[0], seeds[-1]],
            "ks": list(opts.ks), "temperature": EVAL_TEMPERATURE, "bad_min_ade_m": BAD_MIN_ADE_M,
            "auroc_bar": AUROC_BAR, "bar_k": BAR_K}
    md = ["# Uncertainty calibration", "",
          f"Checkpoint `{ckpt}` on {meta['device']}; {len(scenes)} held-out synthetic scenes (seeds {seeds[0]}.."
          f"{seeds[-1]}), trajectory task at temperature {EVAL_TEMPERATURE}. A scene is *bad* when its minADE@K "
          f"exceeds {BAD_MIN_ADE_M:g} m; AUROC: how well `uncertainty` ranks bad scenes above good ones; Spearman: "
          "rank correlation of `uncertainty` and minADE.", "", table, ""]
    (out / "uncertainty_calibration.md").write_text("\n".join(md))
    summary = {"meta": meta, "per_k": summary_rows, "table": table,
               "markdown": str(out / "uncertainty_calibration.md"),
               "scenes": {str(k): v for k, v in per_k.items()}}
    (out / "uncertainty_calibration.json").write_text(json.dumps(summary, indent=1))
    return summary
