"""Fresh trajectory scenes every joint-training step (worker/demo/stream.py): a step's scenes are a
function of the step alone, forked workers hand back exactly what building them in-process gives,
and the training loop takes its trajectory rows from the stream, not from the fixed examples
(a stopped and resumed schedule still ends in the weights of one run)."""

from __future__ import annotations

import numpy as np
import torch

from worker.demo import train
from worker.demo.resume import ResumeFile
from worker.demo.stream import SceneStream, stream_seeds
from worker.demo_cache import demo_checkpoint
from worker.scenes import DEFAULT_IMAGE_SIZE, generate_scene
from worker.scenes.facts import sample_facts

from tests.worker.demo.test_checkpoint import untrained_model


def test_a_steps_seeds_are_its_own_and_scenes_without_a_lead_come_half_as_often():
    steps = [stream_seeds(0, s, 40, lead_repeats=2) for s in range(4)]
    assert stream_seeds(0, 2, 40, 2) == steps[2] and len(set(sum(steps, []))) == 160     # no seed twice
    assert stream_seeds(1, 2, 40, 2) != steps[2]
    lead = {s: sample_facts(np.random.default_rng(s))[0].lead_present for s in sum(steps, [])}
    assert all(s % 2 == 0 for s, has in lead.items() if not has)
    share = np.mean(list(lead.values()))
    assert 0.5 < share < 0.7, share                   # ~0.41 of all scenes have a lead; ~0.58 kept
    assert all(lead.values()) is False and stream_seeds(0, 0, 40, 1)[:5] == list(range(10_000_000, 10_000_005))


def test_the_workers_build_what_the_process_itself_builds():
    _, runtime = untrained_model(demo_checkpoint())
    stream = SceneStream(runtime, seed=0, count=2, lead_repeats=2, key_weights=(10.0, 15.0, 3.0),
                         image_size=DEFAULT_IMAGE_SIZE, steps=3, workers=2)
    try:
        got = [stream(s) for s in range(3)]
    finally:
        stream.close()
    for s, examples in enumerate(got):
        scenes = [generate_scene(x, DEFAULT_IMAGE_SIZE) for x in stream_seeds(0, s, 2, 2)]
        want = train.build_examples(runtime, scenes, tasks=("trajectory",), key_weights=(10.0, 15.0, 3.0),
                                    first_index=-1)
        assert [e.task for e in examples] == ["trajectory"] * 2
        for a, b in zip(examples, want):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.action, b.action)
            assert np.array_equal(a.frames, b.frames)


def _train(stream, resume: ResumeFile | None = None):
    model, runtime = untrained_model(demo_checkpoint())
    fixed = train.build_examples(runtime, [generate_scene(s, DEFAULT_IMAGE_SIZE) for s in range(2)],
                                 tasks=("trajectory", "meta_action"))
    torch.manual_seed(1)
    c = train.TrainConfig(steps=4, warmup=1, per_step=(("trajectory", 2), ("meta_action", 1)))
    summary = train.train(model, runtime, fixed, c, resume=resume, stream=stream)
    return model.state_dict(), summary


def test_training_takes_its_trajectory_rows_from_the_stream(tmp_path):
    _, runtime = untrained_model(demo_checkpoint())
    per_step = [train.build_examples(runtime, [generate_scene(100 + 2 * s + j, DEFAULT_IMAGE_SIZE) for j in range(2)],
                                     tasks=("trajectory",)) for s in range(4)]
    asked = []

    def stream(step):
        asked.append(step)
        return per_step[step]

    sampler = train._Sampler([per_step[0][0], per_step[0][1]], train.TrainConfig(per_step=(("trajectory", 2),),
                             groups=(("trajectory",),)), seed=0, streamed="trajectory")
    assert sampler.step() == [[]] and sampler.groups == [["trajectory"]]       # nothing drawn from the fixed set
    whole, summary = _train(stream)
    assert asked == [0, 1, 2, 3]
    other, _ = _train(lambda step: per_step[3 - step])                         # other rows, other weights
    assert not all(torch.equal(other[k], whole[k]) for k in whole)
    path = tmp_path / "state.pt"
    asked.clear()
    _train(stream, ResumeFile(path, "streamed", stop_at=2))
    resumed, second = _train(stream, ResumeFile(path, "streamed"))
    assert asked == [0, 1, 2, 3] and second["steps"] == summary["steps"] == 4
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
