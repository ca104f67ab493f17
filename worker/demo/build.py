"""The embedded demo checkpoint: a tiny model of the real Alpamayo 2 layout, trained on synthetic
scenes on the CPU in about three minutes, cached and reused.

    build_demo_checkpoint() -> ${ALPAMAYO_CACHE:-~/.cache/alpamayo-worker}/demo-checkpoint-v<DEMO_VERSION>

(the cache layout and DEMO_VERSION: worker.demo_cache). A complete directory (its `complete` marker is the last file written, inside a temporary
directory that is then renamed into place atomically) is returned at once without importing
torch. Otherwise the build runs, under a file lock so concurrent callers build once:

1. synthetic scenes (training + held-out) from `worker.scenes.generate_scene`;
2. a byte-level BPE tokenizer on the texts of all five tasks plus the prompt strings, extended
   with the release's trajectory-bin and special tokens (`worker.demo.layout.build_tokenizer`);
3. the action-space normalisation fitted to the training scenes' planner futures;
4. joint teacher-forced training of the VLM and the action expert (`worker.demo.train`);
5. `save_checkpoint` + `write_support_files`;
6. the held-out quality report through the real runtime (`worker.demo.report`): quality.json,
   bev.png.

Everything is deterministic from `seed` (fixed thread count, seeded torch / numpy generators,
deterministic algorithms). Bump DEMO_VERSION whenever anything that changes the weights changes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

from schemas import CAMERAS
from worker.demo import report
from worker.scenes import DEFAULT_IMAGE_SIZE
from worker.demo_cache import COMPLETE_MARKER, DEMO_VERSION, checkpoint_dir, file_lock, is_complete

# Everything that imports torch (torch itself, worker.model.*, worker.demo.layout/train) is imported
# inside the functions that train: a cached checkpoint is answered without importing torch.

HELDOUT_SEED_OFFSET = 50_000          # held-out scene seeds: seed * 100_000 + 50_000 + i
TORCH_THREADS = 1                     # see _deterministic_torch
EVAL_K = 3
EVAL_TEMPERATURE = 0.6
TEXT_EVAL_SCENES = 16                 # greedy meta_action / vqa / grounding checks
SHARD_BYTES = 12 << 20                # safetensors shards small enough for one file each in git


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides the demo model's weights besides the seed and the code."""

    name: str
    train_scenes: int                 # training scenes; the first text_task_scenes also train the text tasks
    text_task_scenes: int             # the rest only the trajectory task (+ the expert refinement)
    heldout_scenes: int
    vocab_size: int                   # BPE merges before the 4000 bins and 29 specials are added
    model_pixels: int                 # pixels per image the model sees (min = max): 64*64 -> 4 visual tokens
    dims: dict                        # worker.demo.layout.Dims fields (pixels from model_pixels)
    train: dict                       # worker.demo.train.TrainConfig fields
    refine: dict                      # worker.demo.train.RefineConfig fields
    refine_contexts: int = 0          # trajectory contexts the refinement draws from (0: all)
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE  # (width, height) the recipe renders its scenes at
    # weights kept at their (seeded) random initialisation, by name fragment: fixed random
    # features. The CPU recipe's 600 scenes x 170 steps learn the light colour only this way
    # (measured in docs/demo-model.md: training them too named it in 52-55% of samples, not 99%)
    frozen: tuple[str, ...] = ()
    ship_dtype: str = "float32"       # the weights' dtype in the written checkpoint (trained in fp32 either way)
    perception: dict = dataclasses.field(default_factory=dict)  # worker.demo.perception.PerceptionConfig fields:
                                      # a phase before joint training (none when empty)


def shipped_config(config: dict, dtype: str) -> dict:
    """config with every `dtype` entry (top level and sub-configs) set to the shipped weights' dtype."""
    out = {k: (shipped_config(v, dtype) if isinstance(v, dict) else v) for k, v in config.items()}
    if "dtype" in out:
        out["dtype"] = dtype
    return out


RECIPES = {
    # ~3 minutes on one CPU core: what a machine without the shipped checkpoint builds
    "cpu": Recipe("cpu", train_scenes=600, text_task_scenes=300, heldout_scenes=40, vocab_size=1500,
                  model_pixels=64 * 64, image_size=(64, 64),
                  dims=dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                            expert_hidden=64, expert_intermediate=128, expert_heads=2, vision_hidden=64,
                            vision_intermediate=128, vision_depth=1, vision_heads=2, deepstack=(0,),
                            in_proj_hidden=64),
                  train=dict(steps=170, expert_repeats=4, kv_grad_scale=1.0, key_weights=(15.0, 3.0, 3.0)),
                  refine=dict(steps=400, lr=3e-3),
                  frozen=("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.",
                          "mlp.up_proj.")),
    # minutes on one GPU: 13x the scenes, a 3.5x wider model seeing 16 visual tokens per image
    "gpu": Recipe("gpu", train_scenes=8000, text_task_scenes=2000, heldout_scenes=64, vocab_size=1500,
                  model_pixels=128 * 128, image_size=(64, 64),
                  dims=dict(hidden=256, intermediate=768, layers=4, heads=8, kv_heads=4, head_dim=32,
                            expert_hidden=128, expert_intermediate=384, expert_heads=4, vision_hidden=128,
                            vision_intermediate=256, vision_depth=2, vision_heads=4, deepstack=(0,),
                            in_proj_hidden=128),
                  train=dict(steps=1150, lr=2e-3, warmup=50, expert_repeats=4, kv_grad_scale=1.0,
                             per_step=(("trajectory", 40), ("meta_action", 8), ("vqa", 8), ("grounding", 8),
                                       ("auto_labeling", 4))),
                  refine=dict(steps=1000, lr=2e-3, scenes_per_step=64, repeats=4), refine_contexts=4000),
}
# The shipped build (docs/demo-model.md): the "gpu" recipe with scenes rendered at the model's
# 128x128 (a lead's speed relative to the ego shows only as sub-pixel motion over the 4 frames at
# 64x64), the lead-situation words weighted 15 (the gap digits 3), scenes with a lead vehicle twice
# as often in the text batches, 1,250 joint steps and 1,500 expert steps.
RECIPES["gpu2"] = dataclasses.replace(
    RECIPES["gpu"], name="gpu2", image_size=(128, 128),
    train={**RECIPES["gpu"].train, "steps": 1250, "key_weights": (10.0, 15.0, 3.0), "lead_repeats": 2},
    refine={**RECIPES["gpu"].refine, "steps": 1500})
# gpu2 after a perception phase (worker/demo/perception.py): ~20,000 lead scenes through the front
# cameras, 3,000 steps of 128 on the reasoning's light and lead sentences, then gpu2's schedule
RECIPES["gpu6"] = dataclasses.replace(
    RECIPES["gpu2"], name="gpu6",
    perception=dict(scenes=44_000, steps=3000, rows=128, lr=1e-3, warmup=100, heldout=512, budget_s=420))
SHIPPED_RECIPE = "gpu6"       # what worker/demo/shipped was built with (its quality.json says so too)


def _dims(recipe: Recipe):
    from worker.demo.layout import Dims

    return Dims(**recipe.dims, min_pixels=recipe.model_pixels, max_pixels=recipe.model_pixels)


def _train_configs(recipe: Recipe):
    from worker.demo.train import RefineConfig, TrainConfig

    return TrainConfig(**recipe.train), RefineConfig(**recipe.refine)


# ------------------------------------------------------------------ scene seeds

def train_seeds(seed: int, recipe: Recipe = RECIPES["cpu"]) -> list[int]:
    return [seed * 100_000 + i for i in range(recipe.train_scenes)]


def heldout_seeds(seed: int, recipe: Recipe = RECIPES["cpu"]) -> list[int]:
    return [seed * 100_000 + HELDOUT_SEED_OFFSET + i for i in range(recipe.heldout_scenes)]


@contextlib.contextmanager
def _deterministic_torch(seed: int):
    """Fixed threads, seeded global RNGs, deterministic algorithms; restored afterwards.

    One intra-op thread: on this shared 2-core machine two OpenMP threads were 1.45x faster per
    step when the machine was idle but 3-6x slower whenever another process held a core (every
    parallel region waits for the descheduled thread); one thread keeps the build inside its
    budget either way. The thread count is fixed because it changes float reduction order."""
    import torch

    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(det, warn_only=warn_only)


# ------------------------------------------------------------------ the build

def build_demo_checkpoint(cache_root: str | os.PathLike | None = None, seed: int = 0, force: bool = False,
                          progress: bool = True, recipe: str = "cpu", device: str = "cpu", workers: int = 1,
                          out: str | os.PathLike | None = None, budget_s: float | None = None,
                          resume_file: str | os.PathLike | None = None, stop_at: int | None = None,
                          perception_file: str | os.PathLike | None = None) -> Path | None:
    """The demo checkpoint directory, built on first use (see module docstring); `out` builds
    into that directory instead of the cache; `budget_s` caps training + refinement (70 / 30 %).
    `resume_file`: joint training continues from that file's state when it exists and, with
    `stop_at`, stops after that many steps saving its state there -> None (no checkpoint yet: call
    again with the same file to go on; worker/demo/resume.py). `perception_file`: the perception
    phase's weights are loaded from it when it exists, else saved there (`stop_at` 0: stop after it)."""
    final = Path(out) if out is not None else checkpoint_dir(cache_root, seed)
    if not force and is_complete(final):
        return final
    with file_lock(final.parent / f".{final.name}.lock"):
        if not force and is_complete(final):       # another process finished it while we waited
            return final
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if not _build(tmp, seed, progress, RECIPES[recipe], device, workers, budget_s, resume_file, stop_at,
                          perception_file):
                return None
            if final.exists():
                old = final.parent / f".{final.name}.old-{os.getpid()}"
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def prompt_strings() -> list[str]:
    """The fixed text of every prompt (system message, camera names, frame labels, instructions,
    default questions, chat roles), so the tokenizer learns them as few tokens."""
    from worker.model.inputs import DEFAULT_QUESTIONS, INSTRUCTIONS, SYSTEM_PROMPT

    return ([SYSTEM_PROMPT, *INSTRUCTIONS.values(), *DEFAULT_QUESTIONS.values(), "system\n", "user\n", "assistant\n"]
            + [f"{c.display_name}: " for c in CAMERAS.values()] + [f"frame {k} " for k in range(4)])


def tokenizer_corpus(scenes) -> list[str]:
    from worker.demo.train import corpus_texts

    return corpus_texts(scenes) + prompt_strings() * max(1, len(scenes) // 10)


_POOL_RUNTIME = None                  # the CPU runtime forked pool workers build examples with


def _scene(seed: int, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE):
    from worker.scenes import generate_scene

    return generate_scene(seed, image_size)


def scene_image_size(checkpoint: str | os.PathLike) -> tuple[int, int]:
    """(width, height) a built checkpoint's scenes were rendered at (its quality.json; the
    generator's default without one), so its held-out bars and its DFlash2 head's data see what it
    was trained on."""
    q = Path(checkpoint) / "quality.json"
    w, h = load_quality(q.parent)["build"].get("image_size", DEFAULT_IMAGE_SIZE) if q.is_file() else DEFAULT_IMAGE_SIZE
    return int(w), int(h)


_EXAMPLE_TENSORS = ("input_ids", "positions", "weights", "action")


def _numpy(examples: list) -> list:
    return [dataclasses.replace(e, **{f: getattr(e, f).numpy() for f in _EXAMPLE_TENSORS
                                      if getattr(e, f) is not None}) for e in examples]


def _examples(job: tuple) -> list:
    """Examples of one chunk of scenes, their tensors as numpy arrays: handed back through the pool
    as tensors, each would be shared through a file descriptor (torch's reducers), thousands at once."""
    from worker.demo import train

    scenes, tasks, key_weights, first_index = job
    return _numpy(train.build_examples(_POOL_RUNTIME, scenes, tasks=tasks, key_weights=key_weights,
                                       first_index=first_index))


def _perception_examples(job: tuple) -> list:
    """The perception phase's examples of one chunk of scene seeds (rendered here, then dropped)."""
    from worker.demo import perception

    seeds, image_size, key_weights = job
    return _numpy(perception.build_examples(_POOL_RUNTIME, [perception.scene(s, image_size) for s in seeds],
                                            key_weights))


def _as_tensors(e):
    import torch

    return dataclasses.replace(e, **{f: torch.from_numpy(getattr(e, f)) for f in _EXAMPLE_TENSORS
                                     if getattr(e, f) is not None})


def _parallel(fn, jobs: list, workers: int) -> list:
    """[fn(job) for job in jobs], in order, over `workers` forked processes (before any CUDA use)."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(j) for j in jobs]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(fn, jobs, chunksize=max(1, len(jobs) // (8 * workers)))


def _build(out: Path, seed: int, progress: bool, recipe: Recipe = RECIPES["cpu"], device: str = "cpu",
           workers: int = 1, budget_s: float | None = None, resume_file: str | os.PathLike | None = None,
           stop_at: int | None = None, perception_file: str | os.PathLike | None = None) -> bool:
    """-> False when joint training stopped at `stop_at` to be resumed, or before it (`stop_at`
    0) after the perception phase saved its weights to `perception_file` (nothing written to `out`
    beyond the support files)."""
    global _POOL_RUNTIME
    t_start, c_start = time.perf_counter(), time.process_time()
    log = (lambda msg: print(f"[demo-checkpoint {time.perf_counter() - t_start:5.1f}s] {msg}", flush=True)) \
        if progress else (lambda msg: None)
    import torch

    from worker.demo import perception, report, train
    from worker.demo.layout import build_tokenizer, make_config, write_support_files
    from worker.demo.resume import ResumeFile
    from worker.model.checkpoint import save_checkpoint
    from worker.model.config import AlpamayoConfig
    from worker.model.inputs import ImageProcessing
    from worker.model.modules import Alpamayo2
    from worker.model.runtime import AlpamayoRuntime
    from worker.model.tokenizer import load_tokenizer

    timings: dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - mark[0], 1)
        mark[0] = now

    with _deterministic_torch(seed):
        log(f"building {out.name.split('.tmp')[0].lstrip('.')} (recipe {recipe.name}, seed {seed}, device {device}, "
            f"{TORCH_THREADS} threads, {workers} data workers)")
        render = functools.partial(_scene, image_size=recipe.image_size)
        scenes = _parallel(render, train_seeds(seed, recipe), workers)
        held = _parallel(render, heldout_seeds(seed, recipe), workers)
        lap("scenes")
        tok = build_tokenizer(tokenizer_corpus(scenes), recipe.vocab_size)
        norm = train.fit_action_normalisation(scenes)
        dims = _dims(recipe)
        config = make_config(tok, dims, "float32", norm)
        write_support_files(out, tok, config)
        cfg = AlpamayoConfig.from_dict(config)
        tok, ids = load_tokenizer(out, cfg)                      # as the runtime will read it
        lap("tokenizer")
        log(f"{len(scenes)} training + {len(held)} held-out scenes, vocab {tok.get_vocab_size()}, "
            f"action norm accel {norm['accel_mean']:+.2f}±{norm['accel_std']:.2f} m/s², "
            f"curvature {norm['curvature_mean']:+.4f}±{norm['curvature_std']:.4f} 1/m")
        model = Alpamayo2(cfg)
        train.init_bin_embeddings(model, ids)
        train.init_patch_colour_means(model)
        for name, p in model.named_parameters():
            if any(f in name for f in recipe.frozen):
                p.requires_grad_(False)
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        image_proc = ImageProcessing.from_dir(out, cfg.min_pixels, cfg.max_pixels)
        runtime = _POOL_RUNTIME = AlpamayoRuntime(model, cfg, tok, ids, image_proc, torch.device("cpu"), torch.float32)
        tc, rc = _train_configs(recipe)
        pc = perception.PerceptionConfig(**recipe.perception) if recipe.perception else None
        n_text, step = recipe.text_task_scenes, 64
        jobs = [(scenes[i:min(i + step, n_text)], train.TASKS, tc.key_weights, i) for i in range(0, n_text, step)]
        jobs += [(scenes[i:i + step], ("trajectory",), tc.key_weights, i)
                 for i in range(n_text, len(scenes), step)]
        if pc is not None and stop_at == 0:     # stopping after the perception phase: no joint examples
            jobs = []
        examples = [_as_tensors(e) for part in _parallel(_examples, jobs, workers) for e in part]
        p_file = Path(perception_file) if perception_file is not None else None
        if pc is not None and not (p_file is not None and p_file.is_file()):
            p_seeds, p_held = perception.seeds(seed, pc)
            chunk = lambda xs: [(xs[i:i + 64], recipe.image_size, tc.key_weights)  # noqa: E731
                                for i in range(0, len(xs), 64)]
            p_examples = [_as_tensors(e) for part in _parallel(_perception_examples, chunk(p_seeds), workers)
                          for e in part]
            p_held = [_as_tensors(e) for part in _parallel(_perception_examples, chunk(p_held), workers)
                      for e in part][:pc.heldout]
        _POOL_RUNTIME = None
        lap("examples")
        if device != "cpu":                 # a runtime over the moved model: its fused views live there
            model.to(device)
            runtime = AlpamayoRuntime(model, cfg, tok, ids, image_proc, torch.device(device), torch.float32)
        perceived = None
        if pc is not None and p_file is not None and p_file.is_file():
            model.load_state_dict(torch.load(p_file, map_location=device, weights_only=True))
            log(f"perception phase: weights loaded from {p_file}")
            perceived = {"loaded_from": p_file.name}
        elif pc is not None:
            log(f"perception phase: {len(p_examples)} lead scenes (front cameras), {pc.steps} steps of {pc.rows}")
            perceived = perception.run(model, runtime, p_examples, p_held, pc, tc.key_weights, seed, log)
            del p_examples, p_held
            if p_file is not None:
                torch.save(model.state_dict(), p_file)
            lap("perception")
        if pc is not None:
            torch.manual_seed(seed + 1)     # the joint phase draws alike whether the phase ran here or was loaded
            if stop_at == 0:
                return False
        n_params = sum(p.numel() for p in model.parameters())
        log(f"{len(examples)} training sequences; model {n_params / 1e6:.2f} M parameters; training {tc.steps} steps")
        resume = None if resume_file is None else ResumeFile(
            Path(resume_file), f"demo v{DEMO_VERSION}, recipe {recipe.name}, seed {seed}, {tc.steps} steps", stop_at)
        summary = train.train(model, runtime, examples, tc, seed=seed, log=log,
                              budget_s=None if budget_s is None else 0.7 * budget_s,
                              scene_has_lead=[sc.facts.lead_relation != "none" for sc in scenes], resume=resume)
        if "stopped_at" in summary:
            return False
        lap("training")
        log(f"expert refinement: {rc.steps} steps over the trained VLM's K/V")
        traj = [e for e in examples if e.task == "trajectory"]
        contexts = train.trajectory_contexts(model, runtime, traj[:recipe.refine_contexts or len(traj)])
        refine = train.refine_expert(model, runtime, contexts, rc, seed=seed, log=log,
                                     budget_s=None if budget_s is None else 0.3 * budget_s)
        lap("expert_refinement")
        del runtime, examples, contexts
        save_checkpoint(model, shipped_config(config, recipe.ship_dtype), out, max_shard_bytes=SHARD_BYTES,
                        dtype=getattr(torch, recipe.ship_dtype))
        del model
        lap("save")
        log(f"evaluating the written checkpoint on {len(held)} held-out scenes through AlpamayoRuntime.run")
        rt = AlpamayoRuntime.load(out, device=device, dtype=torch.float32)
        metrics, preds = report.evaluate(rt, held, k=EVAL_K, temperature=EVAL_TEMPERATURE,
                                         text_scenes=TEXT_EVAL_SCENES)
        lap("evaluation")
        build = {
            "demo_version": DEMO_VERSION, "recipe": recipe.name, "seed": seed, "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch_threads": TORCH_THREADS, "data_workers": workers,
            "torch": torch.__version__, "image_size": list(recipe.image_size), "model_pixels": recipe.model_pixels,
            "train_scene_seeds": [train_seeds(seed, recipe)[0], train_seeds(seed, recipe)[-1]],
            "heldout_scene_seeds": heldout_seeds(seed, recipe),
            "vocab_size": tok.get_vocab_size(), "dims": {k: (list(v) if isinstance(v, tuple) else v)
                                                        for k, v in vars(dims).items()},
            "parameters": n_params, "frozen": list(recipe.frozen), "ship_dtype": recipe.ship_dtype,
            "trainable_parameters": n_trainable,
            "action_normalisation": norm,
            "train": {**summary, "lr": tc.lr, "warmup": tc.warmup, "expert_repeats": tc.expert_repeats,
                      "kv_grad_scale": tc.kv_grad_scale, "key_weights": list(tc.key_weights),
                      "lead_repeats": tc.lead_repeats},
            "expert_refinement": refine,
            "perception": perceived,
            "timings_s": timings,
        }
        report.write_bev(out, held, preds)
        lap("report")
        build["build_wall_s"] = round(time.perf_counter() - t_start, 1)
        build["build_cpu_s"] = round(time.process_time() - c_start, 1)
        report.write_quality(out, metrics, build)
        (out / COMPLETE_MARKER).write_text(json.dumps({"demo_version": DEMO_VERSION, "seed": seed,
                                                       "built_unix": int(time.time())}) + "\n")
        log(f"done in {build['build_wall_s']:.0f}s wall, {build['build_cpu_s']:.0f}s CPU")
    return True


def load_quality(directory: Path) -> dict:
    return json.loads((Path(directory) / "quality.json").read_text())


# ------------------------------------------------------------------ CLI

def measure_heldout_bars(checkpoint: Path, head: Path, scenes: int) -> dict:
    """`report.measure_bars` on the first `scenes` of the checkpoint's own held-out scenes."""
    from worker.scenes import generate_scene

    seeds = load_quality(checkpoint)["build"]["heldout_scene_seeds"][:scenes]
    size = scene_image_size(checkpoint)
    return report.measure_bars(checkpoint, head, [generate_scene(s, size) for s in seeds])


def ship(checkpoint: Path, head: Path, scenes: int = 64) -> Path:
    """Copy a built checkpoint and head into the repository (worker/demo/shipped), measure their
    bars on `scenes` of the checkpoint's held-out scenes (bars.json) and write the manifest."""
    from worker.demo_cache import shipped_dir, write_manifest

    out = shipped_dir()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out / "checkpoint")
    shutil.copytree(head, out / "head")
    bars = measure_heldout_bars(out / "checkpoint", out / "head", scenes)
    (out / "bars.json").write_text(json.dumps(bars, indent=1) + "\n")
    write_manifest(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """`alpamayo-worker demo-checkpoint`: the shipped demo checkpoint (its path and held-out quality,
    or with --json its bars), or with --recipe a build by the project's recipe (cached, or into --out)."""
    p = argparse.ArgumentParser(prog="alpamayo-worker demo-checkpoint", description=main.__doc__)
    p.add_argument("--json", action="store_true",
                   help="print the shipped checkpoint's bars as one JSON object (bars.json; --measure: measured now)")
    p.add_argument("--measure", type=int, default=None, metavar="N",
                   help="with --json: measure on N held-out scenes on this CPU instead of reading bars.json")
    p.add_argument("--ship", nargs=2, default=None, metavar=("CKPT", "HEAD"),
                   help="copy a built checkpoint and head into worker/demo/shipped, measure bars.json, write the manifest")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="build with this recipe (cpu: ~3 CPU-minutes; gpu: ~7 minutes on an H200 with --device cuda)")
    p.add_argument("--force", action="store_true", help="with --recipe: rebuild even if a complete build is cached")
    p.add_argument("--seed", type=int, default=0, help="with --recipe: training seed (default 0)")
    p.add_argument("--cache-dir", default=None,
                   help="with --recipe: cache root (default: ALPAMAYO_CACHE, see worker.config)")
    p.add_argument("--quiet", action="store_true", help="no build progress, only the result")
    p.add_argument("--device", default="cpu", help="with --recipe: where to train and evaluate, e.g. cuda (default cpu)")
    p.add_argument("--workers", type=int, default=1, help="with --recipe: processes that render scenes and build examples")
    p.add_argument("--out", default=None, help="with --recipe: build into this directory instead of the cache")
    p.add_argument("--budget-s", type=float, default=None,
                   help="with --recipe: stop training + expert refinement after this many seconds (quality.json records "
                        "the steps run)")
    p.add_argument("--resume-file", default=None, metavar="PATH",
                   help="with --recipe: continue joint training from this file's state when it exists (and with "
                        "--stop-at-step, save it there): one schedule over several device calls")
    p.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                   help="with --recipe and --resume-file: stop joint training after step N, saving its state "
                        "(0 with --perception-file: stop after the perception phase)")
    p.add_argument("--perception-file", default=None, metavar="PATH",
                   help="with a recipe that has a perception phase: load its weights from PATH when it exists, "
                        "else save them there")
    args = p.parse_args(argv)
    if args.stop_at_step is not None and args.resume_file is None and not (
            args.stop_at_step == 0 and args.perception_file is not None):
        p.error("--stop-at-step needs --resume-file (where the state goes), or 0 with --perception-file")
    from worker.demo_cache import demo_checkpoint, shipped_dir

    if args.ship:
        out = ship(Path(args.ship[0]), Path(args.ship[1]))
        print(f"shipped into {out}")
        print((out / "bars.json").read_text())
        return 0
    if args.json:
        ckpt = demo_checkpoint()
        if args.measure:
            bars = measure_heldout_bars(ckpt, shipped_dir() / "head", args.measure)
        else:
            bars = json.loads((shipped_dir() / "bars.json").read_text())
        print(json.dumps({**bars, "met": report.bars_met(bars)}))
        return 0
    t0 = time.perf_counter()
    if args.recipe is None:
        path = demo_checkpoint()
    else:
        path = build_demo_checkpoint(args.cache_dir, seed=args.seed, force=args.force, progress=not args.quiet,
                                     recipe=args.recipe, device=args.device, workers=args.workers, out=args.out,
                                     budget_s=args.budget_s, resume_file=args.resume_file, stop_at=args.stop_at_step,
                                     perception_file=args.perception_file)
        if path is None:
            print(f"training stopped after step {args.stop_at_step}: state in "
                  f"{args.resume_file or args.perception_file}; run the same command without --stop-at-step "
                  "(or with a later one) to go on")
            return 0
    q = load_quality(path)
    b = q.get("build", {})
    print(f"demo checkpoint: {path}")
    print(f"(v{b.get('demo_version', DEMO_VERSION)}, recipe {b.get('recipe')}, seed {b.get('seed')}, "
          f"built on {b.get('device_name')} in {b.get('build_wall_s')}s wall / {b.get('build_cpu_s')}s CPU; "
          f"this call {time.perf_counter() - t0:.1f}s)")
    print(report.format_table(q))
    return 0


if __name__ == "__main__":
    sys.exit(main())
