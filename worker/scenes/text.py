"""Text targets of the five tasks: reasoning, meta action, auto-labeling JSON, VQA, grounding."""

from __future__ import annotations

import json

from worker.scenes.structs import GROUNDING_QUESTION, VQA_QUESTIONS, Plan, SceneFacts, SceneText


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
