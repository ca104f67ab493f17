"""Tests for the synthetic scene generator (worker/scenes/)."""

from __future__ import annotations

import io
import json
import math
import re
import time

import numpy as np
import pytest
from PIL import Image

from worker import scenes as S
from worker.scenes.render import _COLORS, _LIGHT_RGB
from worker.scenes.road import frenet
from worker.scenes.request import (SceneInputError, SceneItem, build_request, runtime_frames, runtime_request,
                                   scene_item)
from worker.scenes.structs import ACCEL_MAX, ACCEL_MIN, CURVATURE_MAX, DT, EGO_FRONT, JERK_MAX, MIN_LEAD_CLEARANCE

SEEDS = range(40)


@pytest.fixture(scope="module")
def scenes_64():
    return [S.generate_scene(s) for s in SEEDS]


def _facts_plans(n: int, seed0: int = 1000):
    out = []
    for seed in range(seed0, seed0 + n):
        f, p = S.sample_facts(np.random.default_rng(seed))
        out.append((seed, f, p))
    return out


@pytest.fixture(scope="module")
def many_plans():
    return _facts_plans(1500)


# ------------------------------------------------------------------------------------------
# Determinism, shapes, frames
# ------------------------------------------------------------------------------------------


def test_same_seed_identical_bytes():
    for seed in (0, 7, 123456):
        a = S.encode_scene(S.generate_scene(seed))
        b = S.encode_scene(S.generate_scene(seed))
        assert a == b


def test_different_seeds_differ(scenes_64):
    blobs = {S.encode_scene(sc) for sc in scenes_64}
    assert len(blobs) == len(scenes_64)
    fronts = {sc.images[4 + 3] for sc in scenes_64}
    assert len(fronts) == len(scenes_64)


def test_scene_ids_stable():
    sc = S.generate_scene(42)
    assert sc.scene_id == "synth-00000042" and sc.seed == 42


def test_shapes_and_cameras(scenes_64):
    for sc in scenes_64[:10]:
        assert sc.camera_ids == [0, 1, 2, 3, 5, 6]
        assert sc.camera_order == [
            "camera_cross_left_120fov", "camera_front_wide_120fov", "camera_cross_right_120fov",
            "camera_rear_left_70fov", "camera_rear_right_70fov", "camera_front_tele_30fov",
        ]  # fmt: skip
        assert sc.vqa_camera_ids == [0, 1, 2, 3, 4, 5]
        assert sc.vqa_camera_order[4] == "camera_rear_tele_30fov"
        assert len(sc.images) == 24 and len(sc.vqa_images) == 24
        assert sc.frame_offsets_s == [-0.3, -0.2, -0.1, 0.0]
        # cameras shared by both profiles carry the same frames
        for cid in (0, 1, 2, 3, 5):
            i, j = sc.camera_ids.index(cid), sc.vqa_camera_ids.index(cid)
            assert sc.images[4 * i : 4 * i + 4] == sc.vqa_images[4 * j : 4 * j + 4]
        assert np.asarray(sc.ego_history_xyz).shape == (16, 3)
        assert np.asarray(sc.ego_history_rot).shape == (16, 3, 3)
        assert np.asarray(sc.ego_future_xyz).shape == (64, 3)
        assert np.asarray(sc.ego_future_rot).shape == (64, 3, 3)
        assert sc.image_format == "png" and sc.image_size == S.DEFAULT_IMAGE_SIZE
        for blob in sc.images[:4]:
            im = Image.open(io.BytesIO(blob))
            assert im.format == "PNG" and im.size == S.DEFAULT_IMAGE_SIZE and im.mode == "RGB"


def test_jpeg_and_non_square():
    sc = S.generate_scene(3, image_size=(96, 64), image_format="jpeg")
    assert sc.image_format == "jpeg"
    im = Image.open(io.BytesIO(sc.images[0]))
    assert im.format == "JPEG" and im.size == (96, 64)
    with pytest.raises(ValueError):
        S.generate_scene(3, image_format="bmp")


def test_frames_move_with_ego(scenes_64):
    moving = [sc for sc in scenes_64 if sc.facts.ego_speed > 3.0]
    assert moving
    for sc in moving:
        front = sc.images[4:8]
        assert front[0] != front[3], sc.scene_id


def test_history_last_pose_origin_identity(scenes_64):
    for sc in scenes_64:
        assert sc.ego_history_xyz[-1] == [0.0, 0.0, 0.0]
        assert sc.ego_history_rot[-1] == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
        for rot in sc.ego_history_rot + sc.ego_future_rot:
            r = np.asarray(rot)
            assert np.allclose(r @ r.T, np.eye(3), atol=1e-12)
            assert r[2].tolist() == [0.0, 0.0, 1.0] and r[0][2] == 0.0 and r[1][2] == 0.0


def test_history_spacing_matches_speed(scenes_64):
    for sc in scenes_64:
        f = sc.facts
        h = np.asarray(sc.ego_history_xyz)
        step = np.linalg.norm(np.diff(h, axis=0), axis=1)
        t = np.asarray(S.HISTORY_TIMES_S)
        v = np.maximum(0.0, f.ego_speed + f.ego_accel * t)
        # distance per 0.1 s interval = mean speed * 0.1 (exact up to the speed clamp kink)
        assert np.allclose(step, 0.05 * (v[:-1] + v[1:]), atol=0.02), sc.scene_id
        # history moves forward along its heading
        yaw = np.arctan2([r[1][0] for r in sc.ego_history_rot], [r[0][0] for r in sc.ego_history_rot])
        d = np.diff(h[:, :2], axis=0)
        fwd = d[:, 0] * np.cos(yaw[1:]) + d[:, 1] * np.sin(yaw[1:])
        assert (fwd >= -1e-9).all()


def test_future_spacing_matches_plan_speed():
    for seed, f, p in _facts_plans(200, 50):
        xyz = np.vstack([[0.0, 0.0, 0.0], np.asarray(p.xyz)])
        step = np.linalg.norm(np.diff(xyz, axis=0), axis=1)
        v = np.asarray(p.speed)
        assert np.allclose(step, 0.05 * (v[:-1] + v[1:]), rtol=0.02, atol=1e-3), seed
        assert len(S.FUTURE_TIMES_S) == 64 and S.FUTURE_TIMES_S[0] == 0.1 and S.FUTURE_TIMES_S[-1] == 6.4


# ------------------------------------------------------------------------------------------
# Physical sanity of the planner
# ------------------------------------------------------------------------------------------


def test_future_physically_sane(many_plans):
    for seed, f, p in many_plans:
        v = np.asarray(p.speed)
        a = np.asarray(p.accel)
        assert (v >= 0.0).all(), seed
        assert a.min() >= ACCEL_MIN - 1e-9 and a.max() <= ACCEL_MAX + 1e-9, seed
        assert np.allclose(np.diff(v), a * DT, atol=1e-9), seed
        a0 = f.ego_accel if f.ego_speed > 0.5 else 0.0
        jerk = np.abs(np.diff(np.concatenate([[a0], a]))) / DT
        assert jerk.max() <= JERK_MAX + 1e-6, (seed, jerk.max())
        # no reverse motion: every step advances along the heading
        xyz = np.vstack([[0.0, 0.0, 0.0], np.asarray(p.xyz)])
        yaw = np.concatenate([[0.0], p.yaw])
        d = np.diff(xyz[:, :2], axis=0)
        mid = 0.5 * (yaw[:-1] + yaw[1:])
        assert (d[:, 0] * np.cos(mid) + d[:, 1] * np.sin(mid) >= -1e-9).all(), seed
        assert np.abs(p.curvature).max() <= CURVATURE_MAX + 1e-12
        # along-road progress never decreases
        assert (np.diff(p.s) >= -1e-6).all(), seed


def test_stops_before_red_light_stop_line(many_plans):
    n_red = 0
    for seed, f, p in many_plans:
        if f.traffic_light != "red":
            continue
        n_red += 1
        s_max = max(p.s)
        assert s_max + EGO_FRONT < f.stop_line_distance, (seed, s_max, f.stop_line_distance)
        assert p.speed[-1] < 0.5 and p.longitudinal == "Stop", seed
    assert n_red > 200


def test_future_positions_respect_stop_line_from_scene(scenes_64):
    for sc in scenes_64:
        f = sc.facts
        if f.traffic_light == "red" or (f.pedestrian_crossing and f.traffic_light != "yellow"):
            k = f.road_curvature
            s_max = max(frenet(k, x, y)[0] for x, y, _ in sc.ego_future_xyz)
            limit = f.stop_line_distance if f.traffic_light == "red" else f.pedestrian_distance - 2.0
            assert s_max + EGO_FRONT < limit, sc.scene_id


def test_pedestrian_yield(many_plans):
    n = 0
    for seed, f, p in many_plans:
        if f.pedestrian_crossing:
            n += 1
            assert p.longitudinal == "Stop", seed
            assert max(p.s) + EGO_FRONT < f.pedestrian_distance - 1.5, seed
    assert n > 50


def test_lead_never_overtaken_or_hit(many_plans):
    n = 0
    for seed, f, p in many_plans:
        if not f.lead_present:
            assert p.lead_s == []
            continue
        n += 1
        gaps = np.asarray(p.lead_s) - np.asarray(p.s)
        assert gaps.min() >= MIN_LEAD_CLEARANCE, (seed, gaps.min())
        assert gaps.min() - EGO_FRONT > 0.0
        assert (np.diff(p.lead_s) >= -1e-9).all()  # the lead never reverses either
    assert n > 500


def test_lane_change_only_for_blocked_ego_lane(many_plans):
    for seed, f, p in many_plans:
        if f.blocked_lane_kind == "ego":
            assert p.lane == f"Change {f.blocked_lane_side.capitalize()}", seed
            side = 1.0 if f.blocked_lane_side == "left" else -1.0
            assert side * p.d[-1] > 2.5, seed
            assert not f.lead_present
        else:
            assert p.lane == "Lane Keep", seed
            assert max(abs(d) for d in p.d) < 0.3, seed


# ------------------------------------------------------------------------------------------
# Text targets
# ------------------------------------------------------------------------------------------

META_RE = re.compile(
    r"^Longitudinal: (Keep Speed|Accelerate|Decelerate|Strong Deceleration|Stop)\.\n"
    r"Lateral: (Go Straight|Turn Left|Turn Right)\.\n"
    r"Lane: (Lane Keep|Change Left|Change Right)\.$"
)


def test_reasoning_names_light_and_lead(scenes_64):
    for sc in scenes_64:
        f, r = sc.facts, sc.text.reasoning
        first, second = r.split(". ")[0], r.split(". ")[1]
        if f.traffic_light == "none":
            assert first == "There is no traffic light ahead"
        else:
            assert first.startswith(f"The traffic light ahead is {f.traffic_light}")
        for other in set(S.LIGHT_STATES) - {f.traffic_light, "none"}:
            assert other not in r
        if f.lead_present:
            assert second.startswith("The lead vehicle is") and f"{round(f.lead_gap)} meters" in second
        else:
            assert second == "There is no lead vehicle ahead"
        assert ("pedestrian" in r) == f.pedestrian_crossing


def test_meta_action_format_and_consistency(many_plans):
    for seed, f, p in many_plans[:400]:
        t = S.scene_text(f, p, 0, None)
        m = META_RE.match(t.meta_action)
        assert m, t.meta_action
        lon, lat, lane = m.groups()
        if f.traffic_light == "red" or f.pedestrian_crossing or p.yellow_stop:
            assert lon == "Stop"
            assert "stop" in t.reasoning
        if "must stop behind it" in t.reasoning:
            assert lon == "Stop"
        if f.blocked_lane_kind == "ego":
            assert f"changes to the {f.blocked_lane_side} lane" in t.reasoning
            assert lane == f"Change {f.blocked_lane_side.capitalize()}"
        else:
            assert lane == "Lane Keep" and "changes to" not in t.reasoning
        if lat != "Go Straight":
            assert ("left" if lat == "Turn Left" else "right") in t.reasoning.split(". ")[-1]
        # the model's decoder splits CoT and meta action at the first "Longitudinal:" (doc 5.1)
        out = t.reasoning + "\n" + t.meta_action
        i = re.search(r"(?:Longitudinal|Lateral|Lane)\s*:", out).start()
        assert out[:i].rstrip() == t.reasoning and out[i:] == t.meta_action


def test_templates_small_vocabulary(many_plans):
    words = set()
    for seed, f, p in many_plans[:500]:
        t = S.scene_text(f, p, seed % 4, S.lead_bbox(f))
        words |= set(re.findall(r"[A-Za-z]+", t.reasoning + " " + t.meta_action + " " + t.vqa_answer))
    assert len(words) < 140, sorted(words)


def test_auto_labeling_json(scenes_64):
    for sc in scenes_64:
        obj = json.loads(sc.text.auto_labeling)
        assert list(obj) == [
            "critical_components_analysis", "ego_vehicle_motion_analysis",
            "trajectory_analysis", "chain_of_causation",
        ]  # fmt: skip
        assert all(isinstance(v, str) and v for v in obj.values())
        assert obj["chain_of_causation"] == sc.text.reasoning
        assert f"traffic light: {sc.facts.traffic_light}" in obj["critical_components_analysis"]


def test_vqa_answers():
    for seed in range(30):
        for q in range(4):
            sc = S.generate_scene(seed, task_defaults=S.TaskDefaults(vqa_question=q))
            f, t = sc.facts, sc.text
            assert t.vqa_question == S.VQA_QUESTIONS[q]
            if q == 0:
                assert f.traffic_light in t.vqa_answer or (f.traffic_light == "none" and "no traffic light" in t.vqa_answer)
            elif q == 1:
                assert t.vqa_answer.startswith("Yes" if f.lead_present else "No")
            elif q == 2:
                assert t.vqa_answer.startswith("Yes" if f.pedestrian_crossing else "No")
            else:
                assert t.vqa_answer.startswith("Yes") == ("Longitudinal: Stop." in t.meta_action)
    seeded = {S.generate_scene(s).text.vqa_question for s in range(40)}
    assert seeded == set(S.VQA_QUESTIONS)


def test_grounding(scenes_64):
    seen = {True: 0, False: 0}
    for sc in scenes_64:
        t = sc.text
        assert t.grounding_question == S.GROUNDING_QUESTION
        boxes = json.loads(t.grounding_answer)
        seen[sc.facts.lead_present] += 1
        if not sc.facts.lead_present:
            assert boxes == [] and t.grounding_answer == "[]"
            continue
        assert len(boxes) == 1 and boxes[0]["label"] == "lead vehicle"
        x1, y1, x2, y2 = boxes[0]["bbox_2d"]
        assert 0 <= x1 < x2 <= 1000 and 0 <= y1 < y2 <= 1000
        assert x2 - x1 >= 100  # the lead is always clearly visible at 64 px
        # the box covers pixels of the lead's colour in the front-wide camera at t0
        im = np.asarray(Image.open(io.BytesIO(sc.images[4 + 3])))
        H, W, _ = im.shape
        crop = im[int(y1 * H / 1000) : int(math.ceil(y2 * H / 1000)), int(x1 * W / 1000) : int(math.ceil(x2 * W / 1000))]
        color = np.asarray(_COLORS[sc.facts.lead_color])
        frac = (np.abs(crop.astype(int) - color).sum(-1) == 0).mean()
        if not sc.facts.pedestrian_crossing:  # a pedestrian in front may hide part of it
            assert frac > 0.3, (sc.scene_id, frac)
    assert seen[True] >= 5 and seen[False] >= 5


def test_front_cameras_show_light_state(scenes_64):
    for sc in scenes_64:
        light = sc.facts.traffic_light
        for idx in (4 + 3, 20 + 3):  # front wide and front tele, last frame
            im = np.asarray(Image.open(io.BytesIO(sc.images[idx]))).astype(int)
            for state, rgb in _LIGHT_RGB.items():
                n = int((np.abs(im - np.asarray(rgb)).sum(-1) == 0).sum())
                if state == light:
                    assert n >= 60, (sc.scene_id, idx, state, n)  # a big block (>= ~8x8 px)
                else:
                    assert n == 0, (sc.scene_id, idx, state, n)


# ------------------------------------------------------------------------------------------
# Persistence, large payloads, plots
# ------------------------------------------------------------------------------------------


def test_read_write_round_trip(tmp_path):
    sc = S.generate_scene(11)
    path = S.write_scene(sc, tmp_path / "x.msgpack")
    back = S.read_scene(path)
    assert back == sc
    assert S.encode_scene(back) == S.encode_scene(sc)
    paths = S.write_scenes(tmp_path / "out", 3, seed0=100)
    assert [p.name for p in paths] == [f"scene-synth-{s:08d}.msgpack" for s in (100, 101, 102)]
    assert S.read_scene(paths[1]) == S.generate_scene(101)
    ids = [sc.scene_id for sc in S.iter_scenes(3, seed0=100)]
    assert ids == ["synth-00000100", "synth-00000101", "synth-00000102"]


def test_large_image_size_payload():
    sc = S.generate_scene(5, image_size=(1280, 720))
    total = sum(len(b) for b in sc.images)
    assert total > 1 << 20, total
    im = Image.open(io.BytesIO(sc.images[4 + 3]))
    assert im.size == (1280, 720)
    assert S.lead_bbox(sc.facts, (1280, 720)) == S.lead_bbox(sc.facts, (1280, 720))


def test_bev_plot(tmp_path, scenes_64):
    preds = [None, np.asarray(scenes_64[1].ego_future_xyz)[None].repeat(3, 0) + 0.5]
    preds += [np.asarray(sc.ego_future_xyz) for sc in scenes_64[2:6]]
    out = S.bev_plot(scenes_64[:6], preds, tmp_path / "bev.png", title="bf16-dflash2")
    im = Image.open(out)
    assert im.format == "PNG" and im.size[0] > 200


def test_bev_figure_is_labelled(scenes_64):
    """Axes in metres, a legend naming ground truth, history and every sample, the profile in the title."""
    import matplotlib.pyplot as plt

    preds = [np.asarray(scenes_64[0].ego_future_xyz)[None].repeat(3, 0) + 0.5, None]
    fig = S.bev_figure(scenes_64[:2], preds, title="fp8-dflash2, K=3")
    try:
        ax0, ax1 = fig.axes[:2]
        assert "(m" in ax0.get_xlabel() and "(m)" in ax0.get_ylabel()
        labels = [t.get_text() for t in ax0.get_legend().get_texts()]
        assert {"ground truth (6.4 s)", "ego history", "sample 1", "sample 2", "sample 3"} <= set(labels)
        assert not any(t.get_text().startswith("sample") for t in ax1.get_legend().get_texts())
        assert fig._suptitle.get_text() == "fp8-dflash2, K=3"
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------
# Distribution and speed
# ------------------------------------------------------------------------------------------


def test_distribution_report_500():
    rep = S.distribution_report(500, seed0=0)
    print(json.dumps(rep, indent=1))
    lights = rep["traffic_light"]
    assert set(lights) == set(S.LIGHT_STATES)
    assert lights["none"] > 0.25 and lights["green"] > 0.15 and lights["red"] > 0.15 and lights["yellow"] > 0.08
    lead = rep["lead"]
    assert set(lead) == {"none", "stopped", "slower", "similar", "faster"}
    assert 0.35 < lead["none"] < 0.65 and min(lead.values()) > 0.05
    assert rep["pedestrian"]["none"] < 0.95 and rep["blocked_lane"]["none"] < 0.95
    assert rep["blocked_lane"]["ego"] > 0.03 and rep["blocked_lane"]["adjacent"] > 0.03
    assert set(rep["road"]) == {"straight", "left", "right"} and min(rep["road"].values()) > 0.2
    lon = rep["longitudinal"]
    assert set(lon) == {"Keep Speed", "Accelerate", "Decelerate", "Strong Deceleration", "Stop"}
    assert lon["Stop"] < 0.6 and min(lon.values()) > 0.01
    assert set(rep["lateral"]) == {"Go Straight", "Turn Left", "Turn Right"}


def test_generation_speed_64px():
    S.generate_scene(0)
    n = 40
    t0 = time.process_time()
    for seed in range(n):
        S.generate_scene(seed)
    per_scene = (time.process_time() - t0) / n
    print(f"64x64 scene: {per_scene * 1e3:.2f} ms CPU")
    # an order-of-magnitude guard (about 10 ms on an idle core; 20 ms was exceeded on a loaded
    # 2-core machine): training generates scenes on the fly, a 10x slower generator would show here
    assert per_scene < 0.100


# ------------------------------------------------------------------------------------------
# Scene -> request (worker/scenes/request.py)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["trajectory", "meta_action", "auto_labeling", "vqa", "grounding"])
def test_build_request_from_a_scene(scenes_64, task):
    import schemas

    sc = scenes_64[3]
    req = build_request(sc, task, 1, max_tokens=8)
    schemas.validate_request(req)
    assert req.request_id == f"{sc.scene_id}-{task}-k1" and req.run_id is None and req.labels == {}
    assert req.temperature == 0.0 and req.num_traj_samples == 1 and req.submitted_at is None
    vqa = task == "vqa"
    assert req.images == (sc.vqa_images if vqa else sc.images)
    assert req.camera_order == (sc.vqa_camera_order if vqa else sc.camera_order)
    assert req.num_frames_per_camera == 4
    assert req.question == {"vqa": sc.text.vqa_question, "grounding": sc.text.grounding_question}.get(task)
    assert (req.egomotion is not None) == (task in schemas.TASKS_NEEDING_EGOMOTION)
    assert (req.future_egomotion is not None) == (task == "auto_labeling")
    assert req.max_tokens == (None if task == "trajectory" else 8)


def test_build_request_parameters_and_refusals(scenes_64):
    sc = scenes_64[4]
    k3 = build_request(sc, "trajectory", 3, seed=5)
    assert k3.temperature == 0.6 and k3.seed == 5 and k3.request_id == f"{sc.scene_id}-trajectory-k3"
    asked = build_request(sc, "vqa", question="Is it raining?", request_id="q-1", run_id="r", labels={"a": "b"},
                          submitted_at=12.5, top_p=0.5)
    assert (asked.question, asked.request_id, asked.run_id, asked.labels, asked.submitted_at, asked.top_p) == \
        ("Is it raining?", "q-1", "r", {"a": "b"}, 12.5, 0.5)
    assert build_request(scene_item(sc), "grounding") == build_request(sc, "grounding")
    with pytest.raises(SceneInputError, match="unknown task"):
        build_request(sc, "parking")
    with pytest.raises(SceneInputError, match="needs ego history"):
        build_request(SceneItem(scene_id="x", camera_order=None, num_frames=4, load_images=lambda: []), "trajectory")


def test_runtime_request_is_the_decoded_request(scenes_64):
    sc = scenes_64[5]
    traj = runtime_request(sc, "trajectory", max_tokens=9)
    w, h = S.DEFAULT_IMAGE_SIZE
    assert traj.frames.shape == (24, h, w, 3) and traj.frames.dtype == np.uint8
    assert traj.camera_ids == (0, 1, 2, 3, 5, 6) and traj.num_frames == 4 and traj.max_tokens is None
    assert traj.request_id == f"{sc.scene_id}-trajectory" and traj.seed == 0 and traj.temperature == 0.0
    assert np.array_equal(traj.ego_history_xyz, np.asarray(sc.ego_history_xyz, np.float32))
    assert traj.frames[0].tobytes() == np.asarray(Image.open(io.BytesIO(sc.images[0])).convert("RGB")).tobytes()
    vqa = runtime_request(sc, "vqa", num_samples=2, temperature=0.6, seed=3, max_tokens=9)
    assert vqa.camera_ids == (0, 1, 2, 3, 4, 5) and vqa.question == sc.text.vqa_question and vqa.max_tokens == 9
    assert (vqa.num_samples, vqa.temperature, vqa.seed) == (2, 0.6, 3)
    frames = runtime_frames(sc)
    assert runtime_request(sc, "meta_action", frames=frames).frames is frames[0]


# ------------------------------------------------------------------------------------------
# Property test over arbitrary seeds (facts + planner only, no rendering)
# ------------------------------------------------------------------------------------------

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**40))
@example(seed=17_276_153_373)     # a smooth stop whose ramp stepped 0.87 > J dt (found by this test in CI-like runs)
def test_planner_invariants_any_seed(seed):
    f, p = S.sample_facts(np.random.default_rng(seed))
    assert min(p.speed) >= 0.0
    assert ACCEL_MIN - 1e-9 <= min(p.accel) and max(p.accel) <= ACCEL_MAX + 1e-9
    a0 = f.ego_accel if f.ego_speed > 0.5 else 0.0
    assert np.abs(np.diff(np.concatenate([[a0], p.accel]))).max() <= JERK_MAX * DT + 1e-6
    if f.traffic_light == "red":
        assert max(p.s) + EGO_FRONT < f.stop_line_distance and p.longitudinal == "Stop"
    if f.lead_present:
        assert min(np.asarray(p.lead_s) - np.asarray(p.s)) >= MIN_LEAD_CLEARANCE
        box = S.lead_bbox(f)
        assert box is not None and 0 <= box[0] < box[2] <= 1000 and 0 <= box[1] < box[3] <= 1000
    else:
        assert S.lead_bbox(f) is None
    t = S.scene_text(f, p, seed % 4, S.lead_bbox(f))
    assert META_RE.match(t.meta_action)
    json.loads(t.auto_labeling)


def test_every_generated_reasoning_is_wellformed_and_garbled_text_is_not():
    """The grammar check reads the generator's own sentence table: every reasoning it writes
    passes; a repeated clause, a cut sentence, an unknown word or empty text does not."""
    from worker.scenes import generate_scene
    from worker.scenes.text import is_wellformed_reasoning

    texts = [generate_scene(seed).text.reasoning for seed in range(200)]
    assert all(is_wellformed_reasoning(t) for t in texts)
    good = "There is no traffic light ahead. The lead vehicle is 23 meters ahead and slower, so the ego vehicle " \
           "keeps a safe gap. The road ahead curves to the left."
    assert is_wellformed_reasoning(good)
    for bad in ("The road ahead curves to the right, so the right, so the right.",
                good[:-1], good.replace("slower", "slowest"), good.replace("23", "twenty"), "",
                good.replace(" The road", "  The road")):
        assert not is_wellformed_reasoning(bad), bad
