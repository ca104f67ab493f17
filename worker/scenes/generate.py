"""Scene assembly: one scene from one seed (facts, egomotion, text, pictures)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from worker.scenes.facts import sample_facts
from worker.scenes.planner import ego_history, yaw_rot
from worker.scenes.render import lead_bbox, render_images
from worker.scenes.structs import (CAMERA_NAMES, DEFAULT_IMAGE_SIZE, FRAME_OFFSETS_S, TRAJ_CAMERA_IDS, VQA_CAMERA_IDS,
                                   VQA_QUESTIONS, Scene, TaskDefaults)
from worker.scenes.text import scene_text


def scene_id_for(seed: int) -> str:
    return f"synth-{seed:08d}"


def generate_scene(seed: int, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
                   task_defaults: TaskDefaults | None = None, *, image_format: str = "png",
                   noise: int | None = None, jpeg_quality: int = 90,
                   cameras: tuple[int, ...] | None = None) -> Scene:  # fmt: skip
    """One synthetic scene; a pure function of its arguments (same seed -> identical bytes).
    cameras: render only these of the trajectory and VQA cameras (the scene's camera lists hold
    only them).

    image_size is (width, height). noise: per-pixel noise amplitude added to the pictures;
    None = 0 up to 256x256 and 4 above (large images then carry realistic PNG payload sizes)."""
    td = task_defaults or TaskDefaults()
    rng = np.random.default_rng(seed)
    facts, plan = sample_facts(rng)
    q_seeded = int(rng.integers(len(VQA_QUESTIONS)))
    q = q_seeded if td.vqa_question is None else int(td.vqa_question) % len(VQA_QUESTIONS)
    W, H = int(image_size[0]), int(image_size[1])

    hist_xyz, hist_rot = ego_history(facts)
    fut_rot = [yaw_rot(th) for th in plan.yaw]
    text = scene_text(facts, plan, q, lead_bbox(facts, (W, H)), td.grounding_question)

    cam_ids = sorted(set(TRAJ_CAMERA_IDS) | set(VQA_CAMERA_IDS))
    if cameras is not None:
        cam_ids = [c for c in cam_ids if c in cameras]
    traj_ids = [c for c in TRAJ_CAMERA_IDS if c in cam_ids]
    vqa_ids = [c for c in VQA_CAMERA_IDS if c in cam_ids]
    frames = render_images(facts, cam_ids, (W, H), seed=seed, image_format=image_format,
                           noise=noise, jpeg_quality=jpeg_quality)  # fmt: skip
    return Scene(
        scene_id=scene_id_for(seed),
        seed=seed,
        facts=facts,
        image_format=image_format,
        image_size=(W, H),
        frame_offsets_s=list(FRAME_OFFSETS_S),
        camera_ids=traj_ids,
        camera_order=[CAMERA_NAMES[c] for c in traj_ids],
        images=[b for c in traj_ids for b in frames[c]],
        vqa_camera_ids=vqa_ids,
        vqa_camera_order=[CAMERA_NAMES[c] for c in vqa_ids],
        vqa_images=[b for c in vqa_ids for b in frames[c]],
        ego_history_xyz=hist_xyz,
        ego_history_rot=hist_rot,
        ego_future_xyz=[list(p) for p in plan.xyz],
        ego_future_rot=fut_rot,
        text=text,
    )


def iter_scenes(n: int, seed0: int = 0, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
                **kwargs) -> Iterator[Scene]:  # fmt: skip
    """Scenes for seeds seed0 .. seed0+n-1 (kwargs go to generate_scene)."""
    for i in range(n):
        yield generate_scene(seed0 + i, image_size, **kwargs)
