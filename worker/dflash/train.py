"""Training the DFlash2 head by self-distillation, and the packaged head of the demo model.

Data: the base model's own generations on synthetic trajectory scenes (greedy and sampled), up
to and including `<|traj_future_start|>` (a draft never trained on the end-of-reasoning token
stalls there). Target features: the chosen target layers' hidden states of every position of
prompt + generation, from one teacher-forced forward (the base is frozen).

Objective (public DFlash recipe): random anchors in the generation; block = [token at anchor,
MASK x 7]; context = features strictly before the anchor; cross-entropy of positions 1..7 against
the generated tokens, weighted exp(-(k-1)/gamma); plus the candidate selector's cross-entropy over
the draft's top-C candidates, teacher-forced on the previous true token.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from worker.demo_cache import COMPLETE_MARKER, HEAD_VERSION, head_dir
from worker.dflash.draft import MASK_TOKEN, DraftModel
from worker.dflash.head import HeadConfig, head_config_for, write_metadata
from worker.dflash.loop import DFlash2Speculator
from worker.model.config import AlpamayoConfig
from worker.model.fused_ops import reference_only
from worker.model.runtime import AlpamayoRuntime
from worker.scenes import DEFAULT_IMAGE_SIZE, generate_scene
from worker.scenes.request import runtime_request
GAMMA = 4.0


@dataclass
class Sequence:
    hidden: dict[int, torch.Tensor]    # layer -> (L, H) target features (no grad)
    tokens: torch.Tensor               # (L,) prompt + generated ids
    rope_delta: int
    start: int                         # first generated position (prompt length)


def collect_sequences(rt, requests, capture: tuple[int, ...]) -> list[Sequence]:
    """Run the base model on requests, then one teacher-forced forward per generated sample to
    record the target-layer hidden states of every position."""
    out: list[Sequence] = []
    results = []
    for i in range(0, len(requests), 16):          # batches of one K
        chunk = requests[i:i + 16]
        for k in sorted({r.num_samples for r in chunk}):
            results += [(r, res) for r, res in zip([r for r in chunk if r.num_samples == k],
                                                   rt.run([r for r in chunk if r.num_samples == k]))]
    for req, res in results:
        if res.error is not None:
            continue
        p = rt._prepare(req)
        plen = len(p.input_ids)
        for toks in res.token_ids:
            if rt.ids.image_pad in toks:      # a placeholder token would need pixels in a teacher-forced pass
                continue
            ids = torch.cat([p.input_ids, torch.tensor(toks, dtype=torch.long)])
            n = len(toks)
            pos = torch.cat([p.positions, (torch.arange(plen, plen + n) + p.rope_delta).expand(3, -1)], dim=1)
            captured: dict[int, torch.Tensor] = {}
            hooks = [rt.model.language_model.layers[i].register_forward_hook(
                lambda _m, _i, o, i=i: captured.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].detach()))
                for i in capture]
            try:
                with torch.inference_mode():
                    rt.model.vlm.model(input_ids=ids[None].to(rt.device), pixel_values=p.pixel_values,
                                       image_grid_thw=p.grid.to(rt.device),
                                       position_ids=pos[:, None].to(rt.device), use_cache=False)
            finally:
                for h in hooks:
                    h.remove()
            out.append(Sequence({i: captured[i].float() for i in capture}, ids.to(rt.device), p.rope_delta, plen))
    return out


def init_from_base(draft: DraftModel, base_model) -> None:
    """Start the draft layers from the base's last decoder layer and the projector from the
    last target layer's features (identity block)."""
    src = base_model.language_model.layers[-1]
    with torch.no_grad():
        for layer in draft.layers:
            for name, p in layer.named_parameters():
                p.copy_(dict(src.named_parameters())[name].float())
        h = draft.config.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, -h:] = torch.eye(h)
        draft.norm.weight.copy_(base_model.language_model.norm.weight.float())


def _batch_loss(draft: DraftModel, embed, lm_head, seqs: list[Sequence], anchors_per_seq: int,
                rng: np.random.Generator) -> torch.Tensor:
    """The step's loss: per sequence, the weighted block cross-entropy of its anchors and half the
    selector's cross-entropy, averaged over those terms. Every sequence of the step runs in one
    forward (right-padded to the longest; each anchor sees only its own sequence's context
    before it), so a step costs a few dozen kernels whatever the batch."""
    c = draft.config
    n = c.block_size
    seqs = [s for s in seqs if len(s.tokens) - s.start >= 2]
    if not seqs:
        return torch.zeros((), requires_grad=True)
    dev = seqs[0].tokens.device
    lengths = [len(s.tokens) for s in seqs]
    L = max(lengths)
    anchors = [torch.tensor(rng.integers(s.start, len(s.tokens) - 1,
                                         size=min(anchors_per_seq, len(s.tokens) - s.start - 1)), device=dev)
               for s in seqs]
    owner = torch.cat([torch.full((len(x),), i, device=dev) for i, x in enumerate(anchors)])     # (m,)
    a = torch.cat(anchors)                                                                         # (m,)
    tokens = torch.stack([F.pad(s.tokens, (0, L - len(s.tokens))) for s in seqs])                 # (B, L)
    length = torch.tensor(lengths, device=dev)
    hidden = {i: torch.stack([F.pad(s.hidden[i], (0, 0, 0, L - len(s.tokens))) for s in seqs])
              for i in c.target_layer_ids}                                                         # (B, L, H)
    delta = torch.tensor([s.rope_delta for s in seqs], device=dev)
    ctx = draft.context_kv(draft.project(hidden), torch.arange(L, device=dev)[None] + delta[:, None])
    ctx = [(k[owner], v[owner]) for k, v in ctx]                                                  # (m, Hkv, L, D)
    visible = torch.arange(L, device=dev)[None, :] < a[:, None]
    block = torch.full((len(a), n), c.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = tokens[owner, a]
    pos = a[:, None] + torch.arange(n, device=dev) + delta[owner][:, None]
    h = draft.block_hidden(embed(block).float(), pos, ctx, visible)                               # (m, n, H)
    tgt_idx = a[:, None] + 1 + torch.arange(n - 1, device=dev)                                    # (m, 7)
    valid = tgt_idx < length[owner][:, None]
    tgt = tokens[owner[:, None], tgt_idx.clamp(max=L - 1)]
    logits = lm_head(h[:, 1:]).float()                                                            # (m, 7, V)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view(len(a), -1)
    w = torch.tensor([math.exp(-k / GAMMA) for k in range(n - 1)], device=dev)[None, :] * valid
    per_seq = torch.zeros(len(seqs), device=dev).index_add(0, owner, (ce * w).sum(1)) / \
        torch.zeros(len(seqs), device=dev).index_add(0, owner, w.sum(1))
    losses = list(per_seq)
    # selector: rescoring the draft's top-C, teacher-forced on the previous true token
    cand_logits, cand = logits.detach().topk(c.num_candidates, dim=-1)                           # (m, 7, C)
    prev = torch.cat([block[:, :1], tgt[:, :-1]], dim=1)                                           # (m, 7)
    scores = draft.selector.scores(h[:, 1:], embed(prev).float(), embed(cand).float(), cand_logits)
    hit = cand == tgt[..., None]
    ok = hit.any(-1) & valid
    sel = F.cross_entropy(scores[ok], hit[ok].float().argmax(-1), reduction="none")
    row = owner[:, None].expand_as(ok)[ok]
    counts = torch.zeros(len(seqs), device=dev).index_add(0, row, torch.ones_like(sel))
    sums = torch.zeros(len(seqs), device=dev).index_add(0, row, sel)
    losses += [0.5 * sums[i] / counts[i] for i in range(len(seqs)) if counts[i] > 0]
    return torch.stack(losses).mean()


def train_head(rt, train_requests, head_cfg: HeadConfig, steps: int = 400, lr: float = 5e-3, seed: int = 0,
               batch: int = 4, anchors_per_seq: int = 8, time_budget_s: float | None = None,
               progress: bool = False) -> tuple[DraftModel, dict]:
    """Distil a head for the runtime's base model. Returns (draft, provenance)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    seqs = collect_sequences(rt, train_requests, head_cfg.target_layer_ids)
    t_data = time.perf_counter() - t0
    draft = DraftModel(head_cfg).float()
    init_from_base(draft, rt.model)
    draft.to(rt.device)
    embed = rt.model.language_model.embed_tokens
    lm_head = rt.model.lm_head
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    done = 0
    loss = torch.zeros(())
    for step in range(steps):
        idx = rng.choice(len(seqs), size=min(batch, len(seqs)), replace=False)
        with reference_only():         # the fused GPU kernels have no backward
            loss = _batch_loss(draft, embed, lm_head, [seqs[i] for i in idx], anchors_per_seq, rng)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        if progress and step % 25 == 0:
            print(f"  head step {step:4d}  loss {loss.item():.3f}", flush=True)
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
    prov = {"method": "self-distillation", "sequences": len(seqs), "steps": done, "final_loss": float(loss.detach()),
            "seed": seed, "data_seconds": round(t_data, 1), "train_seconds": round(time.perf_counter() - t0 - t_data, 1)}
    return draft.cpu().eval().requires_grad_(False), prov


def measure_acceptance(rt_spec, requests) -> dict:
    """Held-out acceptance of a speculative runtime (all samples summed)."""
    steps = drafted = accepted = 0
    for res in rt_spec.run(requests):
        if res.speculative is not None:
            steps += res.speculative.steps
            drafted += res.speculative.drafted
            accepted += res.speculative.accepted
    return {"scenes": len(requests), "verify_steps": steps,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / steps if steps else 1.0}


def demo_requests(seeds, k: int = 1, temperature: float = 0.0, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE):
    """Trajectory SceneRequests of the synthetic scenes of `seeds` (request id = scene id),
    rendered at `image_size` (width, height)."""
    out = []
    for seed in seeds:
        s = generate_scene(int(seed), image_size)
        out.append(runtime_request(s, "trajectory", request_id=s.scene_id, num_samples=k, temperature=temperature,
                                   seed=int(seed)))
    return out


# head recipes: the CPU one builds in about two minutes where no shipped head exists; the GPU one
# made the shipped head (docs/demo-model.md)
HEAD_RECIPES = {"cpu": dict(train_scenes=64, steps=400, batch=4, time_budget_s=120.0),
                "gpu": dict(train_scenes=768, steps=4000, batch=32, time_budget_s=420.0)}


def build_demo_head(checkpoint: str | Path, cache_root: str | Path | None = None, seed: int = 0,
                    force: bool = False, progress: bool = True, eval_scenes: int = 16, recipe: str = "cpu",
                    device: str = "cpu", out: str | Path | None = None) -> Path:
    """The packaged DFlash2 head of the demo checkpoint, cached next to it (keyed by version and
    the base config hash and weights: worker.demo_cache.head_dir) or built into `out`. Returns
    its directory."""
    checkpoint = Path(checkpoint)
    base_cfg = AlpamayoConfig.from_dir(checkpoint)
    out = Path(out) if out is not None else head_dir(checkpoint, cache_root or None)
    if (out / COMPLETE_MARKER).is_file() and not force:
        return out
    r = HEAD_RECIPES[recipe]
    train_scenes = r["train_scenes"]
    t0 = time.perf_counter()
    if device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    rt = AlpamayoRuntime.load(checkpoint, device=device, dtype=torch.float32)
    head_cfg = head_config_for(base_cfg, mask_token_id=rt.tok.token_to_id(MASK_TOKEN))
    rng = np.random.default_rng(seed + 1000)
    seeds = rng.choice(10_000_000, size=train_scenes + eval_scenes, replace=False) + 50_000_000
    half = train_scenes // 2
    from worker.demo.build import scene_image_size

    size = scene_image_size(checkpoint)                  # what the checkpoint was trained on
    train = demo_requests(seeds[:half], k=1, temperature=0.0, image_size=size) + \
        demo_requests(seeds[half:train_scenes], k=2, temperature=0.6, image_size=size)
    if progress:
        print(f"DFlash2 head: distilling from {checkpoint} ({train_scenes} scenes)", flush=True)
    draft, prov = train_head(rt, train, head_cfg, steps=r["steps"], seed=seed, batch=r["batch"],
                             time_budget_s=r["time_budget_s"], progress=progress)
    prov.update(recipe=recipe, device=device)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save(tmp)
    write_metadata(tmp, base_cfg, {"trained_for": str(checkpoint.name), "head_version": HEAD_VERSION,
                                   "training": prov, "created_at": time.time()})
    spec = AlpamayoRuntime.load(checkpoint, device=device, dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(tmp)))
    held_out = demo_requests(seeds[train_scenes:], k=1, temperature=0.6, image_size=size)
    quality = measure_acceptance(spec, held_out)
    quality["build_seconds"] = round(time.perf_counter() - t0, 1)
    (tmp / "quality.json").write_text(json.dumps(quality, indent=2))
    if progress:
        print(f"DFlash2 head: held-out acceptance rate {quality['draft_acceptance_rate']:.3f}, "
              f"mean acceptance length {quality['mean_acceptance_length']:.2f} "
              f"({quality['build_seconds']:.0f} s)", flush=True)
    (tmp / COMPLETE_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Build (or reuse) the packaged DFlash2 head of a checkpoint and print its directory (the
    serving process runs this in a child interpreter: worker.demo_cache.demo_head)."""
    p = argparse.ArgumentParser(prog="python -m worker.dflash.train", description=main.__doc__)
    p.add_argument("--checkpoint", required=True, help="the base checkpoint directory the head drafts for")
    p.add_argument("--cache-dir", default=None, help="cache root (default: ALPAMAYO_CACHE, see worker.config)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete head is cached")
    p.add_argument("--quiet", action="store_true", help="no build progress, only the result")
    p.add_argument("--recipe", choices=sorted(HEAD_RECIPES), default="cpu", help="training scenes and steps")
    p.add_argument("--device", default="cpu", help="where to train, e.g. cuda (default cpu)")
    p.add_argument("--out", default=None, help="build into this directory instead of the cache")
    args = p.parse_args(argv)
    print(build_demo_head(args.checkpoint, cache_root=args.cache_dir, force=args.force, progress=not args.quiet,
                          recipe=args.recipe, device=args.device, out=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
