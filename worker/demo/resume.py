"""One joint-training schedule of the demo recipe over several calls (a device call is at most
10 minutes): `worker.demo.train.train` saves its whole state after `stop_at` steps and a later
call continues from it, giving the weights one uninterrupted run would (tests/worker/demo)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ResumeFile:
    """Where one joint-training schedule keeps its state between calls (a device call is at most
    10 minutes): model, optimiser, batch sampler, torch RNGs and the loss history, tagged with
    the recipe that wrote it (`key`), so another recipe or seed refuses it."""

    path: Path
    key: str
    stop_at: int | None = None          # save and stop after this many steps (None: run to the end)

    def save(self, steps: int, model, opt, sampler, hist: list[dict], log) -> None:
        state = {"key": self.key, "steps": steps, "model": model.state_dict(), "opt": opt.state_dict(),
                 "sampler": (sampler.rng.bit_generator.state, sampler.queues), "hist": hist,
                 "cpu_rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)
        if log:
            log(f"stopped after step {steps}: training state in {self.path} (run again with it to go on)")

    def load(self, model, opt, sampler, hist: list[dict], log) -> int:
        """-> the step to continue from (0 when there is no file yet)."""
        if not self.path.is_file():
            return 0
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        if state["key"] != self.key:
            raise ValueError(f"resume file {self.path} is from {state['key']!r}, not {self.key!r}: "
                             "delete it or name another file")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.rng.bit_generator.state, sampler.queues = state["sampler"]
        hist.extend(state["hist"])
        torch.set_rng_state(state["cpu_rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if log:
            log(f"resumed after step {state['steps']} from {self.path}")
        return state["steps"]
