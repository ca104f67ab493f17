"""Text targets of the five tasks: reasoning, meta action, auto-labeling JSON, VQA, grounding."""

from __future__ import annotations

import json
import re

from worker.scenes.structs import GROUNDING_QUESTION, VQA_QUESTIONS, Plan, SceneFacts, SceneText


# Every sentence a reasoning can contain, by key; {gap} is a whole number of metres, {side} left/right.
# The generator below and `is_wellformed_reasoning` both read this one table.
REASONING_SENTENCES = {
    "light_none": "There is no traffic light ahead.",
    "light_green": "The traffic light ahead is green, so the ego vehicle may proceed.",
    "light_red": "The traffic light ahead is red, so the ego vehicle must stop before the stop line.",
    "light_yellow_stop": "The traffic light ahead is yellow and there is room to stop, "
                         "so the ego vehicle must stop before the stop line.",
    "light_yellow_go": "The traffic light ahead is yellow but the ego vehicle is too close to stop, so it proceeds.",
    "lead_none": "There is no lead vehicle ahead.",
    "lead_stopped_stop": "The lead vehicle is stopped {gap} meters ahead, so the ego vehicle must stop behind it.",
    "lead_stopped_slow": "The lead vehicle is stopped {gap} meters ahead, so the ego vehicle slows down behind it.",
    "lead_slower": "The lead vehicle is {gap} meters ahead and slower, so the ego vehicle keeps a safe gap.",
    "lead_similar": "The lead vehicle is {gap} meters ahead at a similar speed, so the ego vehicle follows it.",
    "lead_faster": "The lead vehicle is {gap} meters ahead and faster, so it does not limit the ego vehicle.",
    "pedestrian": "A pedestrian is crossing from the {side}, so the ego vehicle yields and stops before the crosswalk.",
    "blocked_adjacent": "The {side} lane is blocked by a barrier, so the ego vehicle keeps its lane.",
    "blocked_ego": "The ego lane is blocked by a barrier ahead, so the ego vehicle changes to the {side} lane.",
    "road_straight": "The road ahead is straight.",
    "road_curve": "The road ahead curves to the {side}.",
}
_SLOTS = {"{gap}": r"\d+", "{side}": r"(?:left|right)"}


def _sentence_pattern(template: str) -> re.Pattern:
    rx = re.escape(template)
    for slot, part in _SLOTS.items():
        rx = rx.replace(re.escape(slot), part)
    return re.compile(rx)


_SENTENCE_PATTERNS = [_sentence_pattern(t) for t in REASONING_SENTENCES.values()]


def is_wellformed_reasoning(text: str) -> bool:
    """Whether every sentence of `text` is one the generator's grammar can produce (each sentence
    ends with a period; they are separated by single spaces)."""
    sentences = [x + "." for x in text.strip().split(". ")]
    sentences[-1] = sentences[-1][:-1]
    return bool(text.strip()) and all(any(p.fullmatch(x) for p in _SENTENCE_PATTERNS) for x in sentences)


def _light_sentence(f: SceneFacts, p: Plan) -> str:
    light = f.traffic_light
    if light == "yellow":
        return REASONING_SENTENCES["light_yellow_stop" if p.yellow_stop else "light_yellow_go"]
    return REASONING_SENTENCES[f"light_{light}"]


def _lead_sentence(f: SceneFacts, p: Plan) -> str:
    rel = f.lead_relation
    if rel == "stopped":
        rel = "stopped_stop" if p.longitudinal == "Stop" else "stopped_slow"
    return REASONING_SENTENCES[f"lead_{rel}"].format(gap=int(round(f.lead_gap)))


def _reasoning(f: SceneFacts, p: Plan) -> str:
    parts = [_light_sentence(f, p), _lead_sentence(f, p)]
    if f.pedestrian_crossing:
        parts.append(REASONING_SENTENCES["pedestrian"].format(side=f.pedestrian_side))
    if f.blocked_lane_kind in ("adjacent", "ego"):
        parts.append(REASONING_SENTENCES[f"blocked_{f.blocked_lane_kind}"].format(side=f.blocked_lane_side))
    k = f.road_curvature
    if k == 0.0:
        parts.append(REASONING_SENTENCES["road_straight"])
    else:
        parts.append(REASONING_SENTENCES["road_curve"].format(side="left" if k > 0 else "right"))
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
