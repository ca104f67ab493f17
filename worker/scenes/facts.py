"""Fact sampling: the ground truth of one scene from a seeded generator, redrawn until the
planner finds a valid plan."""

from __future__ import annotations

import math

import numpy as np

from worker.scenes.planner import plan_future
from worker.scenes.render import front_box_norm
from worker.scenes.road import desired_speed
from worker.scenes.structs import (ACCEL_MAX, ACCEL_MIN, CROSSWALK_AFTER_STOP_LINE, CROSSWALK_MARGIN,
                                   EGO_FRONT, MIN_LEAD_CLEARANCE, STOP_LINE_MARGIN, TIMES_OF_DAY,
                                   VEHICLE_COLORS, V_MAX, WEATHERS, OtherVehicle, Plan, SceneFacts)


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
        box = front_box_norm(f.road_curvature, f.lead_gap, 0.0, "vehicle")
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
