"""Joint teacher-forced training of the demo model on synthetic scenes (VLM + action expert).

The training data pipeline turns a synthetic scene (``worker.scenes.Scene``) into one
example per task. The prompt of each example is built by the runtime itself
(``AlpamayoRuntime._prepare`` on a ``SceneRequest``), so training sees exactly the token ids,
3-D rotary positions and pixel grids inference sees; the assistant target follows it:

    trajectory     reasoning + <|traj_future_start|>
    meta_action    reasoning + "\\n" + the three meta lines + <|traj_future_start|>
    auto_labeling  the four-key JSON + <|im_end|>
    vqa            the answer + <|im_end|>          (VQA camera profile)
    grounding      the box JSON + <|im_end|>

One step: a fixed number of examples of each task, in micro-batches of similar lengths
(trajectory + meta_action, vqa + grounding, auto_labeling), each right-padded to one length
(causal attention makes right padding harmless); per micro-batch one forward of
``model.vlm.model`` with the 3-D positions and ``use_cache=True``, weighted cross-entropy of
``model.lm_head`` on the target tokens only (see `token_weights`), and for the
trajectory rows the flow-matching loss of the action expert: x1 = the normalised planner action,
noise eps, t ~ 0.999 (1 - Beta(1.5, 1)), x_t = t x1 + (1 - t) eps, target v = x1 - eps,
predicted by ``ActionExpert.velocity`` over the forward's own K/V (stacked, with gradients, so
the VLM co-trains) up to and including ``<|traj_future_start|>``.

Choices that make a tiny model learn in about two CPU-minutes (all documented where they live):
per-token loss weights on the fact-bearing words of the reasoning (traffic-light state, lead
vehicle), smooth initialisation of the trajectory-bin embeddings and of three colour channels of
the vision patch embedding, separate gradient clipping of VLM and expert, exact batched forwards
for the vision tower during training, and a final expert-only refinement over the trained VLM's
K/V (`refine_expert`), which buys many more flow-matching samples per second than joint steps.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from schemas import TASKS
from worker.demo.resume import ResumeFile
from worker.model.fast_vision import fast_vision_paths
from worker.model.action_space import UnicycleActionSpaceConfig, trajectory_to_action
from worker.model.expert import ActionExpert
from worker.model.fused_ops import reference_only
from worker.model.runtime import AlpamayoRuntime
from worker.model.text_tasks import IM_END, TRAJ_FUTURE_START
from worker.scenes.request import runtime_frames, runtime_request


# ------------------------------------------------------------------ targets

def target_text(scene, task: str) -> str:
    """The assistant turn the model is trained to produce, with its terminal token."""
    t = scene.text
    if task == "trajectory":
        return t.reasoning + TRAJ_FUTURE_START
    if task == "meta_action":
        return t.reasoning + "\n" + t.meta_action + TRAJ_FUTURE_START
    if task == "auto_labeling":
        return t.auto_labeling + IM_END
    if task == "vqa":
        return t.vqa_answer + IM_END
    if task == "grounding":
        return t.grounding_answer + IM_END
    raise ValueError(f"unknown task {task!r}")


def corpus_texts(scenes) -> list[str]:
    """Texts of all five tasks (the tokenizer's training corpus, with the prompt strings)."""
    out = []
    for s in scenes:
        t = s.text
        out += [t.reasoning, t.meta_action, t.auto_labeling, t.vqa_question, t.vqa_answer,
                t.grounding_question, t.grounding_answer]
    return out


# ------------------------------------------------------------------ planner actions

def _traj_tensors(scenes):
    as_t = lambda x: torch.as_tensor(np.asarray(x, dtype=np.float32))  # noqa: E731
    return (torch.stack([as_t(s.ego_history_xyz) for s in scenes]),
            torch.stack([as_t(s.ego_history_rot) for s in scenes]),
            torch.stack([as_t(s.ego_future_xyz) for s in scenes]),
            torch.stack([as_t(s.ego_future_rot) for s in scenes]))


def planner_actions(scenes, cfg: UnicycleActionSpaceConfig) -> torch.Tensor:
    """Normalised (accel, curvature) of the planner futures. -> (N, 64, 2) fp32."""
    return trajectory_to_action(*_traj_tensors(scenes), cfg)


def fit_action_normalisation(scenes) -> dict[str, float]:
    """accel/curvature mean and std of the planner futures (for `action_space_cfg`)."""
    unit = UnicycleActionSpaceConfig(accel_mean=0.0, accel_std=1.0, curvature_mean=0.0, curvature_std=1.0)
    phys = planner_actions(scenes, unit).double()
    a, k = phys[..., 0], phys[..., 1]
    return {"accel_mean": float(a.mean()), "accel_std": float(a.std()),
            "curvature_mean": float(k.mean()), "curvature_std": float(k.std())}


# ------------------------------------------------------------------ examples

@dataclass
class Example:
    """One teacher-forced sequence: prompt (as inference builds it) + assistant target."""

    scene_index: int
    task: str
    input_ids: torch.Tensor      # (L,) long
    positions: torch.Tensor      # (3, L) long
    rope_delta: int
    prompt_len: int
    frames: np.ndarray           # (N_img, H, W, 3) uint8 (shared between the tasks of one profile)
    weights: torch.Tensor        # (L - prompt_len,) loss weight of each target token
    action: torch.Tensor | None  # (64, 2) normalised planner action (trajectory only)
    offset: int | None           # index of <|traj_future_start|> + 1 (trajectory only)

    @property
    def target_ids(self) -> torch.Tensor:
        return self.input_ids[self.prompt_len:]


def _sentence_spans(text: str, n: int) -> list[tuple[int, int]]:
    """Character spans of the first n sentences (". " separated) of a reasoning."""
    spans, start = [], 0
    for _ in range(n):
        end = text.find(". ", start)
        end = len(text) if end < 0 else end + 1
        spans.append((start, end))
        start = end + 1
    return spans


# The words of the first two reasoning sentences that carry the scene's facts (the rest of each
# sentence follows from them): traffic-light state, then the lead-vehicle situation, then its gap.
_KEY_WORDS = (re.compile(r"^\s*(There|The)\b|\b(no|red|green|yellow|and|but)\b"),
              re.compile(r"^\s*(There|The)\b|\b(no|stopped|slower|similar|faster)\b"),
              re.compile(r"\b\d+\b"))


def token_weights(tok, text: str, task: str,
                  key_weights: tuple[float, float, float]) -> tuple[list[int], torch.Tensor]:
    """Target ids and their loss weights. In trajectory/meta_action reasonings the tokens of the
    fact-bearing words of the first sentence (the traffic light) weigh key_weights[0], the lead
    vehicle's situation words in the second key_weights[1] and its gap's digits key_weights[2];
    the meta-action lines and grounding answers (short, all facts) weigh key_weights[2] too;
    every other token weighs 1."""
    enc = tok.encode(text, add_special_tokens=False)
    w = torch.ones(len(enc.ids))

    def weigh(a: int, b: int, wk: float) -> None:
        for j, (ta, tb) in enumerate(enc.offsets):
            if ta < b and tb > a:
                w[j] = max(float(w[j]), wk)

    if task in ("trajectory", "meta_action"):
        (light, lead) = _sentence_spans(text, 2)
        for (lo, hi), wk, rx in zip((light, lead, lead), key_weights, _KEY_WORDS):
            for m in rx.finditer(text[lo:hi]):
                weigh(lo + m.start(), lo + m.end(), wk)
    if task == "meta_action":
        start = text.find("\nLongitudinal:")
        if start >= 0:
            weigh(start, len(text), key_weights[2])
    if task == "grounding":
        weigh(0, len(text), key_weights[2])
    return enc.ids, w


def build_examples(runtime: AlpamayoRuntime, scenes: Sequence, tasks: Sequence[str] = TASKS,
                   actions: torch.Tensor | None = None,
                   key_weights: tuple[float, float, float] = (1.0, 1.0, 1.0), first_index: int = 0) -> list[Example]:
    """Examples for every (scene, task), in scene-major order (scene_index counts from
    first_index). Pure function of its inputs."""
    tok, ids = runtime.tok, runtime.ids
    if actions is None and "trajectory" in tasks:
        actions = planner_actions(scenes, runtime.cfg.action_space)
    out: list[Example] = []
    for i, scene in enumerate(scenes):
        drive = runtime_frames(scene)
        vqa = runtime_frames(scene, vqa=True) if "vqa" in tasks else None
        for task in tasks:
            frames = vqa if task == "vqa" else drive
            p = runtime._prepare(runtime_request(scene, task, frames=frames))
            target_ids, weights = token_weights(tok, target_text(scene, task), task, key_weights)
            target = torch.tensor(target_ids, dtype=torch.long)
            plen, n = len(p.input_ids), len(target)
            text_pos = (torch.arange(plen, plen + n) + p.rope_delta).expand(3, n)
            offset = None
            if task == "trajectory":
                hit = (target == ids.traj_future_start).nonzero().flatten()
                offset = plen + int(hit[0]) + 1
            out.append(Example(first_index + i, task, torch.cat([p.input_ids, target]),
                               torch.cat([p.positions, text_pos], dim=1), p.rope_delta, plen, frames[0], weights,
                               actions[i].clone() if task == "trajectory" else None, offset))
    return out


# ------------------------------------------------------------------ training

@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    expert_weight: float = 1.0
    expert_repeats: int = 4              # noise draws per trajectory row and step
    kv_grad_scale: float = 1.0           # share of the expert's gradient that flows into the VLM's K/V
    key_weights: tuple[float, float, float] = (10.0, 3.0, 3.0)  # light, lead situation, gap digits (token_weights)
    lead_repeats: int = 1                # trajectory / meta_action examples of scenes with a lead vehicle, per epoch
    # examples of each task per step; rows of one group share a forward (similar lengths)
    per_step: tuple[tuple[str, int], ...] = (
        ("trajectory", 5), ("meta_action", 2), ("vqa", 2), ("grounding", 2), ("auto_labeling", 1))
    groups: tuple[tuple[str, ...], ...] = (("trajectory", "meta_action"), ("vqa", "grounding"), ("auto_labeling",))
    timed_steps: int = 5                 # CUDA only: the first steps log where their time went (synchronised)


def lr_at(step: int, c: TrainConfig) -> float:
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    u = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, u))))


def sample_flow_t(n: int) -> torch.Tensor:
    """t ~ 0.999 * (1 - Beta(1.5, 1)) (global torch RNG)."""
    return 0.999 * (1 - torch.distributions.Beta(1.5, 1.0).sample((n,)))


def init_bin_embeddings(model, token_ids, std: float = 0.02, max_freq: float = 32.0) -> None:
    """Initialise the `<i0..i3999>` trajectory-bin embeddings as smooth functions of the bin value
    u in [0, 1]: a constant, a linear ramp (u - 1/2) and low-frequency sin/cos of u, mixed by a
    fixed random rotation. Neighbouring bins start close, RMSNorm keeps the ramp nearly linear,
    and averages over tokens stay readable, so the tiny model reads history deltas as numbers
    from few scenes. Only the starting point changes; the embeddings train like every weight."""
    emb = model.vlm.model.language_model.embed_tokens.weight
    hidden = emb.shape[1]
    gen = torch.Generator().manual_seed(1234)
    mix = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen))[0]
    n_freq = (hidden - 2) // 2
    with torch.no_grad():
        for start, count in ((token_ids.history_id0, 1000), (token_ids.future_id0, 3000)):
            u = torch.arange(count, dtype=torch.float32) / (count - 1)
            ang = math.pi * u[:, None] * torch.logspace(0, math.log10(max_freq), n_freq)[None]
            feats = torch.cat([torch.full((count, 1), 2.0), 8.0 * (u[:, None] - 0.5), ang.sin(), ang.cos()], dim=1)
            feats = torch.nn.functional.pad(feats, (0, hidden - feats.shape[1]))
            feats = feats * (std * math.sqrt(hidden) / feats.norm(dim=1).mean())
            emb[start:start + count] = (feats @ mix).to(emb.dtype)


def init_patch_colour_means(model, scale: float = 1.0) -> None:
    """Let the first three channels of the vision patch embedding start as the patch's mean R, G
    and B (the traffic-light lamp is a large saturated blob; colour is what tells its state).
    Only the starting point changes; the weights are trained like every other weight."""
    w = model.vlm.model.visual.patch_embed.proj.weight            # (out, 3, T, P, P)
    with torch.no_grad():
        n = w[0, 0].numel()
        for c in range(3):
            w[c].zero_()
            w[c, c] = scale / n


class _Batch(SimpleNamespace):
    pass


def collate(examples: Sequence[Example], runtime: AlpamayoRuntime) -> _Batch:
    """Right-pad to one length (causal attention: padding after a row never reaches it); labels
    -100 and weight 0 outside the targets; pixel values of every row's images in order."""
    pad = runtime.ids.pad
    L = max(len(e.input_ids) for e in examples)
    b = len(examples)
    input_ids = torch.full((b, L), pad, dtype=torch.long)
    positions = torch.zeros(3, b, L, dtype=torch.long)
    labels = torch.full((b, L), -100, dtype=torch.long)
    weights = torch.zeros(b, L)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[r, :n] = e.input_ids
        positions[:, r, :n] = e.positions
        if n < L:
            positions[:, r, n:] = e.positions[:, -1:] + torch.arange(1, L - n + 1)
        labels[r, e.prompt_len:n] = e.input_ids[e.prompt_len:]
        weights[r, e.prompt_len:n] = e.weights
    # every row's images in one call (each image is processed on its own: batching is exact)
    dev = runtime.device
    pixel_values, grid = runtime.image_proc(torch.from_numpy(np.concatenate([e.frames for e in examples])).to(dev))
    traj = [r for r, e in enumerate(examples) if e.task == "trajectory"]
    return _Batch(input_ids=input_ids.to(dev), positions=positions.to(dev), labels=labels.to(dev),
                  weights=weights.to(dev), pixel_values=pixel_values, grid=grid.to(dev), traj_rows=traj,
                  actions=torch.stack([examples[r].action for r in traj]).to(dev) if traj else None,
                  offsets=torch.tensor([examples[r].offset for r in traj], dtype=torch.long, device=dev),
                  rope_delta=torch.tensor([examples[r].rope_delta for r in traj], dtype=torch.long, device=dev))


def _grad_scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the forward; its gradient multiplied by `scale` in the backward."""
    if scale == 1.0:
        return x
    d = x.detach()
    return d + scale * (x - d)


def _stacked_cache(cache, rows: list[int], grad_scale: float = 1.0) -> SimpleNamespace:
    """The forward's per-layer K/V (B, Hkv, L, D) stacked to (layers, rows, Hkv, L, D), with
    gradients (scaled by grad_scale) into the VLM."""
    k = torch.stack([layer.keys[rows] for layer in cache.layers])
    v = torch.stack([layer.values[rows] for layer in cache.layers])
    return SimpleNamespace(k=_grad_scaled(k, grad_scale), v=_grad_scaled(v, grad_scale))


def loss_on_batch(model, expert: ActionExpert, batch: _Batch, c: TrainConfig, weight_total: float,
                  traj_total: int) -> tuple[torch.Tensor, dict]:
    """Weighted CE summed over this micro-batch's target tokens / weight_total, plus the flow
    loss of its trajectory rows scaled by their share of the step's trajectory rows."""
    out = model.vlm.model(input_ids=batch.input_ids, pixel_values=batch.pixel_values,
                          image_grid_thw=batch.grid, position_ids=batch.positions, use_cache=True)
    h = out.last_hidden_state                                       # (B, L, H)
    tgt = batch.labels[:, 1:]
    sel = tgt != -100
    logits = model.lm_head(h[:, :-1][sel]).float()
    ce_tok = F.cross_entropy(logits, tgt[sel], reduction="none")
    w = batch.weights[:, 1:][sel]
    loss = (ce_tok * w).sum() / weight_total
    stats = {"ce_sum": float((ce_tok.detach() * w).sum()), "w_sum": float(w.sum())}
    if batch.traj_rows:
        cache = out["cache"] if "cache" in out.keys() else out["past_key_values"]
        rep = c.expert_repeats
        rows = [r for r in batch.traj_rows for _ in range(rep)]
        kv = _stacked_cache(cache, rows, c.kv_grad_scale)
        x1 = batch.actions.repeat_interleave(rep, 0)
        eps = torch.randn_like(x1)
        t = sample_flow_t(len(rows)).to(x1.device).view(-1, 1, 1)
        xt = t * x1 + (1 - t) * eps
        offset = batch.offsets.repeat_interleave(rep)
        v = expert.velocity(xt, t, kv, offset, batch.rope_delta.repeat_interleave(rep), int(offset.max()))
        fm = F.mse_loss(v, x1 - eps)
        loss = loss + c.expert_weight * fm * (len(batch.traj_rows) / traj_total)
        stats["flow"] = fm.item()
    return loss, stats


class _PhaseClock:
    """Wall time per phase of the first `steps` steps (CUDA synchronised at each mark), for the log."""

    def __init__(self, device: torch.device, steps: int):
        self.on = device.type == "cuda" and steps > 0
        self.steps, self.totals, self.t = steps, {}, 0.0

    def start(self, step: int) -> None:
        self.on = self.on and step < self.steps
        if self.on:
            torch.cuda.synchronize()
            self.t = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.on:
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.totals[phase] = self.totals.get(phase, 0.0) + now - self.t
            self.t = now

    def summary(self) -> str:
        return ", ".join(f"{k} {1000 * v / self.steps:.0f} ms" for k, v in self.totals.items())


class _Sampler:
    """Per-task epochs without replacement (numpy Generator); each step takes `per_step[task]`
    examples of each task, split into the micro-batches of `groups`. An epoch holds the
    trajectory and meta_action examples of scenes with a lead vehicle `lead_repeats` times."""

    def __init__(self, examples: Sequence[Example], c: TrainConfig, seed: int,
                 scene_has_lead: Sequence[bool] | None = None):
        self.rng = np.random.default_rng([seed, 7])
        self.by_task: dict[str, list[int]] = {}
        for i, e in enumerate(examples):
            lead = scene_has_lead is not None and scene_has_lead[e.scene_index]
            times = c.lead_repeats if lead and e.task in ("trajectory", "meta_action") else 1
            self.by_task.setdefault(e.task, []).extend([i] * times)
        self.counts = {t: n for t, n in c.per_step if t in self.by_task and n > 0}
        self.groups = [[t for t in g if t in self.counts] for g in c.groups]
        self.groups = [g for g in self.groups if g]
        self.queues: dict[str, list[int]] = {t: [] for t in self.counts}

    def _take(self, task: str) -> list[int]:
        q, out = self.queues[task], []
        for _ in range(self.counts[task]):
            if not q:
                q.extend(self.rng.permutation(self.by_task[task]).tolist())
            out.append(q.pop())
        return out

    def step(self) -> list[list[int]]:
        return [[i for t in g for i in self._take(t)] for g in self.groups]


def train(model, runtime: AlpamayoRuntime, examples: Sequence[Example], c: TrainConfig, seed: int = 0,
          log: Callable[[str], None] | None = None, callback: Callable[[int], None] | None = None,
          budget_s: float | None = None, scene_has_lead: Sequence[bool] | None = None,
          resume: ResumeFile | None = None) -> dict:
    """AdamW with warm-up + cosine over `c.steps` steps. The global torch RNG (seeded by the
    caller) draws the flow-matching noise and times; a numpy Generator from `seed` the batches.
    `budget_s`: stop after that many seconds even if steps remain (the summary's `steps` says
    how many ran; the weights are then not the recipe's). `scene_has_lead[scene_index]`: scenes
    with a lead vehicle (`TrainConfig.lead_repeats`). `resume`: continue from its saved state when
    the file exists, and stop after `resume.stop_at` steps saving the state there (one schedule
    over several calls, the same weights as one run: a test checks it). Returns a summary (steps,
    wall/CPU seconds, final losses; `stopped_at` when it stopped to be resumed)."""
    sampler = _Sampler(examples, c, seed, scene_has_lead)
    expert = ActionExpert(model.expert, runtime.cfg.action_space.n_waypoints)
    params = [p for p in model.parameters() if p.requires_grad]
    vlm_params = [p for p in model.vlm.parameters() if p.requires_grad]
    expert_params = [p for p in model.expert.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.98), fused=runtime.device.type == "cuda")
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    hist: list[dict] = []
    first = resume.load(model, opt, sampler, hist, log) if resume is not None else 0
    clock = _PhaseClock(runtime.device, c.timed_steps)
    # reference_only: the expert's fused GPU kernels have no backward (on a GPU they would cut
    # its layers out of the gradient: a flow loss stuck at 2.0 on the first GPU build)
    with fast_vision_paths(model), reference_only():
        for step in range(first, c.steps):
            groups = [[examples[i] for i in g] for g in sampler.step()]
            weight_total = float(sum(float(e.weights.sum()) for g in groups for e in g))
            traj_total = max(1, sum(e.task == "trajectory" for g in groups for e in g))
            for g in opt.param_groups:
                g["lr"] = lr_at(step, c)
            opt.zero_grad(set_to_none=True)
            ce_sum = w_sum = 0.0
            flow = []
            clock.start(step)
            for g in groups:
                batch = collate(g, runtime)
                clock.mark("collate")
                loss, st = loss_on_batch(model, expert, batch, c, weight_total, traj_total)
                clock.mark("forward")
                loss.backward()
                clock.mark("backward")
                ce_sum += st["ce_sum"]
                w_sum += st["w_sum"]
                if "flow" in st:
                    flow.append(st["flow"])
            torch.nn.utils.clip_grad_norm_(vlm_params, c.grad_clip)      # clipped apart: the flow loss's
            torch.nn.utils.clip_grad_norm_(expert_params, c.grad_clip)   # scale never throttles the VLM
            opt.step()
            clock.mark("optimiser")
            if log and clock.on and step == c.timed_steps - 1:
                log(f"time per step over the first {c.timed_steps} steps: {clock.summary()}")
            hist.append({"ce": ce_sum / max(w_sum, 1e-9), "flow": float(np.mean(flow)) if flow else float("nan")})
            if log and (step % 25 == 0 or step == c.steps - 1):
                log(f"step {step:4d}/{c.steps}  ce {hist[-1]['ce']:.3f}  flow {hist[-1]['flow']:.3f}  "
                    f"lr {lr_at(step, c):.1e}  {time.perf_counter() - t0:.0f}s")
            if callback is not None:
                callback(step)
            if resume is not None and step + 1 == resume.stop_at and step + 1 < c.steps:
                resume.save(step + 1, model, opt, sampler, hist, log)
                model.eval()
                return {"steps": len(hist), "stopped_at": step + 1}
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                if log:
                    log(f"stopped at step {step + 1}/{c.steps}: training budget of {budget_s:.0f}s spent")
                break
    model.eval()
    tail = hist[-20:]
    flows = [h["flow"] for h in tail if not math.isnan(h["flow"])]   # nan: a step without expert rows
    return {"steps": len(hist), "examples_per_step": dict(sampler.counts),
            "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
            "final_weighted_ce": round(float(np.mean([h["ce"] for h in tail])), 4),
            "final_flow_mse": round(float(np.mean(flows)), 4) if flows else None}


# ------------------------------------------------------------------ expert refinement

@dataclass(frozen=True)
class RefineConfig:
    """Expert-only steps over the jointly trained VLM's K/V (teacher-forced trajectory sequences),
    computed once: each step costs a few expert forwards instead of a VLM forward + backward."""

    steps: int = 300
    scenes_per_step: int = 8
    repeats: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0


@torch.no_grad()
def trajectory_contexts(model, runtime: AlpamayoRuntime, examples: Sequence[Example], batch: int = 8) -> list[tuple]:
    """(k, v, offset, rope_delta, action) per trajectory example; k, v (layers, Hkv, offset, D)
    from one no-grad forward over the sequence up to and including <|traj_future_start|>."""
    out = []
    was = model.training
    model.eval()
    traj = [e for e in examples if e.task == "trajectory"]
    with fast_vision_paths(model):
        for i in range(0, len(traj), batch):
            part = traj[i:i + batch]
            b = collate(part, runtime)
            length = max(e.offset for e in part)
            res = model.vlm.model(input_ids=b.input_ids[:, :length], pixel_values=b.pixel_values,
                                  image_grid_thw=b.grid, position_ids=b.positions[:, :, :length], use_cache=True)
            cache = res["cache"] if "cache" in res.keys() else res["past_key_values"]
            kv = _stacked_cache(cache, list(range(len(part))))
            for r, e in enumerate(part):
                out.append((kv.k[:, r, :, :e.offset].clone(), kv.v[:, r, :, :e.offset].clone(), e.offset,
                            e.rope_delta, e.action))
    model.train(was)
    return out


def refine_expert(model, runtime: AlpamayoRuntime, contexts: Sequence[tuple], c: RefineConfig, seed: int = 0,
                  log: Callable[[str], None] | None = None, budget_s: float | None = None) -> dict:
    """Flow-matching steps for the expert alone over fixed VLM K/V (same loss as in `train`;
    `budget_s` as there)."""
    expert = ActionExpert(model.expert, runtime.cfg.action_space.n_waypoints)
    params = [p for p in model.expert.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.98))
    rng = np.random.default_rng([seed, 11])
    sched = TrainConfig(steps=c.steps, lr=c.lr, min_lr_ratio=c.min_lr_ratio, warmup=c.warmup)
    layers, hkv, _, d = contexts[0][0].shape
    dev = runtime.device
    order: list[int] = []
    model.expert.train()
    t0, c0 = time.perf_counter(), time.process_time()
    losses = []
    for step in range(c.steps):
        idx = []
        while len(idx) < c.scenes_per_step:
            if not order:
                order = rng.permutation(len(contexts)).tolist()
            idx.append(order.pop())
        rows = len(idx) * c.repeats
        length = max(contexts[i][2] for i in idx)
        k = torch.zeros(layers, rows, hkv, length, d, device=dev)
        v = torch.zeros_like(k)
        for j, i in enumerate(idx):
            ck, cv, off, _, _ = contexts[i]
            k[:, j * c.repeats:(j + 1) * c.repeats, :, :off] = ck[:, None]
            v[:, j * c.repeats:(j + 1) * c.repeats, :, :off] = cv[:, None]
        offset = torch.tensor([contexts[i][2] for i in idx], dtype=torch.long, device=dev).repeat_interleave(c.repeats)
        delta = torch.tensor([contexts[i][3] for i in idx], dtype=torch.long, device=dev).repeat_interleave(c.repeats)
        x1 = torch.stack([contexts[i][4] for i in idx]).to(dev).repeat_interleave(c.repeats, 0)
        eps = torch.randn_like(x1)
        t = sample_flow_t(rows).to(dev).view(-1, 1, 1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, sched)
        with reference_only():         # as in `train`: the fused kernels have no backward
            pred = expert.velocity(t * x1 + (1 - t) * eps, t, SimpleNamespace(k=k, v=v), offset, delta, length)
        loss = F.mse_loss(pred, x1 - eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        opt.step()
        losses.append(loss.item())
        if log and (step % 100 == 0 or step == c.steps - 1):
            log(f"expert step {step:4d}/{c.steps}  flow {losses[-1]:.3f}  {time.perf_counter() - t0:.0f}s")
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            if log:
                log(f"expert refinement stopped at step {step + 1}/{c.steps}: budget of {budget_s:.0f}s spent")
            break
    model.eval()
    return {"steps": len(losses), "scenes_per_step": c.scenes_per_step, "repeats": c.repeats, "lr": c.lr,
            "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
            "final_flow_mse": round(float(np.mean(losses[-20:])), 4)}
