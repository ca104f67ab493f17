"""A perception phase before joint training: many scenes with a lead vehicle, seen through the
two front cameras only, each teacher-forced on the first two sentences of its reasoning (traffic
light, then the lead vehicle's situation), with the recipe's key-word weights.

Why: the lead's situation (stopped / slower / similar / faster than the ego) shows only as 1-2 px
of motion across the 4 frames, which the model must compare across four separate images. A probe
of the demo model's own shape (a 2-block, 128-wide ViT per image, 16 tokens each, then a 4-layer
256-wide transformer over the front cameras' 8 images) trained on that classification alone over
24,000 lead scenes named it in 78% of held-out scenes, after an abrupt rise between its 750th and
2,250th step of 128 scenes (H200, docs/demo-model.md). Joint training shows the model some 25,000
lead-scene sentences in all; this phase shows it hundreds of thousands, at a fraction of a joint
step's cost (8 images a row instead of 24, no expert, two sentences).

The phase trains the VLM with `worker.demo.train.train` over its own examples (task
"perception": no expert rows); its weights can be saved and loaded (`--perception-file`), so a
build may run it in one device call and the joint training in the next."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from worker.demo import train
from worker.model.fast_vision import fast_vision_paths
from worker.model.runtime import AlpamayoRuntime

FRONT_CAMERAS = (1, 6)                # front wide, front tele: the cameras that see the lead
RELATIONS = ("stopped", "slower", "similar", "faster")
_RELATION_WORD = re.compile(r"\b(stopped|slower|similar|faster)\b")
TASK = "perception"


@dataclass(frozen=True)
class PerceptionConfig:
    scenes: int                       # scene seeds drawn (those with a lead vehicle become examples)
    steps: int
    rows: int = 128                   # examples per step
    lr: float = 1e-3
    warmup: int = 100
    heldout: int = 512                # lead scenes of the held-out check (seeds after the training ones)
    budget_s: float | None = None     # stop the phase after this many seconds


def seeds(seed: int, c: PerceptionConfig) -> tuple[list[int], list[int]]:
    """(training, held-out) scene seeds: a range of their own, far from the build's scenes."""
    base = 10_000_000 * (seed + 1)
    return list(range(base, base + c.scenes)), list(range(base + c.scenes, base + c.scenes + 4 * c.heldout))


def scene(seed: int, image_size: tuple[int, int]):
    """The scene of `seed` with only the front cameras rendered."""
    from worker.scenes import generate_scene

    return generate_scene(seed, image_size, cameras=FRONT_CAMERAS)


def target(scene) -> str:
    """The reasoning's first two sentences (light, lead)."""
    (_, _), (_, end) = train._sentence_spans(scene.text.reasoning, 2)
    return scene.text.reasoning[:end]


def build_examples(runtime: AlpamayoRuntime, scenes: Sequence, key_weights: tuple[float, float, float],
                   first_index: int = 0) -> list[train.Example]:
    """One example per scene with a lead vehicle: the trajectory prompt over the front cameras,
    the first two reasoning sentences as target (`train.token_weights`' weights). The example's
    `offset` holds the target index of the situation word's first token (for `situation_accuracy`)."""
    from worker.scenes.request import runtime_frames, runtime_request

    out = []
    for i, scene in enumerate(scenes):
        if scene.facts.lead_relation == "none":
            continue
        if tuple(scene.camera_ids) != FRONT_CAMERAS:
            raise ValueError(f"perception examples take scenes of the front cameras {FRONT_CAMERAS} only "
                             f"(perception.scene), not {scene.camera_ids}")
        frames = runtime_frames(scene)
        p = runtime._prepare(runtime_request(scene, "trajectory", frames=frames))
        text = target(scene)
        ids, w = train.token_weights(runtime.tok, text, "trajectory", key_weights)
        word = _RELATION_WORD.search(text, text.find(". ") + 1)
        offsets = runtime.tok.encode(text, add_special_tokens=False).offsets
        first = next(j for j, (a, b) in enumerate(offsets) if b > word.start())
        t = torch.tensor(ids, dtype=torch.long)
        plen, n = len(p.input_ids), len(t)
        pos = (torch.arange(plen, plen + n) + p.rope_delta).expand(3, n)
        out.append(train.Example(first_index + i, TASK, torch.cat([p.input_ids, t]), torch.cat([p.positions, pos], 1),
                                 p.rope_delta, plen, frames[0], w, None, first))
    return out


@torch.no_grad()
def situation_accuracy(model, runtime: AlpamayoRuntime, examples: Sequence[train.Example],
                       batch: int = 64) -> tuple[float, list[float]]:
    """Teacher-forced: the share of examples whose situation word's first token is the model's
    argmax, overall and per true situation (RELATIONS order)."""
    was = model.training
    model.eval()
    right, truth = [], []
    with fast_vision_paths(model):
        for i in range(0, len(examples), batch):
            part = examples[i:i + batch]
            b = train.collate(part, runtime)
            h = model.vlm.model(input_ids=b.input_ids, pixel_values=b.pixel_values, image_grid_thw=b.grid,
                                position_ids=b.positions).last_hidden_state
            at = torch.tensor([e.prompt_len + e.offset - 1 for e in part], device=h.device)
            pred = model.lm_head(h[torch.arange(len(part), device=h.device), at]).argmax(-1)
            want = torch.stack([e.input_ids[e.prompt_len + e.offset] for e in part]).to(h.device)
            right += (pred == want).tolist()
            words = [runtime.tok.decode([int(e.input_ids[e.prompt_len + e.offset])]).strip() for e in part]
            truth += [next((k for k, r in enumerate(RELATIONS) if r.startswith(w) and w), -1) for w in words]
    model.train(was)
    right_a, truth_a = np.array(right), np.array(truth)
    per = [float(right_a[truth_a == k].mean()) if (truth_a == k).any() else float("nan") for k in range(len(RELATIONS))]
    return float(right_a.mean()), per


def run(model, runtime: AlpamayoRuntime, examples: Sequence[train.Example], heldout: Sequence[train.Example],
        c: PerceptionConfig, key_weights: tuple[float, float, float], seed: int,
        log: Callable[[str], None] | None = None) -> dict:
    """The phase: `train.train` over `examples` (c.rows a step, warm-up + cosine at c.lr), the
    held-out situation accuracy every quarter of the steps and at the end. -> summary."""
    tc = train.TrainConfig(steps=c.steps, lr=c.lr, warmup=c.warmup, key_weights=key_weights,
                           per_step=((TASK, c.rows),), groups=((TASK,),), timed_steps=3)
    checks = []

    def check(step: int) -> None:
        if (step + 1) % max(1, c.steps // 4) == 0:
            acc, per = situation_accuracy(model, runtime, heldout)
            checks.append({"step": step + 1, "accuracy": round(acc, 3), "per_situation": [round(p, 3) for p in per]})
            if log:
                log(f"perception step {step + 1}: held-out situation accuracy {acc:.3f} "
                    f"(stopped/slower/similar/faster {', '.join(f'{p:.2f}' for p in per)})")

    summary = train.train(model, runtime, examples, tc, seed=seed, log=log, callback=check, budget_s=c.budget_s)
    acc, per = situation_accuracy(model, runtime, heldout)
    return {**summary, "examples": len(examples), "heldout": len(heldout), "checks": checks,
            "final_accuracy": round(acc, 3), "final_per_situation": [round(p, 3) for p in per]}
