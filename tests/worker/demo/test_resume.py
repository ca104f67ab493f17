"""One joint-training schedule over several calls (worker/demo/resume.py): stopping after some
steps and continuing from the saved state gives the weights of one uninterrupted run, bit for bit
(CPU, fp32), and a state written by another recipe is refused."""

from __future__ import annotations

import pytest
import torch

from worker.demo import build, train
from worker.demo.resume import ResumeFile
from worker.demo_cache import demo_checkpoint
from worker.scenes import DEFAULT_IMAGE_SIZE, generate_scene

from tests.worker.demo.test_checkpoint import untrained_model


def _train(resume: ResumeFile | None = None):
    model, runtime = untrained_model(demo_checkpoint())
    examples = train.build_examples(runtime, [generate_scene(s, DEFAULT_IMAGE_SIZE) for s in build.train_seeds(0)[:3]],
                                    tasks=("trajectory",))
    torch.manual_seed(1)                  # the flow-matching noise and times
    summary = train.train(model, runtime, examples, train.TrainConfig(steps=4, warmup=1, per_step=(("trajectory", 2),)),
                          resume=resume)
    return model.state_dict(), summary


def test_a_schedule_stopped_and_resumed_gives_the_weights_of_one_run(tmp_path):
    whole, summary = _train()
    path = tmp_path / "state.pt"
    _, first = _train(ResumeFile(path, "recipe x", stop_at=2))
    assert first == {"steps": 2, "stopped_at": 2} and path.is_file()
    resumed, second = _train(ResumeFile(path, "recipe x"))
    assert second["steps"] == summary["steps"] == 4
    assert second["final_weighted_ce"] == summary["final_weighted_ce"]
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    with pytest.raises(ValueError, match="is from 'recipe x', not 'recipe y'"):
        _train(ResumeFile(path, "recipe y"))


def test_the_cli_wants_a_file_for_the_state():
    with pytest.raises(SystemExit):
        build.main(["--recipe", "cpu", "--stop-at-step", "5"])


def test_a_build_stopped_to_be_resumed_leaves_no_checkpoint(tmp_path, monkeypatch):
    seen = []

    def stopped(out, seed, progress, recipe, device, workers, budget_s, resume_file, stop_at, perception_file) -> bool:
        seen.append((resume_file, stop_at))
        out.mkdir(parents=True)
        return False

    monkeypatch.setattr(build, "_build", stopped)
    out = tmp_path / "ck"
    assert build.build_demo_checkpoint(out=out, progress=False, resume_file=tmp_path / "s.pt", stop_at=7) is None
    assert seen == [(tmp_path / "s.pt", 7)] and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp")]       # its scratch is gone
