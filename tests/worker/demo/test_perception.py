"""The perception phase (worker/demo/perception.py): lead scenes seen through the front cameras,
trained on the reasoning's first two sentences, its held-out check reading the situation word."""

from __future__ import annotations

import pytest
import torch

from worker.demo import build, perception
from worker.demo_cache import demo_checkpoint

from tests.worker.demo.test_checkpoint import untrained_model

CONFIG = perception.PerceptionConfig(scenes=12, steps=2, rows=2, warmup=1, heldout=2)


@pytest.fixture(scope="module")
def setup():
    model, runtime = untrained_model(demo_checkpoint())
    train_seeds, held_seeds = perception.seeds(0, CONFIG)
    scenes = [perception.scene(s, (64, 64)) for s in train_seeds]
    examples = perception.build_examples(runtime, scenes, (10.0, 15.0, 3.0))
    return model, runtime, scenes, examples


def test_examples_are_the_lead_scenes_front_cameras_and_first_two_sentences(setup):
    model, runtime, scenes, examples = setup
    lead = [i for i, s in enumerate(scenes) if s.facts.lead_relation != "none"]
    assert [e.scene_index for e in examples] == lead and lead
    for e in examples:
        s = scenes[e.scene_index]
        assert tuple(s.camera_ids) == perception.FRONT_CAMERAS and e.frames.shape[0] == 2 * 4
        text = runtime.tok.decode(e.target_ids.tolist())
        assert text.strip() == perception.target(s).strip() and text.count(". ") <= 1
        word = runtime.tok.decode([int(e.target_ids[e.offset])]).strip()
        assert word and s.facts.lead_relation.startswith(word)
        assert float(e.weights[e.offset]) == 15.0          # the recipe's lead-situation weight


def test_the_full_scenes_are_refused(setup):
    model, runtime, scenes, examples = setup
    full = build._scene(perception.seeds(0, CONFIG)[0][0], (64, 64))
    with pytest.raises(ValueError, match="front cameras"):
        perception.build_examples(runtime, [full], (1.0, 1.0, 1.0))


def test_the_phase_trains_the_vlm_and_reports_the_situation_accuracy(setup):
    model, runtime, scenes, examples = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    summary = perception.run(model, runtime, examples, examples[:2], CONFIG, (10.0, 15.0, 3.0), seed=0)
    assert summary["steps"] == 2 and summary["examples"] == len(examples)
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and len(summary["final_per_situation"]) == 4
    changed = [k for k in before if not torch.equal(before[k], model.state_dict()[k])]
    assert any(k.startswith("vlm.") for k in changed)
    assert not any(k.startswith("expert.") for k in changed)          # no expert rows in this phase


def test_the_cli_stops_after_the_phase_only_with_a_file():
    with pytest.raises(SystemExit):
        build.main(["--recipe", "cpu", "--stop-at-step", "0"])


def test_a_build_stopped_after_the_phase_saves_it_without_joint_examples_then_loads_it(tmp_path, monkeypatch):
    """`--perception-file F --stop-at-step 0`: the phase runs and its weights go to F, and the joint
    examples are not built (43 s of a device call); the next build with F loads the phase and goes on
    to the joint examples."""
    import dataclasses

    recipe = dataclasses.replace(build.RECIPES["cpu"], name="tiny-perception", train_scenes=8, text_task_scenes=1,
                                 heldout_scenes=1, vocab_size=300, perception=dict(scenes=8, steps=1, rows=2,
                                                                                   warmup=1, heldout=1))
    real, joint = build._examples, []

    def examples(job):
        joint.append(job)
        return real(job)

    monkeypatch.setattr(build, "_examples", examples)
    f = tmp_path / "p.pt"
    assert build._build(tmp_path / "a", 0, False, recipe, stop_at=0, perception_file=f) is False
    assert f.is_file() and joint == []
    state = torch.load(f, weights_only=True)

    class Loaded(Exception):
        pass

    def stop_at_joint(model, *a, **k):     # the joint phase starts from the file's weights
        assert all(torch.equal(v, state[k_]) for k_, v in model.state_dict().items())
        raise Loaded

    monkeypatch.setattr(perception, "run", lambda *a, **k: pytest.fail("the phase ran again"))
    from worker.demo import train

    monkeypatch.setattr(train, "train", stop_at_joint)
    with pytest.raises(Loaded):
        build._build(tmp_path / "b", 0, False, recipe, perception_file=f)
    assert joint                                    # this time the joint examples were built
