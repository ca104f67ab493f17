"""Synthetic driving scenes for the Alpamayo 2 Super worker (used by the demo model training, the
DFlash2 head, ``alpamayo-worker run-scene`` and the producer tools).

Every scene is a pure function of one integer seed: sampled facts (road, ego speed, lead vehicle,
traffic light, pedestrian, blocked lane), ego history and a rule-based planner future in the
t0 ego frame, camera images for both task camera profiles, and templated text targets for the
five tasks (trajectory reasoning, meta_action, auto_labeling, vqa, grounding).

Conventions (docs/alpamayo2-model.md section 2):

* 10 Hz. 16 history poses at t0-1.5 .. t0, 64 future poses at t0+0.1 .. t0+6.4.
* Poses are in the t0 ego frame: x forward, y left, z up, metres. The last history pose is the
  origin with the identity rotation. Rotations are yaw-only 3x3 matrices
  ``[[c, -s, 0], [s, c, 0], [0, 0, 1]]`` as nested lists.
* Images: 4 frames per camera at t0-0.3, t0-0.2, t0-0.1, t0, camera-major, oldest frame first.
  Trajectory profile cameras 0,1,2,3,5,6; VQA profile cameras 0..5.
* ``image_size`` is ``(width, height)`` in pixels.

Road model: three 3.5 m lanes on an arc of constant curvature; the ego drives in the middle lane
and at t0 sits on its centre line, aligned with it. "Along-road distance" (``s``) is arc length
along the ego lane centre line from the ego origin at t0. All fact distances (lead gap, stop
line, crosswalk, barrier) are along-road distances from the ego origin (rear-axle reference;
the front bumper is ``EGO_FRONT`` metres ahead of it) to the object's near edge.

The pictures are stylised, not metric: the two front cameras use a virtual chase viewpoint and a
size floor for objects so that a tiny vision model (16 px patches, 32 px token cells) can read the
light state and the lead vehicle's presence and gap from 64x64 images.

Modules: ``structs`` (constants and structs), ``road`` (geometry), ``facts`` (fact sampling),
``planner`` (ego history and planner future), ``text`` (text targets), ``render`` (cameras and
pictures), ``generate`` (one scene from one seed), ``files`` (msgpack scene files), ``plots``
(reports and plots), ``request`` (scene -> request).
"""

from __future__ import annotations

from worker.scenes.facts import sample_facts
from worker.scenes.files import decode_scene, encode_scene, read_scene, write_scene, write_scenes
from worker.scenes.generate import generate_scene, iter_scenes
from worker.scenes.planner import ego_history, plan_future
from worker.scenes.plots import bev_figure, bev_plot, distribution_report
from worker.scenes.render import lead_bbox, render_images
from worker.scenes.structs import (CAMERA_NAMES, DEFAULT_IMAGE_SIZE, FRAME_OFFSETS_S, FUTURE_TIMES_S, GROUNDING_QUESTION,
                                   HISTORY_TIMES_S, LIGHT_STATES, OtherVehicle, Plan, Scene, SceneFacts,
                                   SceneText, TRAJ_CAMERA_IDS, TaskDefaults, VQA_CAMERA_IDS, VQA_QUESTIONS)
from worker.scenes.text import scene_text

__all__ = [
    "CAMERA_NAMES",
    "DEFAULT_IMAGE_SIZE",
    "TRAJ_CAMERA_IDS",
    "VQA_CAMERA_IDS",
    "FRAME_OFFSETS_S",
    "HISTORY_TIMES_S",
    "FUTURE_TIMES_S",
    "GROUNDING_QUESTION",
    "VQA_QUESTIONS",
    "LIGHT_STATES",
    "OtherVehicle",
    "SceneFacts",
    "Plan",
    "SceneText",
    "TaskDefaults",
    "Scene",
    "sample_facts",
    "ego_history",
    "plan_future",
    "scene_text",
    "lead_bbox",
    "render_images",
    "generate_scene",
    "iter_scenes",
    "encode_scene",
    "decode_scene",
    "write_scene",
    "read_scene",
    "write_scenes",
    "distribution_report",
    "bev_figure",
    "bev_plot",
]
