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
import json
import os
import shutil
import sys
import time
from pathlib import Path

from schemas import CAMERAS
from worker.demo import report
from worker.demo_cache import COMPLETE_MARKER, DEMO_VERSION, checkpoint_dir, file_lock, is_complete

# Everything that imports torch (torch itself, worker.model.*, worker.demo.layout/train) is imported
# inside the functions that train: a cached checkpoint is answered without importing torch.

TRAIN_SCENES = 600                    # training scenes; the first TEXT_TASK_SCENES also train the text tasks
TEXT_TASK_SCENES = 300                # the rest only the trajectory task (+ the expert refinement)
HELDOUT_SCENES = 40
HELDOUT_SEED_OFFSET = 50_000          # held-out scene seeds: seed * 100_000 + 50_000 + i
IMAGE_SIZE = (64, 64)                 # (width, height): 4 visual tokens per image at 64*64 pixels
VOCAB_SIZE = 1500                     # BPE merges before the 4000 bins and 29 specials are added
TORCH_THREADS = 1                     # see _deterministic_torch
EVAL_K = 3
EVAL_TEMPERATURE = 0.6
TEXT_EVAL_SCENES = 16                 # greedy meta_action / vqa / grounding checks


def _dims():
    from worker.demo.layout import Dims

    return Dims(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
                expert_hidden=64, expert_intermediate=128, expert_heads=2,
                vision_hidden=64, vision_intermediate=128, vision_depth=1, vision_heads=2, deepstack=(0,),
                in_proj_hidden=64, min_pixels=IMAGE_SIZE[0] * IMAGE_SIZE[1], max_pixels=IMAGE_SIZE[0] * IMAGE_SIZE[1])


def _train_configs():
    from worker.demo.train import RefineConfig, TrainConfig

    return TrainConfig(steps=170, expert_repeats=4, kv_grad_scale=1.0), RefineConfig(steps=400, lr=3e-3)


# ------------------------------------------------------------------ scene seeds

def train_seeds(seed: int) -> list[int]:
    return [seed * 100_000 + i for i in range(TRAIN_SCENES)]


def heldout_seeds(seed: int) -> list[int]:
    return [seed * 100_000 + HELDOUT_SEED_OFFSET + i for i in range(HELDOUT_SCENES)]


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
                          progress: bool = True) -> Path:
    """The demo checkpoint directory, built on first use (see module docstring)."""
    final = checkpoint_dir(cache_root, seed)
    if not force and is_complete(final):
        return final
    with file_lock(final.parent / f".{final.name}.lock"):
        if not force and is_complete(final):       # another process finished it while we waited
            return final
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _build(tmp, seed, progress)
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


def _build(out: Path, seed: int, progress: bool) -> None:
    t_start, c_start = time.perf_counter(), time.process_time()
    log = (lambda msg: print(f"[demo-checkpoint {time.perf_counter() - t_start:5.1f}s] {msg}", flush=True)) \
        if progress else (lambda msg: None)
    import torch

    from worker.scenes import generate_scene
    from worker.demo import report, train
    from worker.demo.layout import build_tokenizer, make_config, write_support_files
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
        log(f"building {out.name.split('.tmp')[0].lstrip('.')} (seed {seed}, {TORCH_THREADS} threads)")
        scenes = [generate_scene(s, IMAGE_SIZE) for s in train_seeds(seed)]
        held = [generate_scene(s, IMAGE_SIZE) for s in heldout_seeds(seed)]
        lap("scenes")
        tok = build_tokenizer(tokenizer_corpus(scenes), VOCAB_SIZE)
        norm = train.fit_action_normalisation(scenes)
        dims = _dims()
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
        runtime = AlpamayoRuntime(model, cfg, tok, ids, ImageProcessing.from_dir(out, cfg.min_pixels, cfg.max_pixels),
                                  torch.device("cpu"), torch.float32)
        tc, rc = _train_configs()
        examples = train.build_examples(runtime, scenes[:TEXT_TASK_SCENES], key_weights=tc.key_weights)
        examples += train.build_examples(runtime, scenes[TEXT_TASK_SCENES:], tasks=("trajectory",),
                                         key_weights=tc.key_weights, first_index=TEXT_TASK_SCENES)
        lap("examples")
        n_params = sum(p.numel() for p in model.parameters())
        log(f"{len(examples)} training sequences; model {n_params / 1e6:.2f} M parameters; training {tc.steps} steps")
        summary = train.train(model, runtime, examples, tc, seed=seed, log=log)
        lap("training")
        log(f"expert refinement: {rc.steps} steps over the trained VLM's K/V")
        contexts = train.trajectory_contexts(model, runtime, examples)
        refine = train.refine_expert(model, runtime, contexts, rc, seed=seed, log=log)
        lap("expert_refinement")
        del runtime, examples, contexts
        save_checkpoint(model, config, out)
        del model
        lap("save")
        log("evaluating the written checkpoint on held-out scenes through AlpamayoRuntime.run")
        rt = AlpamayoRuntime.load(out, device="cpu", dtype=torch.float32)
        metrics, preds = report.evaluate(rt, held, k=EVAL_K, temperature=EVAL_TEMPERATURE,
                                         text_scenes=TEXT_EVAL_SCENES)
        lap("evaluation")
        build = {
            "demo_version": DEMO_VERSION, "seed": seed, "torch_threads": TORCH_THREADS,
            "torch": torch.__version__, "image_size": list(IMAGE_SIZE),
            "train_scene_seeds": [train_seeds(seed)[0], train_seeds(seed)[-1]],
            "heldout_scene_seeds": heldout_seeds(seed),
            "vocab_size": tok.get_vocab_size(), "dims": {k: (list(v) if isinstance(v, tuple) else v)
                                                        for k, v in vars(dims).items()},
            "parameters": n_params, "action_normalisation": norm,
            "train": {**summary, "lr": tc.lr, "warmup": tc.warmup, "expert_repeats": tc.expert_repeats,
                      "kv_grad_scale": tc.kv_grad_scale, "key_weights": list(tc.key_weights)},
            "expert_refinement": refine,
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


def load_quality(directory: Path) -> dict:
    return json.loads((Path(directory) / "quality.json").read_text())


# ------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    """`alpamayo-worker demo-checkpoint`: build (or reuse) the demo checkpoint, print where it is
    and its held-out quality table."""
    p = argparse.ArgumentParser(prog="alpamayo-worker demo-checkpoint", description=main.__doc__)
    p.add_argument("--force", action="store_true", help="rebuild even if a complete checkpoint is cached")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0, the embedded checkpoint)")
    p.add_argument("--cache-dir", default=None,
                   help="cache root (default: ALPAMAYO_CACHE, see worker.config)")
    p.add_argument("--quiet", action="store_true", help="no build progress, only the result")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    path = build_demo_checkpoint(args.cache_dir, seed=args.seed, force=args.force, progress=not args.quiet)
    q = load_quality(path)
    b = q.get("build", {})
    print(f"demo checkpoint: {path}")
    print(f"(v{b.get('demo_version', DEMO_VERSION)}, seed {b.get('seed')}, built in {b.get('build_wall_s')}s wall / "
          f"{b.get('build_cpu_s')}s CPU; this call {time.perf_counter() - t0:.1f}s)")
    print(report.format_table(q))
    return 0


if __name__ == "__main__":
    sys.exit(main())
