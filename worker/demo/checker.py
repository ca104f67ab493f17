"""Training the demo checkpoint's independent checker (`worker.model.checker`) on synthetic scenes.

    python -m worker.demo.checker --out CHECKPOINT/checker [--scenes 9000 --epochs 4 --seed 0]

The checker learns the scene's 6.4 s trajectory (ADE loss, metres) and, as a training aid, the
scene facts the VLM most often misreads (lead vehicle state, a crossing pedestrian, a blocked
lane, the traffic light), from its cameras' frames and the ego history. Its scenes are seeds
`CHECKER_SEED0 + seed * 100_000 + i`: disjoint from the VLM's training scenes and from the
calibration scenes of `alpamayo-producer qualify --uncertainty`. Deterministic from `seed` at a
fixed thread count. Measured on the 2-core CPU machine: 9,000 scenes, 4 epochs, 1,056 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from worker.model.checker import CheckerConfig, SceneChecker, checker_inputs, save_checker
from worker.scenes import generate_scene
from worker.scenes.request import runtime_frames

CHECKER_SEED0 = 5_000_000
IMAGE_SIZE = (64, 64)
FACT_VALUES = {"lead": ("none", "stopped", "slower", "similar", "faster"), "pedestrian": ("no", "yes"),
               "blocked": ("none", "adjacent", "ego"), "light": ("none", "green", "red", "yellow")}
TRAJ_LOSS_WEIGHT = 0.2


def fact_labels(facts) -> list[int]:
    """A scene's facts -> one class index per FACT_VALUES entry."""
    if not facts.lead_present:
        lead = "none"
    elif facts.lead_speed < 0.5:
        lead = "stopped"
    else:
        lead = ("slower" if facts.lead_speed < facts.ego_speed - 1 else
                "faster" if facts.lead_speed > facts.ego_speed + 1 else "similar")
    blocked = "none" if not facts.blocked_lane else "ego" if facts.blocked_lane_kind == "ego" else "adjacent"
    values = {"lead": lead, "pedestrian": "yes" if facts.pedestrian_crossing else "no", "blocked": blocked,
              "light": facts.traffic_light or "none"}
    return [FACT_VALUES[k].index(values[k]) for k in FACT_VALUES]


def scene_arrays(cfg: CheckerConfig, seeds) -> dict[str, np.ndarray]:
    """-> frames (N, C*F, S, S, 3) uint8, history (N, 16, 3), future (N, W, 2), facts (N, 4)."""
    xs, hs, fs, ys = [], [], [], []
    for s in seeds:
        sc = generate_scene(int(s), IMAGE_SIZE)
        frames, cams = runtime_frames(sc)
        x, h = checker_inputs(cfg, frames, cams, len(sc.frame_offsets_s), sc.ego_history_xyz)
        xs.append(x[0].numpy())
        hs.append(h[0].numpy())
        fs.append(np.asarray(sc.ego_future_xyz, np.float32)[:, :2])
        ys.append(fact_labels(sc.facts))
    return {"frames": np.stack(xs), "history": np.stack(hs), "future": np.stack(fs), "facts": np.asarray(ys)}


def train_checker(out: str | Path, *, scenes: int = 9000, epochs: int = 4, batch: int = 64, seed: int = 0,
                  threads: int = 2, lr: float = 3e-3, log=print) -> dict:
    """Train and save a checker under `out`; -> its held-out figures (the last 10% of the scenes)."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    cfg = CheckerConfig()
    t0 = time.perf_counter()
    data = scene_arrays(cfg, range(CHECKER_SEED0 + seed * 100_000, CHECKER_SEED0 + seed * 100_000 + scenes))
    log(f"checker: {scenes} scenes in {time.perf_counter() - t0:.0f}s")
    held = max(1, scenes // 10)
    train_idx, held_idx = np.arange(scenes - held), np.arange(scenes - held, scenes)
    model = SceneChecker(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr, weight_decay=1e-4)   # OneCycleLR sets the rates
    steps = epochs * -(-len(train_idx) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps)
    t = {k: torch.from_numpy(v) for k, v in data.items()}
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        model.train()
        order = rng.permutation(train_idx)
        for i in range(0, len(order), batch):
            b = torch.from_numpy(order[i:i + batch])
            traj, logits = model(t["frames"][b], t["history"][b])
            loss = TRAJ_LOSS_WEIGHT * (traj - t["future"][b]).norm(dim=-1).mean()
            loss = loss + sum(F.cross_entropy(lg, t["facts"][b, j]) for j, lg in enumerate(logits))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        figures = evaluate(model, {k: v[held_idx] for k, v in t.items()})
        log(f"checker: epoch {epoch + 1}/{epochs} {time.perf_counter() - t0:.0f}s held-out {figures}")
    model.cfg = dataclasses.replace(cfg, heldout_ade_m=figures["ade_m"])
    save_checker(model.eval(), out)
    return figures


@torch.no_grad()
def evaluate(model: SceneChecker, t: dict[str, torch.Tensor]) -> dict:
    model.eval()
    traj, logits = model(t["frames"], t["history"])
    out = {"ade_m": round(float((traj - t["future"]).norm(dim=-1).mean()), 3)}
    for j, name in enumerate(FACT_VALUES):
        out[f"{name}_accuracy"] = round(float((logits[j].argmax(1) == t["facts"][:, j]).float().mean()), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.demo.checker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory to write (a checkpoint's checker/)")
    ap.add_argument("--scenes", type=int, default=9000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    train_checker(a.out, scenes=a.scenes, epochs=a.epochs, seed=a.seed, threads=a.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
