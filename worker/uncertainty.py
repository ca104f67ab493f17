"""How much a result's K samples disagree, and one scalar ``uncertainty`` in [0, 1] from it.

Computed per result with K >= 2 (a single sample cannot disagree with itself) from what the
result already carries, so the worker (``worker.engine``) and a lake reader
(``alpamayo-producer review``) get the same numbers. Pure numpy.

Components (each absent when the result has nothing to compare):

* ``trajectory_spread_m``: mean over sample pairs of the pair's ADE (mean distance of the two
  trajectories over the 64 waypoints, x/y only), metres. Trajectory results.
* ``endpoint_spread_m``: mean over sample pairs of the distance between their 6.4 s endpoints
  (x/y), metres. Trajectory results.
* ``lateral_spread_m``: mean over sample pairs and waypoints of the pair's sideways distance
  (|y| difference in the t0 ego frame, y = left), metres. Trajectory results.
* ``meta_action_agreement``: over the three meta-action fields (longitudinal, lateral, lane),
  the mean share of sample pairs whose field is identical (1 = all samples agree). meta_action.
* ``auto_label_agreement``: over the four auto-label fields, the mean over sample pairs of the
  word-set Jaccard similarity of the field's text (1 = identical words; two absent fields agree,
  an absent one and a present one do not). auto_labeling.
* ``checker_disagreement_m``: mean over the K samples of the ADE (x/y, metres) between the sample
  and the trajectory of the checkpoint's independent checker (``worker.model.checker``), beyond
  the checker's own held-out ADE (its config's ``heldout_ade_m``; 0 when within it), when the
  checkpoint has one. Trajectory results.

The scalar combines the components like independent alarms (a noisy OR)::

    u_traj  = 1 - exp(-lateral_spread_m / LATERAL_SPREAD_SCALE_M)
    u_meta  = 1 - meta_action_agreement
    u_label = 1 - auto_label_agreement
    u_check = 1 - exp(-checker_disagreement_m / CHECKER_SCALE_M)
    uncertainty = 1 - (1 - u_traj) * (1 - u_meta) * (1 - u_label) * (1 - u_check)   (absent terms: 0)

so it is 0 when the samples agree, grows with each kind of disagreement and stays below 1.

Why the lateral spread: samples that disagree about *where* to drive (which side, which lane)
mean the scene was not understood; samples that disagree about *how fast* mostly cover the
speed the planner may choose, and a wide along-track spread even helps best-of-K (minADE).
On 192 development scenes of the demo checkpoint (seeds 800,000..800,191, not the calibration
set of ``qualify --uncertainty``) at K = 6, the AUROC for "minADE > 2 m" was 0.78 for the
lateral spread, 0.59 for the pairwise ADE and 0.50 for the along-track spread alone. Nothing
here depends on that checkpoint's error level: samples that agree score 0 whatever the model.
The scale puts a lateral spread of half a lane width (1.75 m: samples in different lanes) at
1 - 1/e = 0.63.

Why the checker term: the worst misses are confident (all K samples share one misreading of
the scene), so no spread reveals them; a second model that reads the pixels on its own does
(docs/uncertainty.md: AUROC 0.79-0.80 for "minADE > 2 m" on three held-out ranges of the demo
checkpoint at K = 6, against 0.50-0.64 for the spread). 2 m puts a checker that disagrees by
2 m more than its own typical error above 1 - 1/e. Subtracting that error (2.35 m for the demo's
checker) changes the ranking little and halves the share of results above 0.5 (docs/uncertainty.md).
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["LATERAL_SPREAD_SCALE_M", "CHECKER_SCALE_M", "META_ACTION_FIELDS", "AUTO_LABEL_FIELDS",
           "uncertainty_block", "trajectory_spread", "checker_disagreement", "field_agreement", "text_agreement"]

LATERAL_SPREAD_SCALE_M = 1.75
"""Metres of lateral spread (half a 3.5 m lane) at which the trajectory term reaches 1 - 1/e."""
CHECKER_SCALE_M = 2.0
"""Metres of checker disagreement at which the checker term reaches 1 - 1/e."""
META_ACTION_FIELDS = ("longitudinal", "lateral", "lane")
AUTO_LABEL_FIELDS = ("critical_components_analysis", "ego_vehicle_motion_analysis", "trajectory_analysis",
                     "chain_of_causation")


def trajectory_spread(trajectories: Any) -> tuple[float, float, float]:
    """(mean pairwise ADE, mean pairwise endpoint distance, mean pairwise lateral distance) in
    metres of K >= 2 trajectories shaped (K, T, >= 2) in the t0 ego frame; x/y only."""
    xy = np.asarray(trajectories, dtype=np.float64)[:, :, :2]
    i, j = np.triu_indices(len(xy), k=1)
    d = xy[i] - xy[j]                                                 # (pairs, T, 2)
    dist = np.linalg.norm(d, axis=-1)
    return float(dist.mean()), float(dist[:, -1].mean()), float(np.abs(d[..., 1]).mean())


def checker_disagreement(checker_trajectory: Any, trajectories: Any, checker_ade_m: float = 0.0) -> float:
    """Mean over the K samples (K, T, >= 2) of the ADE (x/y, metres) between the sample and the
    checker's trajectory (T, >= 2), beyond the checker's own held-out ADE ``checker_ade_m`` (>= 0)."""
    c = np.asarray(checker_trajectory, dtype=np.float64)[None, :, :2]
    xy = np.asarray(trajectories, dtype=np.float64)[:, :, :2]
    return max(0.0, float(np.linalg.norm(xy - c, axis=-1).mean()) - float(checker_ade_m))


def field_agreement(values: Sequence[Any]) -> float:
    """Share of pairs of ``values`` that are identical."""
    pairs = list(combinations(values, 2))
    return sum(a == b for a, b in pairs) / len(pairs)


def _jaccard(a: str | None, b: str | None) -> float:
    if a is None or b is None:
        return float(a is None and b is None)
    wa, wb = set(a.lower().split()), set(b.lower().split())
    return 1.0 if not (wa or wb) else len(wa & wb) / len(wa | wb)


def text_agreement(values: Sequence[str | None]) -> float:
    """Mean word-set Jaccard similarity over pairs of ``values``."""
    pairs = list(combinations(values, 2))
    return sum(_jaccard(a, b) for a, b in pairs) / len(pairs)


def _fields(samples: Sequence[Mapping[str, Any] | None] | None, names: tuple[str, ...]) -> list[list] | None:
    """Per field, its value in every sample; None when no sample has the structure."""
    if not samples or all(s is None for s in samples):
        return None
    return [[(s or {}).get(n) for s in samples] for n in names]


def uncertainty_block(trajectories: Any = None, meta_actions: Sequence[Mapping[str, Any] | None] | None = None,
                      auto_labels: Sequence[Mapping[str, Any] | None] | None = None,
                      checker_disagreement_m: float | None = None) -> dict[str, float] | None:
    """The fields of ``schemas.Uncertainty`` for one result's K samples: ``trajectories``
    (K, T, >= 2) or None, per sample its meta action / auto label as a mapping (or None), and the
    checker's disagreement (``checker_disagreement``; a lake reader passes the stored column).
    None when K < 2 or there is nothing to compare."""
    out: dict[str, float] = {}
    keep = 1.0                                  # product of (1 - u) over the terms present
    if trajectories is not None and len(trajectories) >= 2:
        ade, fde, lateral = trajectory_spread(trajectories)
        out["trajectory_spread_m"], out["endpoint_spread_m"], out["lateral_spread_m"] = ade, fde, lateral
        keep *= math.exp(-lateral / LATERAL_SPREAD_SCALE_M)
        if checker_disagreement_m is not None:
            out["checker_disagreement_m"] = float(checker_disagreement_m)
            keep *= math.exp(-float(checker_disagreement_m) / CHECKER_SCALE_M)
    meta = _fields(meta_actions, META_ACTION_FIELDS)
    if meta is not None and len(meta[0]) >= 2:
        out["meta_action_agreement"] = float(np.mean([field_agreement(v) for v in meta]))
        keep *= out["meta_action_agreement"]
    labels = _fields(auto_labels, AUTO_LABEL_FIELDS)
    if labels is not None and len(labels[0]) >= 2:
        out["auto_label_agreement"] = float(np.mean([text_agreement(v) for v in labels]))
        keep *= out["auto_label_agreement"]
    if not out:
        return None
    out["uncertainty"] = min(1.0, max(0.0, 1.0 - keep))
    return out
