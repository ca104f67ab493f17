"""Scene -> request: the one builder of the request a producer sends for one scene and one task.

``build_request`` turns a synthetic :class:`~worker.scenes.structs.Scene`, or a ``SceneItem`` (a
scene from any source: scene files, manifest rows with image files, synthetic scenes), into a
wire :class:`schemas.InferRequest`. Its callers (``alpamayo-producer publish``, ``alpamayo-worker
run-scene``, ``make demo``, the chaos harness, the tests) differ only in the parameters they pass.

``runtime_request`` is the same request already decoded, the runtime's ``SceneRequest``: what the
worker builds from the published request, for training and evaluation that feed the runtime
directly (demo model training and report, ``alpamayo-producer qualify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import schemas as S
from worker.scenes.structs import Scene

__all__ = ["SceneInputError", "SceneItem", "scene_item", "build_request", "runtime_request"]


class SceneInputError(ValueError):
    """The scene lacks what the task needs (ego history, ego future, a question), or the task is unknown."""


@dataclass
class SceneItem:
    """One scene ready to become requests. Images are loaded lazily (``load_images``)."""

    scene_id: str
    camera_order: list[str] | None
    num_frames: int
    load_images: Callable[[], list[bytes]]
    ego_history_xyz: list | None = None
    ego_history_rot: list | None = None
    ego_history_quat: list | None = None
    ego_future_xyz: list | None = None
    ego_future_rot: list | None = None
    ego_future_quat: list | None = None
    vqa_camera_order: list[str] | None = None
    load_vqa_images: Callable[[], list[bytes]] | None = None
    vqa_question: str | None = None
    grounding_question: str | None = None
    nav_text: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    tasks: list[str] | None = None


def scene_item(scene: Scene, **overrides) -> SceneItem:
    """A synthetic scene as a SceneItem (``overrides`` that are not None replace its fields)."""
    item = SceneItem(
        scene_id=scene.scene_id,
        camera_order=list(scene.camera_order),
        num_frames=len(scene.frame_offsets_s),
        load_images=lambda: list(scene.images),
        ego_history_xyz=scene.ego_history_xyz,
        ego_history_rot=scene.ego_history_rot,
        ego_future_xyz=scene.ego_future_xyz,
        ego_future_rot=scene.ego_future_rot,
        vqa_camera_order=list(scene.vqa_camera_order),
        load_vqa_images=lambda: list(scene.vqa_images),
        vqa_question=scene.text.vqa_question,
        grounding_question=scene.text.grounding_question,
    )
    for k, v in overrides.items():
        if v is not None:
            setattr(item, k, v)
    return item


def build_request(scene: Scene | SceneItem, task: str = "trajectory", k: int = 1, *,
                  request_id: str | None = None, run_id: str | None = None, submitted_at: float | None = None,
                  labels: dict[str, str] | None = None, temperature: float | None = None,
                  top_p: float | None = None, seed: int | None = None, max_tokens: int | None = None,
                  question: str | None = None) -> S.InferRequest:
    """The InferRequest for one scene and task, all images inline (VQA: the VQA camera profile).

    ``request_id`` defaults to ``f"{scene_id}-{task}-k{k}"``; ``labels`` to the item's labels.
    ``temperature`` None: 0.0 for K = 1, the contract's default otherwise. ``question`` None: the
    scene's VQA or grounding question for those tasks. ``max_tokens`` applies to the text tasks.
    Raises SceneInputError when the scene lacks what the task needs."""
    item = scene_item(scene) if isinstance(scene, Scene) else scene
    if task not in S.TASKS:
        raise SceneInputError(f"unknown task {task!r}: use one of {', '.join(S.TASKS)}")
    vqa = task == "vqa"
    if vqa and item.load_vqa_images is not None:
        images, cams = item.load_vqa_images(), item.vqa_camera_order
    else:
        images, cams = item.load_images(), item.camera_order
    ego = fut = None
    if task in S.TASKS_NEEDING_EGOMOTION:
        if item.ego_history_xyz is None:
            raise SceneInputError(f"scene {item.scene_id}: task {task} needs ego history")
        ego = S.Egomotion(ego_history_xyz=item.ego_history_xyz, ego_history_rot=item.ego_history_rot,
                          ego_history_quat=item.ego_history_quat)
    if task == "auto_labeling":
        if item.ego_future_xyz is None:
            raise SceneInputError(f"scene {item.scene_id}: task auto_labeling needs the ego future")
        fut = S.FutureEgomotion(ego_future_xyz=item.ego_future_xyz, ego_future_rot=item.ego_future_rot,
                                ego_future_quat=item.ego_future_quat)
    if question is None:
        question = {"vqa": item.vqa_question, "grounding": item.grounding_question}.get(task)
    if task in S.TASKS_NEEDING_QUESTION and not question:
        raise SceneInputError(f"scene {item.scene_id}: task {task} needs a question (manifest 'question')")
    kw: dict[str, Any] = {}
    if temperature is not None:
        kw["temperature"] = temperature
    elif k == 1:
        kw["temperature"] = 0.0
    if top_p is not None:
        kw["top_p"] = top_p
    return S.InferRequest(
        request_id=request_id or f"{item.scene_id}-{task}-k{k}", run_id=run_id, submitted_at=submitted_at,
        labels=item.labels if labels is None else labels, task=task, images=images, camera_order=cams,
        num_frames_per_camera=item.num_frames, egomotion=ego, future_egomotion=fut, num_traj_samples=k,
        seed=seed, max_tokens=max_tokens if task != "trajectory" else None, nav_text=item.nav_text,
        question=question, **kw)


def runtime_request(scene: Scene, task: str, *, request_id: str | None = None, num_samples: int = 1,
                    temperature: float = 0.0, seed: int = 0, max_tokens: int | None = None,
                    frames: tuple[np.ndarray, tuple[int, ...]] | None = None):
    """The runtime's SceneRequest for `scene` and `task`: the decoded form of ``build_request``'s
    request (frames camera-major, camera ids from the names). ``request_id`` defaults to
    ``f"{scene_id}-{task}"``; ``frames`` reuses already decoded ``runtime_frames``."""
    # torch: the runtime and its image decoder need it; producers build wire requests without it
    from worker.model.runtime import SceneRequest

    arr, cams = runtime_frames(scene, vqa=task == "vqa") if frames is None else frames
    f32 = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    question = {"vqa": scene.text.vqa_question, "grounding": scene.text.grounding_question}.get(task)
    return SceneRequest(
        request_id=request_id or f"{scene.scene_id}-{task}", task=task, frames=arr, camera_ids=cams,
        num_frames=len(scene.frame_offsets_s),
        ego_history_xyz=f32(scene.ego_history_xyz), ego_history_rot=f32(scene.ego_history_rot),
        ego_future_xyz=f32(scene.ego_future_xyz), ego_future_rot=f32(scene.ego_future_rot),
        num_samples=num_samples, temperature=temperature, seed=seed,
        max_tokens=max_tokens if task != "trajectory" else None, question=question)


def runtime_frames(scene: Scene, vqa: bool = False) -> tuple[np.ndarray, tuple[int, ...]]:
    """Decoded frames (N_cam * 4, H, W, 3) uint8, camera-major, and the camera ids from names."""
    from worker.frames import decode_image

    images = scene.vqa_images if vqa else scene.images
    names = scene.vqa_camera_order if vqa else scene.camera_order
    frames = np.stack([decode_image(b) for b in images])
    return frames, tuple(S.CAMERA_IDS_BY_NAME[n] for n in names)
