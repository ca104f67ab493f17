"""Egomotion: the ego history and the rule-based planner future (IDM for free road and a lead
vehicle, kinematic stop targets, jerk limits, lane changes), in the t0 ego frame."""

from __future__ import annotations

import math
from typing import Sequence

from worker.scenes.road import arc_point, frenet, lane_change_geometry, smootherstep
from worker.scenes.structs import (ACCEL_MAX, ACCEL_MIN, CROSSWALK_MARGIN, CURVATURE_MAX, DT, HISTORY_TIMES_S,
                                   IDM_A, IDM_B, IDM_S0, IDM_T, JERK_MAX, LEAD_LENGTH, N_FUTURE,
                                   STOP_LINE_MARGIN, STOP_ONSET, YELLOW_STOP_DECEL, Plan, SceneFacts)


def yaw_rot(th: float) -> list[list[float]]:
    c, s = math.cos(th), math.sin(th)
    return [[c, 0.0 - s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]


def history_s(v0: float, a: float, t: float) -> float:
    """Along-road position at time t <= 0 for speed max(0, v0 + a t), position 0 at t = 0."""
    if a > 0.0 and v0 + a * t < 0.0:
        return -(v0 * v0) / (2.0 * a)
    return v0 * t + 0.5 * a * t * t


def ego_history(f: SceneFacts) -> tuple[list[list[float]], list[list[list[float]]]]:
    """16 history poses (t0-1.5 .. t0) on the ego lane centre line, in the t0 ego frame."""
    k = f.road_curvature
    xyz, rot = [], []
    for t in HISTORY_TIMES_S:
        s = history_s(f.ego_speed, f.ego_accel, t) if t < 0.0 else 0.0
        x, y = arc_point(k, s, 0.0)
        xyz.append([x + 0.0, y + 0.0, 0.0])
        rot.append(yaw_rot(k * s))
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
            # a ramp over f steps removes v from a_f = -2v / (dt f) in steps of |a_f| / (f - 1):
            # the shortest f whose steps (and first change from a_prev) stay within J dt
            f = math.floor(n + 1e-6)
            while 2.0 * v / (DT * f * (f - 1)) > step + 1e-9:
                f += 1
            return min(max(-2.0 * v / (DT * f), a_prev - step), a_prev + step)
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
    lc_start, lc_len, lc_off = lane_change_geometry(f)
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
        d_t = lc_off * smootherstep((s_t - lc_start) / lc_len) if lc_off else 0.0
        px, py = arc_point(k_road, s_t, d_t)
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
        s_e, d_e = frenet(k_road, x, y)

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
