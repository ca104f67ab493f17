"""producer_tools.publish: requests built from scenes for every task, request ids, request plans."""

import pytest

import schemas as S
from producer_tools import publish as P
from producer_tools.common import ToolError
from producer_tools.run_manifest import RunManifest
from worker.scenes import generate_scene
from worker.scenes.request import scene_item

from tests.producer_tools.sink_harness import KAFKA


@pytest.mark.parametrize("task", S.TASKS)
def test_build_request_per_task_is_valid(scene, task):
    item = scene_item(scene)
    req = P.run_request(item, task, 1, "run-x", max_tokens=8)
    S.validate_request(req)
    assert req.request_id == f"run-x:{scene.scene_id}:{task}:k1"
    assert req.run_id == "run-x" and req.labels["scene_id"] == scene.scene_id
    assert req.temperature == 0.0 and req.num_traj_samples == 1
    if task == "vqa":
        assert req.images == scene.vqa_images and req.camera_order == scene.vqa_camera_order
        assert req.question == scene.text.vqa_question
    else:
        assert req.images == scene.images and req.camera_order == scene.camera_order
    assert (req.egomotion is not None) == (task in S.TASKS_NEEDING_EGOMOTION)
    assert (req.future_egomotion is not None) == (task == "auto_labeling")
    assert req.max_tokens == (None if task == "trajectory" else 8)
    value, headers = S.encode_request(req)
    back = S.decode_request(value, headers, k_values=[1])
    assert back.request_id == req.request_id
    assert S.request_warnings(back) == []


def test_build_request_k_and_sampling(scene):
    req = P.run_request(scene_item(scene), "trajectory", 3, "r", seed=5)
    assert req.num_traj_samples == 3 and req.temperature == 0.6 and req.seed == 5
    S.validate_request(req, k_values=[1, 3])


def test_request_ids_are_stable_and_checked():
    assert P.request_id_for("run-1", "synth-00000001", "vqa", 2) == "run-1:synth-00000001:vqa:k2"
    with pytest.raises(ToolError):
        P.request_id_for("run 1", "s", "vqa", 1)
    with pytest.raises(ToolError):
        P.request_id_for("r" * 120, "s" * 20, "trajectory", 1)


def test_plan_requests_mixes(scene):
    items = [scene_item(generate_scene(i)) for i in range(3)]
    allp = [(it.scene_id, t) for it, t in P.plan_requests(items, ["trajectory", "vqa"], "all")]
    assert len(allp) == 6 and allp[:2] == [(items[0].scene_id, "trajectory"), (items[0].scene_id, "vqa")]
    rr = [t for _, t in P.plan_requests(items, ["trajectory", "vqa"], "round-robin")]
    assert rr == ["trajectory", "vqa", "trajectory"]


def test_planned_total_counts_each_scenes_own_tasks():
    assert P.planned_total([None] * 4, ["trajectory", "vqa"]) == 8
    assert P.planned_total([None] * 4, ["trajectory", "vqa"], "round-robin") == 4
    assert P.planned_total([None, ["vqa", "grounding", "trajectory"]], ["trajectory"]) == 4


async def test_a_resume_with_other_tasks_or_k_is_refused(tmp_path, scene):
    m = RunManifest.for_run(tmp_path, "run-r")
    m.open({"run_id": "run-r", "tasks": ["trajectory"], "k": 1}, planned=5)
    m.close()
    assert RunManifest.for_run(tmp_path, "run-r").planned == 5
    for tasks, k in ((["trajectory"], 2), (["vqa"], 1)):
        opts = P.PublishOptions(tasks=tasks, k=k, temperature=0.6, run_id="run-r", runs_dir=str(tmp_path),
                                progress=False)
        with pytest.raises(ToolError, match=r"run run-r was created with --tasks trajectory --k 1, not") as err:
            await P.publish(KAFKA, [scene_item(scene)], opts)
        assert "\n" not in str(err.value)
