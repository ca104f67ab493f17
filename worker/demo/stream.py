"""Fresh trajectory scenes for every joint-training step (recipes with `Recipe.stream`).

    stream = SceneStream(runtime, seed, count=40, lead_repeats=2, key_weights=..., image_size=(128, 128),
                         steps=2000, workers=14)
    stream(step) -> [Example] * count          # the trajectory examples of that step, never seen before

Why: the demo model reads a lead vehicle's speed from 1-2 px edge shifts across four separate
images, and what it learns of that grows with the number of distinct scenes, not with repeats
(docs/demo-model.md: a probe of the shipped model's visual tokens names the lead situation of
held-out lead scenes in 45% / 50% / 55% with 2,000 / 4,000 / 8,000 training scenes). A fixed set
of 8,000 scenes seen ten times is replaced by one new scene per trajectory row: forked workers
render and build the examples of the next steps while the GPU trains on this one.

Step s draws from its own block of seeds (`stream_seeds`), so a step's scenes depend on s alone:
a resumed run (worker/demo/resume.py) continues the same stream, and the order in which the
workers finish changes nothing. A scene without a lead vehicle is kept only for every
`lead_repeats`-th seed: lead scenes make the same share of the rows as `TrainConfig.lead_repeats`
gives a fixed set."""

from __future__ import annotations

import dataclasses
import multiprocessing

import numpy as np

STREAM_SEED_OFFSET = 10_000_000       # step s's seeds: seed * 100_000_000 + offset + s * SEED_BLOCK + j
SEED_BLOCK = 1_000                    # a step keeps the first `count` of its block that pass the lead filter
WINDOW_PER_WORKER = 2                 # steps prepared ahead of the one training, per worker (a step
                                      # takes a worker ~40 x 60 ms; the GPU trains one in ~0.25 s)
EXAMPLE_TENSORS = ("input_ids", "positions", "weights", "action")

_RUNTIME = None                       # the CPU runtime forked workers build examples with


def example_arrays(e):
    """An Example with its tensors as numpy arrays: handed back through a pool as tensors, each
    would be shared through a file descriptor (torch's reducers), thousands at once."""
    return dataclasses.replace(e, **{f: getattr(e, f).numpy() for f in EXAMPLE_TENSORS if getattr(e, f) is not None})


def example_tensors(e):
    import torch

    return dataclasses.replace(e, **{f: torch.from_numpy(getattr(e, f)) for f in EXAMPLE_TENSORS
                                     if getattr(e, f) is not None})


def stream_seeds(seed: int, step: int, count: int, lead_repeats: int) -> list[int]:
    """The `count` scene seeds of `step`: its block's seeds in order, those without a lead vehicle
    only where seed % lead_repeats == 0."""
    from worker.scenes.facts import sample_facts

    first = seed * 100_000_000 + STREAM_SEED_OFFSET + step * SEED_BLOCK
    out = []
    for s in range(first, first + SEED_BLOCK):
        if s % lead_repeats == 0 or sample_facts(np.random.default_rng(s))[0].lead_present:
            out.append(s)
            if len(out) == count:
                return out
    raise RuntimeError(f"stream step {step}: fewer than {count} of {SEED_BLOCK} seeds kept")


def _step_examples(job: tuple) -> list:
    from worker.demo import train
    from worker.scenes import generate_scene

    seed, step, count, lead_repeats, image_size, key_weights = job
    scenes = [generate_scene(s, image_size) for s in stream_seeds(seed, step, count, lead_repeats)]
    out = train.build_examples(_RUNTIME, scenes, tasks=("trajectory",), key_weights=key_weights, first_index=-1)
    return [example_arrays(e) for e in out]


def _one_thread() -> None:
    """A forked worker's first act: one intra-op thread. The parent's OpenMP thread pool does not
    survive the fork; a product that asked it for threads waited forever (seen on this CPU)."""
    import torch

    torch.set_num_threads(1)


class SceneStream:
    """Forks `workers` processes (create it before CUDA is initialised) that build each step's
    trajectory examples `WINDOW_PER_WORKER` x workers steps ahead; `close()` ends them."""

    def __init__(self, runtime, seed: int, count: int, lead_repeats: int, key_weights: tuple,
                 image_size: tuple[int, int], steps: int, workers: int):
        global _RUNTIME
        _RUNTIME = runtime
        self.job = lambda step: (seed, step, count, max(1, lead_repeats), tuple(image_size), tuple(key_weights))
        self.steps = steps
        self.window = WINDOW_PER_WORKER * workers
        self.pool = multiprocessing.get_context("fork").Pool(workers, initializer=_one_thread)
        self.pending: dict = {}

    def __call__(self, step: int) -> list:
        for s in range(step, min(step + self.window, self.steps)):
            if s not in self.pending:
                self.pending[s] = self.pool.apply_async(_step_examples, (self.job(s),))
        return [example_tensors(e) for e in self.pending.pop(step).get()]

    def close(self) -> None:
        global _RUNTIME
        self.pool.terminate()
        self.pool.join()
        self.pending.clear()
        _RUNTIME = None
