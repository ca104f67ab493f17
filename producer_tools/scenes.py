"""Synthetic driving scenes for the Alpamayo 2 Super worker.

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
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import msgspec
import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "CAMERA_NAMES",
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
    "bev_plot",
]

# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

DT = 0.1
N_HISTORY = 16
N_FUTURE = 64
HISTORY_TIMES_S: tuple[float, ...] = tuple(round(-1.5 + DT * i, 1) for i in range(N_HISTORY))
FUTURE_TIMES_S: tuple[float, ...] = tuple(round(DT * (i + 1), 1) for i in range(N_FUTURE))
FRAME_OFFSETS_S: tuple[float, ...] = (-0.3, -0.2, -0.1, 0.0)

CAMERA_NAMES: dict[int, str] = {
    0: "camera_cross_left_120fov",
    1: "camera_front_wide_120fov",
    2: "camera_cross_right_120fov",
    3: "camera_rear_left_70fov",
    4: "camera_rear_tele_30fov",
    5: "camera_rear_right_70fov",
    6: "camera_front_tele_30fov",
}
TRAJ_CAMERA_IDS: tuple[int, ...] = (0, 1, 2, 3, 5, 6)
VQA_CAMERA_IDS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)

LIGHT_STATES: tuple[str, ...] = ("none", "green", "yellow", "red")
LEAD_RELATIONS: tuple[str, ...] = ("none", "stopped", "slower", "similar", "faster")
VEHICLE_COLORS: tuple[str, ...] = ("white", "red", "blue", "black", "silver")
WEATHERS: tuple[str, ...] = ("clear", "cloudy", "rain")
TIMES_OF_DAY: tuple[str, ...] = ("day", "dusk")

LANE_WIDTH = 3.5
ROAD_HALF_WIDTH = 1.5 * LANE_WIDTH
EGO_FRONT = 2.0  # ego origin (rear axle) -> front bumper, m
LEAD_LENGTH = 4.5
STOP_LINE_MARGIN = 3.0  # ego origin stops this far before a stop line
CROSSWALK_MARGIN = 5.0  # ego origin stops this far before the crosswalk centre
CROSSWALK_AFTER_STOP_LINE = 3.0  # crosswalk centre behind the stop line when both exist
MIN_LEAD_CLEARANCE = 3.0  # lead rear - ego origin must stay above this (>= 1 m bumper gap)

# Longitudinal control (IDM for free road and lead vehicle; kinematic stop targets).
V_MAX = 17.0  # desired speed on a straight road, m/s
LAT_ACCEL_COMFORT = 2.5  # sets the desired speed on curves, m/s^2
IDM_A = 1.5
IDM_B = 2.0
IDM_T = 1.2
IDM_S0 = 5.0  # ego origin -> lead rear at standstill (3 m bumper gap)
ACCEL_MIN = -6.0
ACCEL_MAX = 3.0
JERK_MAX = 8.0  # m/s^3
STOP_ONSET = 0.4  # start braking for a stop target once v^2/(2d) exceeds this, m/s^2
YELLOW_STOP_DECEL = 2.5  # stop at a yellow light when the needed decel is at most this
CURVATURE_MAX = 0.3

GROUNDING_QUESTION = "Find the lead vehicle directly ahead and return its bounding box in JSON."
VQA_QUESTIONS: tuple[str, ...] = (
    "What color is the traffic light ahead?",
    "Is there a vehicle directly ahead of the ego vehicle?",
    "Is a pedestrian crossing the road ahead?",
    "Should the ego vehicle stop?",
)

# --------------------------------------------------------------------------------------------
# Structs
# --------------------------------------------------------------------------------------------


class OtherVehicle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cosmetic traffic (side and rear cameras); does not affect the planner."""

    lane: str  # "left" | "right" | "ego" (ego lane, behind the ego vehicle)
    offset: float  # along-road position of its rear at t0, m (negative: behind the ego origin)
    speed: float  # m/s, constant
    color: str


class SceneFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The sampled ground truth of one scene. Distances are along-road, from the ego origin."""

    road_curvature: float  # 1/m, left positive; 0.0 is a straight road
    ego_speed: float  # m/s at t0
    ego_accel: float  # m/s^2, constant over the history (speed clamped at 0)
    desired_speed: float  # m/s, the planner's cruise speed (a function of the curvature)
    lead_present: bool
    lead_gap: float  # ego origin -> lead rear bumper, m (0 when absent)
    lead_speed: float  # m/s (0 when absent)
    lead_color: str  # one of VEHICLE_COLORS, "" when absent
    traffic_light: str  # "none" | "green" | "yellow" | "red"
    stop_line_distance: float  # m (0 when no light)
    pedestrian_crossing: bool
    pedestrian_side: str  # "left" | "right" (side the pedestrian comes from) | "none"
    pedestrian_distance: float  # crosswalk centre, m (0 when none)
    blocked_lane: bool
    blocked_lane_kind: str  # "none" | "adjacent" | "ego"
    # adjacent: side of the blocked adjacent lane; ego: side the ego changes to; else "none"
    blocked_lane_side: str
    blocked_distance: float  # barrier, m (0 when none)
    weather: str  # cosmetic
    time_of_day: str  # cosmetic
    other_vehicles: list[OtherVehicle] = []

    @property
    def lead_relation(self) -> str:
        """none | stopped | slower | similar | faster (lead speed versus ego speed)."""
        if not self.lead_present:
            return "none"
        if self.lead_speed < 0.5:
            return "stopped"
        dv = self.lead_speed - self.ego_speed
        if dv < -1.0:
            return "slower"
        if dv > 1.0:
            return "faster"
        return "similar"


class Plan(msgspec.Struct, frozen=True):
    """Planner output. Index 0 of the 65-long lists is t0; index i is t0 + 0.1 i."""

    speed: list[float]  # 65
    s: list[float]  # 65, along-road progress of the ego origin
    d: list[float]  # 65, lateral offset from the ego lane centre (left +)
    accel: list[float]  # 64, per step
    curvature: list[float]  # 64, per step
    xyz: list[list[float]]  # 64 x 3 future positions
    yaw: list[float]  # 64 future headings
    lead_s: list[float]  # 65, lead rear along-road (empty when no lead)
    stop_target: float  # along-road position the ego must not pass (inf when none)
    yellow_stop: bool  # the ego decided to stop at a yellow light
    lane_change: str  # "none" | "left" | "right"
    longitudinal: str
    lateral: str
    lane: str


class SceneText(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reasoning: str
    meta_action: str
    auto_labeling: str
    vqa_question: str
    vqa_answer: str
    grounding_question: str
    grounding_answer: str


class TaskDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-run choices for the text tasks.

    ``vqa_question``: index into VQA_QUESTIONS; None lets the seed pick one.
    ``grounding_question``: the grounding prompt (the answer format does not change).
    """

    vqa_question: int | None = None
    grounding_question: str = GROUNDING_QUESTION


class Scene(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    scene_id: str
    seed: int
    facts: SceneFacts
    image_format: str  # "png" | "jpeg"
    image_size: tuple[int, int]  # (width, height)
    frame_offsets_s: list[float]
    camera_ids: list[int]
    camera_order: list[str]
    images: list[bytes]  # len(camera_ids) * 4, camera-major, oldest frame first
    vqa_camera_ids: list[int]
    vqa_camera_order: list[str]
    vqa_images: list[bytes]
    ego_history_xyz: list[list[float]]  # 16 x 3
    ego_history_rot: list[list[list[float]]]  # 16 x 3 x 3
    ego_future_xyz: list[list[float]]  # 64 x 3
    ego_future_rot: list[list[list[float]]]  # 64 x 3 x 3
    text: SceneText


# --------------------------------------------------------------------------------------------
# Road geometry
# --------------------------------------------------------------------------------------------


def _arc_point(k: float, s: float, d: float) -> tuple[float, float]:
    """Point at arc length s along the ego lane centre line (t0 frame), offset d to the left."""
    if abs(k) < 1e-9:
        return s, d
    th = k * s
    sn, cs = math.sin(th), math.cos(th)
    return sn / k - d * sn, (1.0 - cs) / k + d * cs


def _arc_points(k: float, s: np.ndarray, d: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    if abs(k) < 1e-9:
        return s.astype(np.float64), np.broadcast_to(np.asarray(d, np.float64), s.shape)
    th = k * s
    sn, cs = np.sin(th), np.cos(th)
    return sn / k - d * sn, (1.0 - cs) / k + d * cs


def _frenet(k: float, x: float, y: float) -> tuple[float, float]:
    """Inverse of _arc_point: (s, d) of a t0-frame point (valid for |k s| < pi)."""
    if abs(k) < 1e-9:
        return x, y
    dx, dy = x, y - 1.0 / k
    phi = math.atan2(k * dx, -k * dy)
    r = math.hypot(dx, dy)
    return phi / k, 1.0 / k - math.copysign(r, k)


def desired_speed(curvature: float) -> float:
    """Planner cruise speed: V_MAX on straights, lower on curves (lateral accel 2.5 m/s^2)."""
    if abs(curvature) < 1e-9:
        return V_MAX
    return min(V_MAX, math.sqrt(LAT_ACCEL_COMFORT / abs(curvature)))


def _smootherstep(u: float) -> float:
    if u <= 0.0:
        return 0.0
    if u >= 1.0:
        return 1.0
    return u * u * u * (u * (6.0 * u - 15.0) + 10.0)


def _lane_change_geometry(f: SceneFacts) -> tuple[float, float, float]:
    """(start s, length, signed final offset) of the evasive lane change; zeros when none."""
    if f.blocked_lane_kind != "ego":
        return 0.0, 0.0, 0.0
    side = 1.0 if f.blocked_lane_side == "left" else -1.0
    start = 2.0
    length = min(max(2.5 * f.ego_speed + 8.0, 20.0), f.blocked_distance - 12.0)
    return start, max(length, 8.0), side * LANE_WIDTH


# --------------------------------------------------------------------------------------------
# Fact sampling
# --------------------------------------------------------------------------------------------


def _r2(x: float) -> float:
    return round(float(x), 2)


def _stop_distance(rng: np.random.Generator, v0: float) -> float:
    """A distance to a stop target at which the ego, at v0, comes to rest within the horizon."""
    if v0 < 2.0:
        return float(rng.uniform(0.5, 6.0))
    t_stop = rng.uniform(min(max(2.5, v0 / 3.2), 5.9), 6.0)
    return float(v0 * t_stop / 2.0)


def _sample_facts_once(rng: np.random.Generator) -> SceneFacts:
    weather = WEATHERS[int(rng.integers(len(WEATHERS)))]
    time_of_day = TIMES_OF_DAY[int(rng.random() < 0.25)]

    # Road.
    if rng.random() < 0.35:
        kappa = 0.0
    else:
        kappa = round(float(rng.choice((-1.0, 1.0)) * rng.uniform(0.003, 0.02)), 4)
    v_des = desired_speed(kappa)

    # Ego speed and history acceleration.
    if rng.random() < 0.12:
        v0 = 0.0 if rng.random() < 0.5 else float(rng.uniform(0.2, 2.0))
    else:
        v0 = float(rng.uniform(3.0, 20.0))
    v0 = min(v0, v_des + 3.0)
    a_hist = float(rng.uniform(-0.8, 0.8))

    # Blocked lane.
    blocked_kind, blocked_side, blocked_dist = "none", "none", 0.0
    if rng.random() < 0.12:
        blocked_kind = "ego" if rng.random() < 0.5 else "adjacent"
        blocked_side = "left" if rng.random() < 0.5 else "right"
        if blocked_kind == "ego":
            v0 = max(v0, float(rng.uniform(5.0, 10.0)))
            lo = max(30.0, 3.0 * v0 + 20.0)
            blocked_dist = float(rng.uniform(lo, lo + 25.0))
        else:
            blocked_dist = float(rng.uniform(10.0, 50.0))

    # Lead vehicle (never in a blocked ego lane). May lower the ego speed so that it can follow.
    lead_present = blocked_kind != "ego" and rng.random() < 0.5
    lead_gap = lead_speed = 0.0
    lead_color = ""
    if lead_present:
        r = rng.random()
        lead_color = VEHICLE_COLORS[int(rng.integers(len(VEHICLE_COLORS)))]
        if r < 0.55:  # stopped (0.2) or slower (0.35)
            ratio = 0.0 if r < 0.2 else float(rng.uniform(0.3, 0.8))
            lead_gap = float(rng.uniform(8.0, 50.0))
            # largest v0 with ((1-ratio) v0)^2 / 5 + 0.5 v0 + 6 <= gap
            qa, qb, qc = (1.0 - ratio) ** 2 / 5.0, 0.5, 6.0 - lead_gap
            v_cap = (-qb + math.sqrt(qb * qb - 4.0 * qa * qc)) / (2.0 * qa)
            v0 = min(v0, v_cap)
            lead_speed = ratio * v0
        elif r < 0.8:  # similar
            lead_speed = max(0.0, v0 + float(rng.uniform(-0.9, 0.9)))
            lead_gap = float(rng.uniform(max(8.0, 0.6 * v0 + 6.0), 50.0))
        else:  # faster
            lead_speed = v0 + float(rng.uniform(2.0, 5.0))
            lead_gap = float(rng.uniform(max(8.0, 0.5 * v0 + 6.0), 50.0))
        if abs(kappa) > 0.01:
            lead_gap = min(lead_gap, 40.0)

    v0 = _r2(v0)

    # Traffic light.
    r = rng.random()
    light = "none" if r < 0.35 else "green" if r < 0.6 else "yellow" if r < 0.75 else "red"
    if blocked_kind == "ego" and light in ("yellow", "red"):
        light = "green"
    stop_d = 0.0
    if light == "red":
        stop_d = STOP_LINE_MARGIN + _stop_distance(rng, v0)
    elif light == "yellow":
        stop_d = STOP_LINE_MARGIN + max(v0 * float(rng.uniform(0.6, 3.0)), float(rng.uniform(0.5, 6.0)))
    elif light == "green":
        stop_d = float(rng.uniform(10.0, 70.0))

    # Pedestrian on a crosswalk (just behind the stop line when there is a light).
    ped = rng.random() < 0.15 and light != "yellow" and blocked_kind != "ego"
    ped_side, ped_d = "none", 0.0
    if ped:
        ped_side = "left" if rng.random() < 0.5 else "right"
        if light == "red":
            ped_d = stop_d + CROSSWALK_AFTER_STOP_LINE
        else:
            ped_d = CROSSWALK_MARGIN + _stop_distance(rng, v0)
            if light == "green":
                stop_d = ped_d - CROSSWALK_AFTER_STOP_LINE

    # Cosmetic traffic for the side and rear cameras.
    others: list[OtherVehicle] = []
    for _ in range(int(rng.integers(0, 3))):
        lane = ("left", "right", "ego")[int(rng.integers(3))]
        color = VEHICLE_COLORS[int(rng.integers(len(VEHICLE_COLORS)))]
        if lane == "ego":
            offset = float(rng.uniform(-30.0, -10.0))
        else:
            offset = float(rng.uniform(-30.0, 0.0))
        speed = max(0.0, v0 + float(rng.uniform(-1.5, 1.5)))
        if blocked_kind == "ego" and lane == blocked_side:
            continue  # keep the ego's target lane free
        if blocked_kind == "adjacent" and lane == blocked_side and offset > blocked_dist - 15.0:
            continue
        others.append(OtherVehicle(lane=lane, offset=_r2(offset), speed=_r2(speed), color=color))

    return SceneFacts(
        road_curvature=kappa,
        ego_speed=v0,
        ego_accel=_r2(a_hist) if v0 > 0.0 or a_hist < 0.0 else 0.0,
        desired_speed=_r2(v_des),
        lead_present=lead_present,
        lead_gap=_r2(lead_gap),
        lead_speed=_r2(lead_speed),
        lead_color=lead_color,
        traffic_light=light,
        stop_line_distance=_r2(stop_d),
        pedestrian_crossing=ped,
        pedestrian_side=ped_side,
        pedestrian_distance=_r2(ped_d),
        blocked_lane=blocked_kind != "none",
        blocked_lane_kind=blocked_kind,
        blocked_lane_side=blocked_side,
        blocked_distance=_r2(blocked_dist),
        weather=weather,
        time_of_day=time_of_day,
        other_vehicles=others,
    )


def _fallback_facts() -> SceneFacts:
    return SceneFacts(
        road_curvature=0.0, ego_speed=10.0, ego_accel=0.0, desired_speed=V_MAX,
        lead_present=False, lead_gap=0.0, lead_speed=0.0, lead_color="",
        traffic_light="none", stop_line_distance=0.0, pedestrian_crossing=False,
        pedestrian_side="none", pedestrian_distance=0.0, blocked_lane=False,
        blocked_lane_kind="none", blocked_lane_side="none", blocked_distance=0.0,
        weather="clear", time_of_day="day", other_vehicles=[],
    )  # fmt: skip


def _plan_ok(f: SceneFacts, p: Plan) -> bool:
    if min(p.accel) < ACCEL_MIN - 1e-9 or max(p.accel) > ACCEL_MAX + 1e-9:
        return False
    if math.isfinite(p.stop_target):
        if p.speed[-1] >= 0.5 or max(p.s) > p.stop_target + 0.3:
            return False
    if p.lead_s:
        if min(ls - es for ls, es in zip(p.lead_s, p.s)) < MIN_LEAD_CLEARANCE:
            return False
        box = _front_box_norm(f.road_curvature, f.lead_gap, 0.0, "vehicle")
        if box is None or box[0] < 0.02 or box[2] > 0.98:
            return False
    if f.blocked_lane_kind == "ego":
        for s, d in zip(p.s, p.d):
            if s >= f.blocked_distance - EGO_FRONT - 1.0 and abs(d) < 3.0:
                return False
    return True


def sample_facts(rng: np.random.Generator, max_tries: int = 64) -> tuple[SceneFacts, Plan]:
    """Sample facts until the planner's future passes the sanity checks (rejection sampling)."""
    for _ in range(max_tries):
        f = _sample_facts_once(rng)
        p = plan_future(f)
        if _plan_ok(f, p):
            return f, p
    f = _fallback_facts()
    return f, plan_future(f)


# --------------------------------------------------------------------------------------------
# Egomotion: history and planner
# --------------------------------------------------------------------------------------------


def _yaw_rot(th: float) -> list[list[float]]:
    c, s = math.cos(th), math.sin(th)
    return [[c, 0.0 - s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]


def _hist_s(v0: float, a: float, t: float) -> float:
    """Along-road position at time t <= 0 for speed max(0, v0 + a t), position 0 at t = 0."""
    if a > 0.0 and v0 + a * t < 0.0:
        return -(v0 * v0) / (2.0 * a)
    return v0 * t + 0.5 * a * t * t


def ego_history(f: SceneFacts) -> tuple[list[list[float]], list[list[list[float]]]]:
    """16 history poses (t0-1.5 .. t0) on the ego lane centre line, in the t0 ego frame."""
    k = f.road_curvature
    xyz, rot = [], []
    for t in HISTORY_TIMES_S:
        s = _hist_s(f.ego_speed, f.ego_accel, t) if t < 0.0 else 0.0
        x, y = _arc_point(k, s, 0.0)
        xyz.append([x + 0.0, y + 0.0, 0.0])
        rot.append(_yaw_rot(k * s))
    return xyz, rot


def _stop_accel(v: float, dist: float) -> float:
    """Acceleration demand for a stop target `dist` metres ahead of the ego origin."""
    if dist <= 1e-3:
        return -v / DT
    b = v * v / (2.0 * dist)
    if b < STOP_ONSET and dist > 5.0:
        return math.inf
    return -b


def _jerk_limited(a_cmd: float, a_prev: float, v: float) -> float:
    """Apply the accel bounds, the jerk limit, a smooth stop and speed >= 0."""
    step = JERK_MAX * DT
    if a_prev < -1e-9 and v > 0.0 and a_cmd < 0.0:
        # Smooth stop. With n = 1 + 2v/(|a| dt), a ramp of the deceleration from a to 0 over
        # n-1 equal steps removes exactly v. Once n is small enough (n <= |a|/(J dt) + 4) we
        # take the ramp whose length N = floor(n) - 1 is whole; the first step changes a by at
        # most J dt, each later step keeps n whole, and the stop ends at v = 0 with jerk <= J.
        n = 1.0 + 2.0 * v / (-a_prev * DT)
        if n <= -a_prev / step + 4.0:
            if n < 2.0:
                return -v / DT
            return -2.0 * v / (DT * math.floor(n + 1e-6))
    a_cmd = min(max(a_cmd, ACCEL_MIN), ACCEL_MAX)
    a = min(max(a_cmd, a_prev - step), a_prev + step)
    if v <= 1e-9 and a_cmd <= 0.0:
        a = 0.0
    if v + a * DT < 0.0:
        a = -v / DT
    return a


def _simulate_lead(f: SceneFacts) -> list[float]:
    """Lead rear along-road positions for t0 .. t0+6.4 (65). Cruises at its speed, stops for a
    red light (or a yellow it can stop for) and yields to the pedestrian, like the ego."""
    s, v, a_prev = f.lead_gap, f.lead_speed, 0.0
    targets = []
    if f.traffic_light in ("red", "yellow") and s + LEAD_LENGTH < f.stop_line_distance - 0.5:
        room = f.stop_line_distance - 1.0 - LEAD_LENGTH - s
        if room > 0.5 and (f.traffic_light == "red" or v * v / (2.0 * room) <= YELLOW_STOP_DECEL):
            targets.append(f.stop_line_distance - 1.0 - LEAD_LENGTH)
    if f.pedestrian_crossing and s + LEAD_LENGTH < f.pedestrian_distance - 2.5:
        targets.append(f.pedestrian_distance - 2.5 - LEAD_LENGTH)
    out = [s]
    for _ in range(N_FUTURE):
        a_cmd = 0.8 * (f.lead_speed - v)
        for tgt in targets:
            a_cmd = min(a_cmd, _stop_accel(v, tgt - s))
        a = _jerk_limited(a_cmd, a_prev, v)
        v_next = max(0.0, v + a * DT)
        s += DT * 0.5 * (v + v_next)
        v, a_prev = v_next, a
        out.append(s)
    return out


def _meta_from_plan(speed: Sequence[float], accel: Sequence[float], yaw_end: float,
                    lane_change: str) -> tuple[str, str, str]:  # fmt: skip
    v0, v3, v_end = speed[0], speed[30], speed[-1]
    if v_end < 0.5:
        lon = "Stop"
    elif min(accel) <= -3.0:
        lon = "Strong Deceleration"
    elif v3 - v0 <= -1.0 or v_end - v0 <= -2.0:
        lon = "Decelerate"
    elif v3 - v0 >= 1.0:
        lon = "Accelerate"
    else:
        lon = "Keep Speed"
    lat = "Turn Left" if yaw_end > 0.3 else "Turn Right" if yaw_end < -0.3 else "Go Straight"
    lane = {"none": "Lane Keep", "left": "Change Left", "right": "Change Right"}[lane_change]
    return lon, lat, lane


def plan_future(f: SceneFacts) -> Plan:
    """Rule-based planner: IDM longitudinal control (desired speed, lead vehicle), kinematic stops
    for red / yellow-when-able lights and crossing pedestrians, pure-pursuit lane following (or an
    evasive lane change), integrated at 0.1 s with the unicycle (accel, curvature) model of the
    action space (docs 4.4). Speed >= 0, accel in [-6, 3] m/s^2, jerk <= 8 m/s^3."""
    k_road = f.road_curvature
    v = f.ego_speed
    a_prev = f.ego_accel if v > 0.5 else 0.0
    v_des = f.desired_speed

    stop_target = math.inf
    yellow_stop = False
    if f.traffic_light == "red":
        stop_target = f.stop_line_distance - STOP_LINE_MARGIN
    elif f.traffic_light == "yellow":
        room = f.stop_line_distance - STOP_LINE_MARGIN
        if room > 0.5 and (v < 1.0 or v * v / (2.0 * room) <= YELLOW_STOP_DECEL):
            yellow_stop = True
            stop_target = room
    if f.pedestrian_crossing:
        stop_target = min(stop_target, f.pedestrian_distance - CROSSWALK_MARGIN)

    lead_s = _simulate_lead(f) if f.lead_present else []
    lc_start, lc_len, lc_off = _lane_change_geometry(f)
    lane_change = "none" if lc_off == 0.0 else ("left" if lc_off > 0.0 else "right")

    x = y = th = 0.0
    s_e, d_e = 0.0, 0.0
    speeds, ss, ds = [v], [0.0], [0.0]
    accels, curvs, xyz, yaws = [], [], [], []
    sqrt_ab = 2.0 * math.sqrt(IDM_A * IDM_B)
    for i in range(N_FUTURE):
        # Longitudinal.
        a_cmd = IDM_A * (1.0 - (v / v_des) ** 4)
        if lead_s:
            gap = lead_s[i] - s_e
            v_lead = (lead_s[i + 1] - lead_s[i]) / DT
            s_star = IDM_S0 + max(0.0, v * IDM_T + v * (v - v_lead) / sqrt_ab)
            a_cmd -= IDM_A * (s_star / max(gap, 0.1)) ** 2
        if stop_target < math.inf:
            a_cmd = min(a_cmd, _stop_accel(v, stop_target - s_e))
        a = _jerk_limited(a_cmd, a_prev, v)
        v_next = max(0.0, v + a * DT)

        # Lateral: pure pursuit towards a point on the (possibly offset) lane centre line.
        look = max(6.0, 0.8 * v + 4.0)
        s_t = s_e + look
        d_t = lc_off * _smootherstep((s_t - lc_start) / lc_len) if lc_off else 0.0
        px, py = _arc_point(k_road, s_t, d_t)
        dx, dy = px - x, py - y
        c, sn = math.cos(th), math.sin(th)
        lx, ly = c * dx + sn * dy, -sn * dx + c * dy
        kappa = 2.0 * ly / (lx * lx + ly * ly)
        kappa = min(max(kappa, -CURVATURE_MAX), CURVATURE_MAX)

        # Unicycle integration (trapezoidal, as in action_to_traj).
        th_next = th + kappa * v * DT + kappa * a * DT * DT / 2.0
        x += DT / 2.0 * (v * c + v_next * math.cos(th_next))
        y += DT / 2.0 * (v * sn + v_next * math.sin(th_next))
        th = th_next
        v, a_prev = v_next, a
        s_e, d_e = _frenet(k_road, x, y)

        accels.append(a)
        curvs.append(kappa)
        speeds.append(v)
        ss.append(s_e)
        ds.append(d_e)
        xyz.append([x, y, 0.0])
        yaws.append(th)

    lon, lat, lane = _meta_from_plan(speeds, accels, yaws[-1], lane_change)
    return Plan(
        speed=speeds, s=ss, d=ds, accel=accels, curvature=curvs, xyz=xyz, yaw=yaws,
        lead_s=lead_s, stop_target=stop_target, yellow_stop=yellow_stop,
        lane_change=lane_change, longitudinal=lon, lateral=lat, lane=lane,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Text targets
# --------------------------------------------------------------------------------------------


def _light_sentence(f: SceneFacts, p: Plan) -> str:
    light = f.traffic_light
    if light == "none":
        return "There is no traffic light ahead."
    if light == "green":
        return "The traffic light ahead is green, so the ego vehicle may proceed."
    if light == "red":
        return "The traffic light ahead is red, so the ego vehicle must stop before the stop line."
    if p.yellow_stop:
        return (
            "The traffic light ahead is yellow and there is room to stop, "
            "so the ego vehicle must stop before the stop line."
        )
    return "The traffic light ahead is yellow but the ego vehicle is too close to stop, so it proceeds."


def _lead_sentence(f: SceneFacts, p: Plan) -> str:
    rel = f.lead_relation
    if rel == "none":
        return "There is no lead vehicle ahead."
    gap = int(round(f.lead_gap))
    if rel == "stopped":
        if p.longitudinal == "Stop":
            return f"The lead vehicle is stopped {gap} meters ahead, so the ego vehicle must stop behind it."
        return f"The lead vehicle is stopped {gap} meters ahead, so the ego vehicle slows down behind it."
    if rel == "slower":
        return f"The lead vehicle is {gap} meters ahead and slower, so the ego vehicle keeps a safe gap."
    if rel == "similar":
        return f"The lead vehicle is {gap} meters ahead at a similar speed, so the ego vehicle follows it."
    return f"The lead vehicle is {gap} meters ahead and faster, so it does not limit the ego vehicle."


def _reasoning(f: SceneFacts, p: Plan) -> str:
    parts = [_light_sentence(f, p), _lead_sentence(f, p)]
    if f.pedestrian_crossing:
        parts.append(
            f"A pedestrian is crossing from the {f.pedestrian_side}, "
            "so the ego vehicle yields and stops before the crosswalk."
        )
    if f.blocked_lane_kind == "adjacent":
        parts.append(f"The {f.blocked_lane_side} lane is blocked by a barrier, so the ego vehicle keeps its lane.")
    elif f.blocked_lane_kind == "ego":
        parts.append(
            "The ego lane is blocked by a barrier ahead, "
            f"so the ego vehicle changes to the {f.blocked_lane_side} lane."
        )
    k = f.road_curvature
    if k == 0.0:
        parts.append("The road ahead is straight.")
    else:
        parts.append(f"The road ahead curves to the {'left' if k > 0 else 'right'}.")
    return " ".join(parts)


def _stop_reason(f: SceneFacts, p: Plan) -> str:
    if f.traffic_light == "red":
        return "it must stop for the red light"
    if f.traffic_light == "yellow" and p.yellow_stop:
        return "it must stop for the yellow light"
    if f.pedestrian_crossing:
        return "it must yield to the crossing pedestrian"
    if f.lead_present:
        return "it must stop behind the lead vehicle"
    return "it stays stopped"


def _vqa(f: SceneFacts, p: Plan, q: int) -> tuple[str, str]:
    question = VQA_QUESTIONS[q]
    if q == 0:
        if f.traffic_light == "none":
            answer = "There is no traffic light ahead."
        else:
            answer = f"The traffic light is {f.traffic_light}."
    elif q == 1:
        if f.lead_present:
            answer = f"Yes, a {f.lead_color} vehicle about {int(round(f.lead_gap))} meters ahead."
        else:
            answer = "No, the lane ahead is clear."
    elif q == 2:
        if f.pedestrian_crossing:
            answer = f"Yes, a pedestrian is crossing from the {f.pedestrian_side}."
        else:
            answer = "No, there is no pedestrian crossing."
    else:
        if p.longitudinal == "Stop":
            answer = f"Yes, {_stop_reason(f, p)}."
        else:
            answer = "No, it can keep driving."
    return question, answer


def _components(f: SceneFacts) -> str:
    if f.traffic_light == "none":
        light = "traffic light: none"
    else:
        light = f"traffic light: {f.traffic_light}, {int(round(f.stop_line_distance))} m ahead"
    if f.lead_present:
        lead = f"lead vehicle: {f.lead_color}, {int(round(f.lead_gap))} m ahead, {f.lead_relation}"
    else:
        lead = "lead vehicle: none"
    ped = f"pedestrian: crossing from the {f.pedestrian_side}" if f.pedestrian_crossing else "pedestrian: none"
    if f.blocked_lane_kind == "ego":
        blocked = "blocked lane: ego lane"
    elif f.blocked_lane_kind == "adjacent":
        blocked = f"blocked lane: {f.blocked_lane_side} lane"
    else:
        blocked = "blocked lane: none"
    return "; ".join((light, lead, ped, blocked))


def scene_text(f: SceneFacts, p: Plan, vqa_question: int,
               grounding_box: tuple[int, int, int, int] | None,
               grounding_question: str = GROUNDING_QUESTION) -> SceneText:  # fmt: skip
    """Templated targets for all text tasks (deterministic in the facts and the plan)."""
    reasoning = _reasoning(f, p)
    meta = f"Longitudinal: {p.longitudinal}.\nLateral: {p.lateral}.\nLane: {p.lane}."
    v0, v_end = int(round(p.speed[0])), int(round(p.speed[-1]))
    fx, fy = p.xyz[-1][0], p.xyz[-1][1]
    side = "left" if fy >= 0 else "right"
    motion = (
        f"{p.longitudinal.lower()}, {p.lateral.lower()}, {p.lane.lower()}; "
        f"speed from {v0} m/s to {v_end} m/s"
    )
    traj = f"moves {int(round(fx))} m forward and {int(round(abs(fy)))} m to the {side} in 6.4 seconds"
    auto = json.dumps(
        {
            "critical_components_analysis": _components(f),
            "ego_vehicle_motion_analysis": motion,
            "trajectory_analysis": traj,
            "chain_of_causation": reasoning,
        }
    )
    q, a = _vqa(f, p, vqa_question)
    if grounding_box is None:
        grounding = "[]"
    else:
        x1, y1, x2, y2 = grounding_box
        grounding = f'[{{"bbox_2d": [{x1}, {y1}, {x2}, {y2}], "label": "lead vehicle"}}]'
    return SceneText(
        reasoning=reasoning, meta_action=meta, auto_labeling=auto, vqa_question=q, vqa_answer=a,
        grounding_question=grounding_question, grounding_answer=grounding,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Cameras and rendering
# --------------------------------------------------------------------------------------------


class _Cam:
    __slots__ = ("cid", "front", "cos", "sin", "px", "py", "f", "cx", "yh", "h", "z0", "a", "b",
                 "light_a", "light_b", "base", "W", "H")  # fmt: skip

    def __init__(self, cid: int, W: int, H: int, *, yaw_deg: float = 0.0, hfov_deg: float = 90.0,
                 px: float = 0.0, py: float = 0.0, h: float = 1.6, yh: float = 0.5,
                 front: bool = False, f_rel: float = 0.0, z0: float = 0.0, a: float = 0.0,
                 b: float = 0.0, light_a: float = 0.0, light_b: float = 0.0) -> None:  # fmt: skip
        self.cid, self.W, self.H, self.front = cid, W, H, front
        yaw = math.radians(yaw_deg)
        self.cos, self.sin = math.cos(yaw), math.sin(yaw)
        self.cx = W / 2.0
        self.yh = yh * H
        self.base = float(min(W, H))
        if front:
            # Virtual chase viewpoint z0 metres behind the ego origin; ground at x=0 maps to the
            # bottom row. Object sizes follow base * (a + b * z0 / depth).
            self.f = f_rel * W
            self.px, self.py = -z0, 0.0
            self.h = (H - self.yh) * z0 / self.f
        else:
            self.f = (W / 2.0) / math.tan(math.radians(hfov_deg) / 2.0)
            self.px, self.py, self.h = px, py, h
        self.z0, self.a, self.b, self.light_a, self.light_b = z0, a, b, light_a, light_b

    def to_cam(self, X, Y):
        dx, dy = X - self.px, Y - self.py
        return dx * self.cos + dy * self.sin, dx * self.sin - dy * self.cos


@functools.lru_cache(maxsize=16)
def _cameras(W: int, H: int) -> dict[int, _Cam]:
    return {
        0: _Cam(0, W, H, yaw_deg=60.0, hfov_deg=120.0, px=1.5, py=0.9, h=1.6, yh=0.45),
        1: _Cam(1, W, H, front=True, yh=0.42, f_rel=1.08, z0=12.0, a=0.09, b=0.30,
                light_a=0.26, light_b=0.25),
        2: _Cam(2, W, H, yaw_deg=-60.0, hfov_deg=120.0, px=1.5, py=-0.9, h=1.6, yh=0.45),
        3: _Cam(3, W, H, yaw_deg=150.0, hfov_deg=70.0, px=0.8, py=1.0, h=1.2, yh=0.45),
        4: _Cam(4, W, H, yaw_deg=180.0, hfov_deg=30.0, px=-1.0, py=0.0, h=1.5, yh=0.45),
        5: _Cam(5, W, H, yaw_deg=-150.0, hfov_deg=70.0, px=0.8, py=-1.0, h=1.2, yh=0.45),
        6: _Cam(6, W, H, front=True, yh=0.42, f_rel=3.24, z0=30.0, a=0.12, b=0.45,
                light_a=0.30, light_b=0.20),
    }  # fmt: skip


_COLORS: dict[str, tuple[int, int, int]] = {
    "white": (240, 240, 240),
    "red": (200, 25, 30),
    "blue": (30, 70, 210),
    "black": (20, 20, 24),
    "silver": (165, 170, 178),
}
_LIGHT_RGB = {"red": (255, 20, 20), "yellow": (255, 215, 0), "green": (0, 235, 80)}
_LIGHT_SLOT = {"red": 0.04, "yellow": 0.25, "green": 0.46}
_SKY = {
    ("clear", "day"): (120, 175, 235),
    ("cloudy", "day"): (170, 176, 188),
    ("rain", "day"): (125, 130, 142),
    ("clear", "dusk"): (150, 120, 170),
    ("cloudy", "dusk"): (135, 120, 145),
    ("rain", "dusk"): (100, 98, 115),
}
_GROUND = {"clear": (104, 128, 76), "cloudy": (96, 116, 74), "rain": (82, 98, 66)}
_ROAD = {"clear": (88, 88, 94), "cloudy": (84, 84, 90), "rain": (66, 66, 72)}
_LINE = (236, 236, 236)
_WINDOW = (42, 46, 58)
_BUMPER = (28, 28, 30)
_PED_SHIRT = (235, 30, 205)
_PED_LEGS = (40, 40, 70)
_PED_HEAD = (240, 200, 160)
_BARRIER = (255, 120, 0)
_HOUSING = (24, 24, 24)
_BUILDINGS = ((150, 140, 130), (120, 112, 124), (172, 160, 140), (132, 140, 150))

_NEAR = 0.5  # near clipping distance in camera depth, m


def _clip_segments(c1, r1, c2, r2):
    """Clip ground segments (camera coords) to depth >= _NEAR. Returns clipped arrays and mask."""
    ok = (c1 >= _NEAR) | (c2 >= _NEAR)
    t1 = np.where(c1 < _NEAR, (_NEAR - c1) / np.where(c2 - c1 == 0, 1e-9, c2 - c1), 0.0)
    t2 = np.where(c2 < _NEAR, (_NEAR - c2) / np.where(c1 - c2 == 0, 1e-9, c1 - c2), 0.0)
    nc1, nr1 = c1 + (c2 - c1) * t1, r1 + (r2 - r1) * t1
    nc2, nr2 = c2 + (c1 - c2) * t2, r2 + (r1 - r2) * t2
    return nc1, nr1, nc2, nr2, ok


def _clip_polygon(cs: list[float], rs: list[float]) -> list[tuple[float, float]]:
    """Sutherland-Hodgman clip of a ground polygon (camera coords) against depth >= _NEAR."""
    out: list[tuple[float, float]] = []
    n = len(cs)
    for i in range(n):
        c1, r1, c2, r2 = cs[i - 1], rs[i - 1], cs[i], rs[i]
        in1, in2 = c1 >= _NEAR, c2 >= _NEAR
        if in2:
            if not in1:
                t = (_NEAR - c1) / (c2 - c1)
                out.append((_NEAR, r1 + (r2 - r1) * t))
            out.append((c2, r2))
        elif in1:
            t = (_NEAR - c1) / (c2 - c1)
            out.append((_NEAR, r1 + (r2 - r1) * t))
    return out


def _ground_px(cam: _Cam, c: float, r: float) -> tuple[float, float]:
    return cam.cx + cam.f * r / c, cam.yh + cam.f * cam.h / c


class _World:
    """Scene geometry shared by all cameras and frames (t0 road frame)."""

    def __init__(self, f: SceneFacts, ego_s_frames: Sequence[float], rng: np.random.Generator):
        self.f = f
        self.k = f.road_curvature
        self.ego_s = list(ego_s_frames)
        k = abs(self.k)
        self.s_hi = min(150.0, 1.4 / k) if k > 1e-9 else 150.0
        s_pos = np.geomspace(1.0, self.s_hi, 22)
        self.s_line = np.concatenate((-np.geomspace(1.0, 80.0, 12)[::-1], [0.0], s_pos))
        # Roadside buildings and poles (cosmetic, static).
        self.scenery: list[tuple[float, float, float, float, tuple[int, int, int]]] = []
        for _ in range(6):
            s = float(rng.uniform(-60.0, 90.0))
            side = 1.0 if rng.random() < 0.5 else -1.0
            d = side * float(rng.uniform(9.0, 16.0))
            w, h = float(rng.uniform(5.0, 12.0)), float(rng.uniform(4.0, 12.0))
            col = _BUILDINGS[int(rng.integers(len(_BUILDINGS)))]
            self.scenery.append((s, d, w, h, col))


def _draw_static(cam: _Cam, world: _World, sky, ground, road) -> Image.Image:
    W, H = cam.W, cam.H
    img = Image.new("RGB", (W, H), sky)
    dr = ImageDraw.Draw(img)
    dr.rectangle((0, int(round(cam.yh)), W, H), fill=ground)
    s = world.s_line
    if cam.front:
        s = s[s > -cam.z0 + 1.0]
    xl, yl = _arc_points(world.k, s, ROAD_HALF_WIDTH)
    xr, yr = _arc_points(world.k, s, -ROAD_HALF_WIDTH)
    cl, rl = cam.to_cam(xl, yl)
    cr, rr = cam.to_cam(xr, yr)
    poly = _clip_polygon(
        cl.tolist() + cr[::-1].tolist(), rl.tolist() + rr[::-1].tolist()
    )
    if len(poly) >= 3:
        dr.polygon([_ground_px(cam, c, r) for c, r in poly], fill=road)
    lw = max(1, int(round(W / 220)))
    for c_arr, r_arr in ((cl, rl), (cr, rr)):
        c1, r1, c2, r2, ok = _clip_segments(c_arr[:-1], r_arr[:-1], c_arr[1:], r_arr[1:])
        for i in np.flatnonzero(ok).tolist():
            dr.line((_ground_px(cam, c1[i], r1[i]), _ground_px(cam, c2[i], r2[i])), fill=_LINE, width=lw)
    return img


def _obj_rect(cam: _Cam, c: float, r: float, kind: str, w_m: float = 1.9, h_m: float = 1.5):
    """Pixel rectangle (x1, y1, x2, y2) of a billboard object standing at camera coords (c, r)."""
    col, row = _ground_px(cam, c, r)
    if cam.front:
        w = cam.base * (cam.a + cam.b * cam.z0 / c)
        if kind == "vehicle":
            ww, hh = w, 0.8 * w
        elif kind == "pedestrian":
            ww, hh = 0.42 * w, 1.1 * w
        elif kind == "barrier":
            ww, hh = 1.1 * w, 0.5 * w
        else:  # building: plain perspective
            ww, hh = cam.f * w_m / c, cam.f * h_m / c
    else:
        ww, hh = 1.3 * cam.f * w_m / c, 1.3 * cam.f * h_m / c
    return col - ww / 2.0, row - hh, col + ww / 2.0, row


def _front_box_norm(k: float, s: float, d: float, kind: str) -> tuple[float, float, float, float] | None:
    """Box of an object at (s, d) in the front-wide camera, normalised to [0, 1] (no clipping)."""
    cam = _cameras(1000, 1000)[1]
    x, y = _arc_point(k, s, d)
    c, r = cam.to_cam(x, y)
    if c < _NEAR:
        return None
    x1, y1, x2, y2 = _obj_rect(cam, c, r, kind)
    return x1 / 1000.0, y1 / 1000.0, x2 / 1000.0, y2 / 1000.0


def lead_bbox(f: SceneFacts, image_size: tuple[int, int] = (64, 64)) -> tuple[int, int, int, int] | None:
    """The lead vehicle's box in the front-wide camera, last frame (t0), Qwen 0-1000 scale."""
    if not f.lead_present:
        return None
    W, H = image_size
    cam = _cameras(W, H)[1]
    x, y = _arc_point(f.road_curvature, f.lead_gap, 0.0)
    c, r = cam.to_cam(x, y)
    x1, y1, x2, y2 = _obj_rect(cam, c, r, "vehicle")
    x1, x2 = min(max(x1, 0.0), W), min(max(x2, 0.0), W)
    y1, y2 = min(max(y1, 0.0), H), min(max(y2, 0.0), H)
    return (
        int(round(x1 / W * 1000)), int(round(y1 / H * 1000)),
        int(round(x2 / W * 1000)), int(round(y2 / H * 1000)),
    )  # fmt: skip


def _draw_vehicle(dr: ImageDraw.ImageDraw, box, color) -> None:
    x1, y1, x2, y2 = box
    h = y2 - y1
    dr.rectangle((x1, y1, x2, y2), fill=color)
    dr.rectangle((x1 + 0.12 * (x2 - x1), y1 + 0.1 * h, x2 - 0.12 * (x2 - x1), y1 + 0.42 * h), fill=_WINDOW)
    dr.rectangle((x1, y2 - 0.12 * h, x2, y2), fill=_BUMPER)


def _draw_pedestrian(dr: ImageDraw.ImageDraw, box) -> None:
    x1, y1, x2, y2 = box
    h, w = y2 - y1, x2 - x1
    dr.rectangle((x1 + 0.2 * w, y1, x2 - 0.2 * w, y1 + 0.2 * h), fill=_PED_HEAD)
    dr.rectangle((x1, y1 + 0.2 * h, x2, y1 + 0.6 * h), fill=_PED_SHIRT)
    dr.rectangle((x1 + 0.1 * w, y1 + 0.6 * h, x2 - 0.1 * w, y2), fill=_PED_LEGS)


def _draw_barrier(dr: ImageDraw.ImageDraw, box) -> None:
    x1, y1, x2, y2 = box
    dr.rectangle(box, fill=_BARRIER)
    w = x2 - x1
    for u in (0.2, 0.6):
        dr.rectangle((x1 + u * w, y1, x1 + (u + 0.2) * w, y2), fill=(250, 250, 250))


def _draw_frame(cam: _Cam, world: _World, static: Image.Image, frame: int) -> Image.Image:
    f = world.f
    img = static.copy()
    dr = ImageDraw.Draw(img)
    t = FRAME_OFFSETS_S[frame]
    es = world.ego_s[frame]  # ego along-road position at this frame (<= 0)
    k = world.k
    W = cam.W
    lw = max(1, int(round(W / 220)))

    # Dashed lane boundaries (4 m dashes every 12 m, fixed in the world -> they move with ego).
    lo = -80.0 if not cam.front else -cam.z0 + 1.0
    first = math.floor((lo + es) / 12.0) * 12.0
    starts = np.arange(first, es + world.s_hi, 12.0) - es
    if starts.size:
        ends = np.minimum(starts + 4.0, world.s_hi)
        for dlat in (0.5 * LANE_WIDTH, -0.5 * LANE_WIDTH):
            xa, ya = _arc_points(k, starts, dlat)
            xb, yb = _arc_points(k, ends, dlat)
            ca, ra = cam.to_cam(xa, ya)
            cb, rb = cam.to_cam(xb, yb)
            c1, r1, c2, r2, ok = _clip_segments(ca, ra, cb, rb)
            for i in np.flatnonzero(ok).tolist():
                dr.line((_ground_px(cam, c1[i], r1[i]), _ground_px(cam, c2[i], r2[i])), fill=_LINE, width=lw)

    # Ground markings: stop line and crosswalk.
    quads = []
    if f.traffic_light != "none":
        sl = f.stop_line_distance - es
        quads.append((sl - 0.5, sl + 0.5, -ROAD_HALF_WIDTH, ROAD_HALF_WIDTH))
    if f.pedestrian_crossing:
        pc = f.pedestrian_distance - es
        for j in range(7):
            d0 = -ROAD_HALF_WIDTH + j * 1.5
            quads.append((pc - 1.5, pc + 1.5, d0, d0 + 0.8))
    for s0, s1, d0, d1 in quads:
        xs, ys = [], []
        for s, d in ((s0, d0), (s1, d0), (s1, d1), (s0, d1)):
            x, y = _arc_point(k, s, d)
            xs.append(x)
            ys.append(y)
        cc, rr = cam.to_cam(np.array(xs), np.array(ys))
        poly = _clip_polygon(cc.tolist(), rr.tolist())
        if len(poly) >= 3:
            dr.polygon([_ground_px(cam, c, r) for c, r in poly], fill=_LINE)

    # Billboard objects, painted far to near.
    objs: list[tuple[float, float, float, str, object, float, float]] = []

    def add(s: float, d: float, kind: str, payload: object, w_m: float = 1.9, h_m: float = 1.5):
        x, y = _arc_point(k, s, d)
        if cam.front and x < 1.0:
            return
        c, r = cam.to_cam(x, y)
        if c < 1.0:
            return
        objs.append((c, r, s, kind, payload, w_m, h_m))

    # Apparent width of a vehicle: rear face for cameras looking along the road, side otherwise.
    side_w = 1.9 * abs(cam.cos) + 4.5 * abs(cam.sin)
    for s, d, w, h, col in world.scenery:
        add(s - es, d, "building", col, w, h)
    for ov in f.other_vehicles:
        dlat = {"left": LANE_WIDTH, "right": -LANE_WIDTH, "ego": 0.0}[ov.lane]
        add(ov.offset + ov.speed * t - es, dlat, "vehicle", _COLORS[ov.color], side_w, 1.5)
    if f.blocked_lane:
        dlat = 0.0
        if f.blocked_lane_kind == "adjacent":
            dlat = LANE_WIDTH if f.blocked_lane_side == "left" else -LANE_WIDTH
        add(f.blocked_distance - es, dlat, "barrier", None, 3.0, 1.2)
    if f.pedestrian_crossing:
        direction = -1.0 if f.pedestrian_side == "left" else 1.0  # left -> walking right
        d_ped = -direction * 2.0 + direction * 1.2 * t
        add(f.pedestrian_distance - es, d_ped, "pedestrian", None, 0.6, 1.75)
    if f.lead_present:
        add(f.lead_gap + f.lead_speed * t - es, 0.0, "vehicle", _COLORS[f.lead_color], side_w, 1.5)

    objs.sort(key=lambda o: -o[0])
    for c, r, s, kind, payload, w_m, h_m in objs:
        box = _obj_rect(cam, c, r, kind, w_m, h_m)
        if box[2] < 0 or box[0] > W or box[3] < 0 or box[1] > cam.H:
            continue
        if kind == "vehicle":
            _draw_vehicle(dr, box, payload)
        elif kind == "pedestrian":
            _draw_pedestrian(dr, box)
        elif kind == "barrier":
            _draw_barrier(dr, box)
        else:
            dr.rectangle(box, fill=payload, outline=(70, 70, 70))

    # Traffic light: a large housing with one big lit lamp (red top, yellow middle, green
    # bottom), in the top-right region above the horizon so it never hides road objects.
    if cam.front and f.traffic_light != "none":
        sl = f.stop_line_distance - es
        x, y = _arc_point(k, sl, -0.8 * LANE_WIDTH)
        c, r = cam.to_cam(x, y)
        if c > 1.0:
            hh = min(cam.base * (cam.light_a + cam.light_b * cam.z0 / c), cam.yh - 0.05 * cam.H)
            hw = 0.8 * hh
            col = cam.cx + cam.f * r / c
            col = min(max(col, 0.62 * W), 0.92 * W - hw / 2.0)
            x1, y1 = col - hw / 2.0, 0.02 * cam.H
            dr.rectangle((x1, y1, x1 + hw, y1 + hh), fill=_HOUSING)
            ly = y1 + _LIGHT_SLOT[f.traffic_light] * hh
            dr.rectangle((x1 + 0.1 * hw, ly, x1 + 0.9 * hw, ly + 0.5 * hh), fill=_LIGHT_RGB[f.traffic_light])
    return img


@functools.lru_cache(maxsize=4)
def _noise_tile(W: int, H: int, amp: int) -> np.ndarray:
    """Fixed sparse sensor speckle (about 2% of the samples are off by up to +-amp)."""
    rng = np.random.default_rng(20240229)
    vals = rng.integers(-amp, amp + 1, size=(H, W + 61, 3), dtype=np.int16)
    return np.where(rng.random((H, W + 61, 3)) < 0.02, vals, 0).astype(np.int16)


def _encode_png(arr: np.ndarray) -> bytes:
    """Minimal deterministic PNG writer (RGB8, filter 0, zlib level 1)."""
    h, w, _ = arr.shape
    raw = np.empty((h, w * 3 + 1), np.uint8)
    raw[:, 0] = 0
    raw[:, 1:] = arr.reshape(h, w * 3)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 1))
        + chunk(b"IEND", b"")
    )


def _encode(img: Image.Image, image_format: str, noise: int, offset: int, jpeg_quality: int) -> bytes:
    if noise > 0 or image_format == "png":
        arr = np.asarray(img)
        if noise > 0:
            W, H = img.size
            o = offset % 61
            arr = np.clip(arr + _noise_tile(W, H, noise)[:, o : o + W], 0, 255).astype(np.uint8)
        if image_format == "png":
            return _encode_png(arr)
        img = Image.fromarray(arr)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=jpeg_quality)
    return buf.getvalue()


def render_images(f: SceneFacts, camera_ids: Iterable[int], image_size: tuple[int, int] = (64, 64),
                  *, seed: int = 0, image_format: str = "png", noise: int | None = None,
                  jpeg_quality: int = 90) -> dict[int, list[bytes]]:  # fmt: skip
    """Encoded frames (oldest first) per camera id. Deterministic in (facts, seed, options)."""
    if image_format not in ("png", "jpeg"):
        raise ValueError(f"image_format must be 'png' or 'jpeg', not {image_format!r}")
    W, H = int(image_size[0]), int(image_size[1])
    if W < 16 or H < 16:
        raise ValueError(f"image_size too small: {image_size}")
    if noise is None:
        noise = 0 if W * H <= 256 * 256 else 4
    rng = np.random.default_rng([seed, 0x5CE7E])
    ego_s = [_hist_s(f.ego_speed, f.ego_accel, t) if t < 0 else 0.0 for t in FRAME_OFFSETS_S]
    world = _World(f, ego_s, rng)
    cams = _cameras(W, H)
    sky = _SKY[(f.weather, f.time_of_day)]
    ground, road = _GROUND[f.weather], _ROAD[f.weather]
    noise_base = int(rng.integers(0, 1 << 16))
    out: dict[int, list[bytes]] = {}
    for cid in camera_ids:
        cam = cams[cid]
        static = _draw_static(cam, world, sky, ground, road)
        out[cid] = [
            _encode(_draw_frame(cam, world, static, fr), image_format, noise,
                    noise_base + 7 * cid + 13 * fr, jpeg_quality)  # fmt: skip
            for fr in range(len(FRAME_OFFSETS_S))
        ]
    return out


# --------------------------------------------------------------------------------------------
# Scene assembly
# --------------------------------------------------------------------------------------------


def scene_id_for(seed: int) -> str:
    return f"synth-{seed:08d}"


def generate_scene(seed: int, image_size: tuple[int, int] = (64, 64),
                   task_defaults: TaskDefaults | None = None, *, image_format: str = "png",
                   noise: int | None = None, jpeg_quality: int = 90) -> Scene:  # fmt: skip
    """One synthetic scene; a pure function of its arguments (same seed -> identical bytes).

    image_size is (width, height). noise: per-pixel noise amplitude added to the pictures;
    None = 0 up to 256x256 and 4 above (large images then carry realistic PNG payload sizes)."""
    td = task_defaults or TaskDefaults()
    rng = np.random.default_rng(seed)
    facts, plan = sample_facts(rng)
    q_seeded = int(rng.integers(len(VQA_QUESTIONS)))
    q = q_seeded if td.vqa_question is None else int(td.vqa_question) % len(VQA_QUESTIONS)
    W, H = int(image_size[0]), int(image_size[1])

    hist_xyz, hist_rot = ego_history(facts)
    fut_rot = [_yaw_rot(th) for th in plan.yaw]
    text = scene_text(facts, plan, q, lead_bbox(facts, (W, H)), td.grounding_question)

    cam_ids = sorted(set(TRAJ_CAMERA_IDS) | set(VQA_CAMERA_IDS))
    frames = render_images(facts, cam_ids, (W, H), seed=seed, image_format=image_format,
                           noise=noise, jpeg_quality=jpeg_quality)  # fmt: skip
    return Scene(
        scene_id=scene_id_for(seed),
        seed=seed,
        facts=facts,
        image_format=image_format,
        image_size=(W, H),
        frame_offsets_s=list(FRAME_OFFSETS_S),
        camera_ids=list(TRAJ_CAMERA_IDS),
        camera_order=[CAMERA_NAMES[c] for c in TRAJ_CAMERA_IDS],
        images=[b for c in TRAJ_CAMERA_IDS for b in frames[c]],
        vqa_camera_ids=list(VQA_CAMERA_IDS),
        vqa_camera_order=[CAMERA_NAMES[c] for c in VQA_CAMERA_IDS],
        vqa_images=[b for c in VQA_CAMERA_IDS for b in frames[c]],
        ego_history_xyz=hist_xyz,
        ego_history_rot=hist_rot,
        ego_future_xyz=[list(p) for p in plan.xyz],
        ego_future_rot=fut_rot,
        text=text,
    )


def iter_scenes(n: int, seed0: int = 0, image_size: tuple[int, int] = (64, 64),
                **kwargs) -> Iterator[Scene]:  # fmt: skip
    """Scenes for seeds seed0 .. seed0+n-1 (kwargs go to generate_scene)."""
    for i in range(n):
        yield generate_scene(seed0 + i, image_size, **kwargs)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Scene)


def encode_scene(scene: Scene) -> bytes:
    return _ENCODER.encode(scene)


def decode_scene(data: bytes) -> Scene:
    return _DECODER.decode(data)


def write_scene(scene: Scene, path: str | os.PathLike) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_scene(scene))
    os.replace(tmp, path)
    return path


def read_scene(path: str | os.PathLike) -> Scene:
    return decode_scene(Path(path).read_bytes())


def write_scenes(out_dir: str | os.PathLike, n: int, seed0: int = 0,
                 image_size: tuple[int, int] = (64, 64), **kwargs) -> list[Path]:  # fmt: skip
    """Write scene-<scene_id>.msgpack files for seeds seed0 .. seed0+n-1; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        write_scene(sc, out / f"scene-{sc.scene_id}.msgpack")
        for sc in iter_scenes(n, seed0, image_size, **kwargs)
    ]


# --------------------------------------------------------------------------------------------
# Reports and plots
# --------------------------------------------------------------------------------------------


def distribution_report(n: int = 500, seed0: int = 0) -> dict[str, dict[str, float]]:
    """Shares of the main fact categories and meta actions over seeds seed0 .. seed0+n-1
    (facts and plans only; no rendering)."""
    counts: dict[str, dict[str, int]] = {}

    def bump(key: str, val: str) -> None:
        counts.setdefault(key, {})
        counts[key][val] = counts[key].get(val, 0) + 1

    for i in range(n):
        f, p = sample_facts(np.random.default_rng(seed0 + i))
        bump("traffic_light", f.traffic_light)
        bump("lead", f.lead_relation)
        bump("pedestrian", f.pedestrian_side if f.pedestrian_crossing else "none")
        bump("blocked_lane", f.blocked_lane_kind)
        bump("road", "straight" if f.road_curvature == 0 else "left" if f.road_curvature > 0 else "right")
        bump("ego_speed", "<2" if f.ego_speed < 2 else "2-8" if f.ego_speed < 8 else "8-14" if f.ego_speed < 14 else ">=14")
        bump("longitudinal", p.longitudinal)
        bump("lateral", p.lateral)
        bump("lane", p.lane)
    return {k: {v: c / n for v, c in sorted(d.items())} for k, d in counts.items()}


def bev_plot(scenes: Sequence[Scene], predictions: Sequence | None = None,
             path: str | os.PathLike = "bev.png", *, ncols: int | None = None) -> Path:  # fmt: skip
    """Bird's-eye grid: history (grey), planner future (blue), optional predicted samples
    (orange; per scene an array-like of shape (K, 64, >=2) or (64, >=2), or None), lead vehicle
    at t0 and stop line. Forward is up, left is left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(scenes))
    ncols = ncols or int(math.ceil(math.sqrt(n)))
    nrows = int(math.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.0 * ncols, 3.6 * nrows), squeeze=False)
    for idx, ax in enumerate(axes.flat):
        if idx >= len(scenes):
            ax.axis("off")
            continue
        sc = scenes[idx]
        f = sc.facts
        h = np.asarray(sc.ego_history_xyz)
        fu = np.asarray(sc.ego_future_xyz)
        k = f.road_curvature
        s = np.linspace(-30.0, max(40.0, float(fu[-1, 0]) + 10.0), 80)
        for dlat in (-ROAD_HALF_WIDTH, -0.5 * LANE_WIDTH, 0.5 * LANE_WIDTH, ROAD_HALF_WIDTH):
            x, y = _arc_points(k, s, dlat)
            ax.plot(-y, x, color="0.8", lw=0.8, ls="-" if abs(dlat) > 2 else "--", zorder=0)
        if f.traffic_light != "none":
            x0, y0 = _arc_point(k, f.stop_line_distance, -ROAD_HALF_WIDTH)
            x1, y1 = _arc_point(k, f.stop_line_distance, ROAD_HALF_WIDTH)
            ax.plot([-y0, -y1], [x0, x1], color={"green": "g", "yellow": "y", "red": "r"}[f.traffic_light], lw=2)
        if f.lead_present:
            x, y = _arc_point(k, f.lead_gap + LEAD_LENGTH / 2, 0.0)
            ax.plot([-y], [x], marker="s", ms=7, color="k")
        if f.pedestrian_crossing:
            x, y = _arc_point(k, f.pedestrian_distance, 0.0)
            ax.plot([-y], [x], marker="*", ms=9, color="m")
        if f.blocked_lane:
            dlat = 0.0 if f.blocked_lane_kind == "ego" else (LANE_WIDTH if f.blocked_lane_side == "left" else -LANE_WIDTH)
            x, y = _arc_point(k, f.blocked_distance, dlat)
            ax.plot([-y], [x], marker="X", ms=8, color="orange")
        if predictions is not None and idx < len(predictions) and predictions[idx] is not None:
            pr = np.asarray(predictions[idx], dtype=np.float64)
            if pr.ndim == 2:
                pr = pr[None]
            for smp in pr:
                ax.plot(-smp[:, 1], smp[:, 0], color="tab:orange", lw=1.0, alpha=0.7)
        ax.plot(-h[:, 1], h[:, 0], color="0.4", lw=2)
        ax.plot(-fu[:, 1], fu[:, 0], color="tab:blue", lw=1.6)
        ax.plot([0], [0], marker="o", ms=4, color="k")
        ax.set_aspect("equal", adjustable="datalim")
        ax.set_title(f"{sc.scene_id}\n{f.traffic_light} light, lead {f.lead_relation}", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
