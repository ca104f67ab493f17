"""Held-out quality report of the demo checkpoint, measured through the real inference path.

The checkpoint is reloaded from disk with ``AlpamayoRuntime.load`` and held-out synthetic scenes go
through ``run()`` exactly as worker requests do:

* trajectory task, K samples (default 3) at temperature 0.6, one seed per scene:
  - light: share of scenes whose reasoning names the scene's traffic-light state (majority over
    the K samples is not used: every sample counts, ``light_acc`` is over all samples, and
    ``light_acc_first`` over sample 0 only);
  - lead: the same for the lead-vehicle situation (none / stopped / slower / similar / faster);
  - minADE@K / minFDE@K in metres against the planner future (x, y), mean over scenes;
* greedy text tasks, one request per scene each: meta_action (the three meta lines match
  exactly), vqa (answer matches exactly), grounding (box JSON matches exactly; IoU >= 0.5 is
  reported too).

`quality.json` and `bev.png` are written next to the checkpoint.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from worker.scenes import bev_plot
from worker.scenes.request import runtime_frames, runtime_request
from worker.scenes.text import is_wellformed_reasoning

LIGHT_BAR = 0.90      # light state named correctly in >= 90 % of held-out scenes
MIN_ADE_BAR = 1.5     # metres, best of K = 3

_LIGHT_RE = re.compile(r"traffic light ahead is (green|yellow|red)\b")
_NO_LIGHT_RE = re.compile(r"\bno traffic light\b")
_LEAD_RE = [
    ("none", re.compile(r"\bno lead vehicle\b")),
    ("stopped", re.compile(r"lead vehicle is stopped\b")),
    ("slower", re.compile(r"lead vehicle is \d+ meters ahead and slower\b")),
    ("similar", re.compile(r"lead vehicle is \d+ meters ahead at a similar speed\b")),
    ("faster", re.compile(r"lead vehicle is \d+ meters ahead and faster\b")),
]


def light_state_named(text: str) -> str | None:
    """The traffic-light state a reasoning names, in the generator's words (none/green/yellow/red)."""
    m = _LIGHT_RE.search(text)
    if m:
        return m.group(1)
    return "none" if _NO_LIGHT_RE.search(text) else None


def lead_situation_named(text: str) -> str | None:
    """The lead-vehicle situation a reasoning names (none/stopped/slower/similar/faster)."""
    for name, rx in _LEAD_RE:
        if rx.search(text):
            return name
    return None


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _chunks(xs: Sequence, n: int):
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


def evaluate(runtime, scenes: Sequence, k: int = 3, temperature: float = 0.6, text_scenes: int | None = None,
             chunk: int = 16) -> tuple[dict, list[np.ndarray]]:
    """Run held-out scenes through `runtime.run`. -> (metrics dict, predicted xyz (K, 64, 3) per scene)."""
    t0, c0 = time.perf_counter(), time.process_time()
    frames = [runtime_frames(s) for s in scenes]
    light_ok, light_first, lead_ok, ade, fde, preds, failures = [], [], [], [], [], [], []
    wellformed: list[bool] = []
    per_scene: list[dict] = []
    per_state: dict[str, list[int]] = {}
    for part in _chunks(list(range(len(scenes))), chunk):
        reqs = [runtime_request(scenes[i], "trajectory", num_samples=k, temperature=temperature, seed=1000 + i,
                                frames=frames[i]) for i in part]
        for i, res in zip(part, runtime.run(reqs)):
            sc = scenes[i]
            if res.error:
                failures.append(f"{sc.scene_id}: {res.error}")
                preds.append(None)
                continue
            want_light, want_lead = sc.facts.traffic_light, sc.facts.lead_relation
            hits = [light_state_named(t) == want_light for t in res.texts]
            light_ok += hits
            light_first.append(hits[0])
            per_state.setdefault(want_light, []).append(int(hits[0]))
            lead_ok += [lead_situation_named(t) == want_lead for t in res.texts]
            wellformed += [is_wellformed_reasoning(t) for t in res.texts]
            gt = np.asarray(sc.ego_future_xyz, dtype=np.float64)[:, :2]
            err = np.linalg.norm(res.trajectories[:, :, :2].astype(np.float64) - gt[None], axis=-1)   # (K, 64)
            ade.append(float(err.mean(axis=1).min()))
            fde.append(float(err[:, -1].min()))
            preds.append(res.trajectories)
            per_scene.append({"scene_id": sc.scene_id, "light": want_light,
                              "light_named": [light_state_named(t) for t in res.texts], "lead": want_lead,
                              "lead_named": [lead_situation_named(t) for t in res.texts],
                              "min_ade_m": round(ade[-1], 2), "min_fde_m": round(fde[-1], 2)})
    n_text = len(scenes) if text_scenes is None else min(text_scenes, len(scenes))
    text = {}
    for task in ("meta_action", "vqa", "grounding"):
        exact, iou50 = [], []
        for part in _chunks(list(range(n_text)), chunk):
            reqs = [runtime_request(scenes[i], task, temperature=0.0, seed=i,
                                    max_tokens=160 if task == "meta_action" else 64,
                                    frames=None if task == "vqa" else frames[i]) for i in part]
            for i, res in zip(part, runtime.run(reqs)):
                t = scenes[i].text
                if res.error:
                    failures.append(f"{scenes[i].scene_id} {task}: {res.error}")
                    exact.append(False)
                    continue
                out = res.outputs[0]
                if task == "meta_action":
                    exact.append((out.meta_action or "").strip() == t.meta_action)
                elif task == "vqa":
                    exact.append(out.text == t.vqa_answer)
                else:
                    exact.append(out.text == t.grounding_answer)
                    want = json.loads(t.grounding_answer)
                    got = out.boxes or []
                    if want:
                        iou50.append(bool(got) and _iou(got[0]["bbox_2d"], want[0]["bbox_2d"]) >= 0.5)
                    else:
                        iou50.append(not got)
        text[task] = {"exact": round(float(np.mean(exact)), 3) if exact else None, "n": len(exact)}
        if task == "grounding":
            text[task]["box_iou50"] = round(float(np.mean(iou50)), 3) if iou50 else None
    metrics = {
        "scenes": len(scenes), "k": k, "temperature": temperature,
        "light_acc": round(float(np.mean(light_ok)), 3) if light_ok else 0.0,
        "light_acc_first_sample": round(float(np.mean(light_first)), 3) if light_first else 0.0,
        "light_acc_by_state": {s: round(float(np.mean(v)), 3) for s, v in sorted(per_state.items())},
        "lead_acc": round(float(np.mean(lead_ok)), 3) if lead_ok else 0.0,
        "reasoning_wellformed": round(float(np.mean(wellformed)), 3) if wellformed else 0.0,
        "min_ade_m": round(float(np.mean(ade)), 3) if ade else float("nan"),
        "min_fde_m": round(float(np.mean(fde)), 3) if fde else float("nan"),
        "min_ade_median_m": round(float(np.median(ade)), 3) if ade else float("nan"),
        "text": text,
        "failures": failures[:10],
        "per_scene": per_scene,
        "eval_wall_s": round(time.perf_counter() - t0, 1),
        "eval_cpu_s": round(time.process_time() - c0, 1),
    }
    metrics["meets_bars"] = bool(metrics["light_acc"] >= LIGHT_BAR and metrics["min_ade_m"] <= MIN_ADE_BAR)
    return metrics, preds


def format_table(q: dict) -> str:
    """The quality table printed by the build and the CLI."""
    m = q["metrics"] if "metrics" in q else q
    k = m.get("k", 3)
    t = m.get("text", {})
    rows = [
        ("held-out scenes", f"{m['scenes']}", ""),
        ("light state named (all samples)", f"{m['light_acc']:.1%}", f">= {LIGHT_BAR:.0%}"),
        ("light state named (sample 0)", f"{m['light_acc_first_sample']:.1%}", ""),
        ("lead situation named", f"{m['lead_acc']:.1%}", ""),
        (f"minADE@{k} (m)", f"{m['min_ade_m']:.2f}", f"<= {MIN_ADE_BAR}"),
        (f"minFDE@{k} (m)", f"{m['min_fde_m']:.2f}", ""),
    ]
    for task in ("meta_action", "vqa", "grounding"):
        if task in t and t[task]["exact"] is not None:
            rows.append((f"{task} exact match (greedy)", f"{t[task]['exact']:.1%}", ""))
    if t.get("grounding", {}).get("box_iou50") is not None:
        rows.append(("grounding box IoU>=0.5", f"{t['grounding']['box_iou50']:.1%}", ""))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'metric'.ljust(w)}  {'value':>8}  target", "-" * (w + 20)]
    lines += [f"{a.ljust(w)}  {b:>8}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def write_bev(directory: Path, scenes: Sequence, preds: Sequence, n_plot: int = 6) -> Path:
    """bev.png: bird's-eye plots of the first few held-out scenes (history, planner future,
    predicted samples), drawn by `worker.scenes.bev_plot`."""
    pick = [i for i, p in enumerate(preds) if p is not None][:n_plot]
    return bev_plot([scenes[i] for i in pick], [preds[i] for i in pick], Path(directory) / "bev.png",
                    title="demo checkpoint: held-out scenes, baseline profile")


def write_quality(directory: Path, metrics: dict, build: dict) -> dict:
    """quality.json: {"metrics": ..., "build": ...}. Returns the dict."""
    quality = {"metrics": metrics, "build": build}
    (Path(directory) / "quality.json").write_text(json.dumps(quality, indent=1))
    return quality


# ------------------------------------------------------------------ the shipped checkpoint's bars (issue 16)

# key -> (comparison, bar); `measure_bars` measures every key (min_fde_m has no bar)
BARS = {"light_named": (">=", 0.95), "lead_named": (">=", 0.80), "min_ade_m": ("<=", 1.5), "min_fde_m": (None, None),
        "reasoning_wellformed": (">=", 0.95), "mean_acceptance_length_greedy": (">=", 5.0),
        "mean_acceptance_length_t06_k3": (">=", 3.5), "selector_gain": (">=", 0.10)}


def measure_bars(checkpoint: Path, head: Path, scenes: Sequence) -> dict:
    """The demo checkpoint + head on held-out `scenes`, on the CPU in fp32: trajectory quality over
    K=3 samples at T=0.6 (`evaluate`), DFlash2 mean acceptance length greedy (K=1) and at K=3,
    T=0.6, and the selector's gain (greedy acceptance over the same head with W_q zeroed, minus 1)
    with its ceiling (a selector that always picks the baseline's token when it is a candidate)."""
    import torch

    from worker.dflash.loop import DFlash2Speculator
    from worker.dflash.oracle import SelectorCeiling, reference_rows
    from worker.dflash.train import measure_acceptance
    from worker.model.runtime import AlpamayoRuntime

    t0 = time.perf_counter()
    rt = AlpamayoRuntime.load(checkpoint, device="cpu", dtype=torch.float32)
    m, _ = evaluate(rt, scenes, k=3, temperature=0.6, text_scenes=0)
    spec = AlpamayoRuntime.load(checkpoint, device="cpu", dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(head)))

    def acceptance(k: int, temperature: float) -> float:
        reqs = [runtime_request(s, "trajectory", num_samples=k, temperature=temperature, seed=1000 + i)
                for i, s in enumerate(scenes)]
        return measure_acceptance(spec, reqs)["mean_acceptance_length"]

    greedy, sampled = acceptance(1, 0.0), acceptance(3, 0.6)
    # the ceiling of any selector over the draft's top-C: the baseline's own tokens proposed
    # wherever they are all among the candidates (dflash/oracle.py)
    inner = spec.speculator.proposer
    spec.speculator.proposer = SelectorCeiling(inner, reference_rows(rt.run(
        [runtime_request(s, "trajectory", seed=1000 + i) for i, s in enumerate(scenes)])))
    try:
        ceiling = acceptance(1, 0.0)
    finally:
        spec.speculator.proposer = inner
    with torch.no_grad():
        spec.speculator.draft.selector.q_proj.weight.zero_()
    plain = acceptance(1, 0.0)
    return {"scenes": len(scenes), "light_named": m["light_acc"], "lead_named": m["lead_acc"],
            "min_ade_m": m["min_ade_m"], "min_fde_m": m["min_fde_m"], "reasoning_wellformed": m["reasoning_wellformed"],
            "mean_acceptance_length_greedy": round(greedy, 3), "mean_acceptance_length_t06_k3": round(sampled, 3),
            "selector_gain": round(greedy / plain - 1.0, 3), "mean_acceptance_length_greedy_selector_zeroed":
            round(plain, 3), "selector_gain_ceiling": round(ceiling / plain - 1.0, 3),
            "measured_on": "cpu, fp32", "wall_s": round(time.perf_counter() - t0, 1)}


def bars_met(bars: dict) -> dict[str, bool]:
    """key -> whether its bar is met (keys with a bar only)."""
    return {k: (bars[k] >= bar if op == ">=" else bars[k] <= bar) for k, (op, bar) in BARS.items() if op}
