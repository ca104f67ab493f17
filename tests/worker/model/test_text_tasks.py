"""Text-task output parsing (docs: alpamayo2-model.md section 5)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.model.text_tasks import (
    AUTO_LABELING_KEYS,
    TaskOutput,
    extract_text,
    looks_like_box,
    parse_auto_labeling,
    parse_grounding,
    parse_meta_action,
    parse_task_output,
    split_meta_action,
)

from tests import REPO_ROOT

META_FIXTURE = (
    "The lead vehicle is slowing, so the ego should keep distance.\n"
    "Longitudinal: Keep Speed.\n"
    "Lateral: Go Straight.\n"
    "Lane: Lane Keep."
)


def test_module_does_not_import_torch() -> None:
    root = str(REPO_ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = "import sys, worker.model.text_tasks; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root
    )
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------
# 5.1 extraction
# ------------------------------------------------------------------------------------------


def test_extract_text_cuts_prefix_and_stops() -> None:
    raw = (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        "Slow for the lead vehicle.\nLongitudinal: Strong Deceleration.\n"
        "Lateral: Go Straight.\nLane: Lane Keep.<|traj_future_start|><|endoftext|><|endoftext|>"
    )
    assert extract_text(raw) == (
        "Slow for the lead vehicle.\nLongitudinal: Strong Deceleration.\n"
        "Lateral: Go Straight.\nLane: Lane Keep."
    )
    assert extract_text("  The lane is blocked by construction equipment.<|im_end|>") == (
        "The lane is blocked by construction equipment."
    )
    # the last assistant prefix wins; traj_future_start is cut before im_end
    assert extract_text("<|im_start|>assistant\na<|im_start|>assistant\n b <|im_end|>c") == "b"
    assert extract_text("x<|im_end|>y<|traj_future_start|>z") == "x"
    assert extract_text("") == ""
    assert extract_text("no markers at all ") == "no markers at all"


# ------------------------------------------------------------------------------------------
# 5.2 meta action
# ------------------------------------------------------------------------------------------


def test_split_meta_action_at_first_axis_marker() -> None:
    cot, meta = split_meta_action(META_FIXTURE)
    assert cot == "The lead vehicle is slowing, so the ego should keep distance."
    assert meta == "Longitudinal: Keep Speed.\nLateral: Go Straight.\nLane: Lane Keep."
    # first marker of any axis, with optional whitespace before the colon
    cot, meta = split_meta_action(
        "Turn now.  \n\nLateral : Go Straight.\nLongitudinal: Decelerate."
    )
    assert cot == "Turn now." and meta.startswith("Lateral : Go Straight.")
    assert split_meta_action("Just reasoning, no actions.") == ("Just reasoning, no actions.", None)


def test_parse_meta_action_fields() -> None:
    _, meta = split_meta_action(META_FIXTURE)
    assert parse_meta_action(meta) == {
        "longitudinal": "Keep Speed",
        "lateral": "Go Straight",
        "lane": "Lane Keep",
    }
    # one-line layout and a missing field
    assert parse_meta_action("Longitudinal: Strong Deceleration. Lateral: Go Straight.") == {
        "longitudinal": "Strong Deceleration",
        "lateral": "Go Straight",
        "lane": None,
    }
    assert parse_meta_action(None) == {"longitudinal": None, "lateral": None, "lane": None}
    assert parse_meta_action("Longitudinal:\nLane: Lane Keep.\nextra text") == {
        "longitudinal": None,
        "lateral": None,
        "lane": "Lane Keep",
    }


# ------------------------------------------------------------------------------------------
# 5.3 auto-labeling
# ------------------------------------------------------------------------------------------


def test_auto_labeling_json_with_prose_around_it() -> None:
    text = (
        "Here is the label:\n"
        '{"chain_of_causation": "  Ego follows the lane. ", "critical_components_analysis": ""}'
        "\nHope this helps {not json}"
    )
    parsed = parse_auto_labeling(text)
    assert tuple(parsed) == AUTO_LABELING_KEYS
    assert parsed == {
        "critical_components_analysis": None,
        "ego_vehicle_motion_analysis": None,
        "trajectory_analysis": None,
        "chain_of_causation": "Ego follows the lane.",
    }


def test_auto_labeling_null_nonstring_and_first_dict_wins() -> None:
    text = (
        "{broken {\"not\": \"this\"}"
        ' and then {"critical_components_analysis": null, "ego_vehicle_motion_analysis": '
        '"1. type: keep lane,\\nduration: 0-2 seconds,\\nmotion: cruise", '
        '"trajectory_analysis": 42, "chain_of_causation": ["a", "b"]}'
    )
    parsed = parse_auto_labeling(text)
    # '{"not": "this"}' is the first dict that decodes
    assert parsed == dict.fromkeys(AUTO_LABELING_KEYS)
    parsed = parse_auto_labeling(text[text.index(" and then") :])
    assert parsed["critical_components_analysis"] is None
    assert parsed["ego_vehicle_motion_analysis"].startswith("1. type: keep lane,\nduration")
    assert parsed["trajectory_analysis"] == "42"
    assert parsed["chain_of_causation"] == "['a', 'b']"


def test_auto_labeling_without_json_raises() -> None:
    with pytest.raises(ValueError, match="no JSON object"):
        parse_auto_labeling("The scene is a highway with light traffic.")
    with pytest.raises(ValueError, match="no JSON object"):
        parse_auto_labeling('{"truncated": "js')
    with pytest.raises(ValueError):
        parse_auto_labeling("[1, 2, 3]")


# ------------------------------------------------------------------------------------------
# 5.4 grounding
# ------------------------------------------------------------------------------------------


def test_grounding_json_and_coordinates_kept_as_given() -> None:
    text = '[{"bbox_2d": [120, 455, 980, 1000], "label": "lead car"}]'
    assert parse_grounding(text) == [
        {"bbox_2d": [120.0, 455.0, 980.0, 1000.0], "label": "lead car"}
    ]
    assert parse_grounding('[{"bbox_2d": [0.1, 0.2, 0.3, 0.4]}]') == [
        {"bbox_2d": [0.1, 0.2, 0.3, 0.4], "label": None}
    ]
    assert looks_like_box(text) and looks_like_box("[1, 2]") and not looks_like_box("no")


def test_grounding_python_literal_and_wrapped_literal() -> None:
    assert parse_grounding("[{'bbox_2d': [1, 2, 3, 4], 'label': 'car'}]") == [
        {"bbox_2d": [1.0, 2.0, 3.0, 4.0], "label": "car"}
    ]
    wrapped = "{'bbox_2d': [1, 2, 3, 4], 'label': 'a'}, {'bbox': [5, 6, 7, 8], 'label': 'b'}"
    assert parse_grounding(wrapped) == [
        {"bbox_2d": [1.0, 2.0, 3.0, 4.0], "label": "a"},
        {"bbox_2d": [5.0, 6.0, 7.0, 8.0], "label": "b"},
    ]
    assert parse_grounding('{"box": [9, 8, 7, 6], "label": "sign"}') == [
        {"bbox_2d": [9.0, 8.0, 7.0, 6.0], "label": "sign"}
    ]
    assert parse_grounding("[10, 20, 30, 40]") == [
        {"bbox_2d": [10.0, 20.0, 30.0, 40.0], "label": None}
    ]


def test_grounding_truncated_list_salvage() -> None:
    text = (
        '[{"bbox_2d": [10, 20, 30, 40], "label": "lead car"}, '
        '{"label": "truck", "bbox_2d": [100.5, 200, 300, 400]}, '
        '{"bbox_2d": [500, 600, 7'
    )
    assert parse_grounding(text) == [
        {"bbox_2d": [10.0, 20.0, 30.0, 40.0], "label": "lead car"},
        {"bbox_2d": [100.5, 200.0, 300.0, 400.0], "label": "truck"},
    ]
    fenced = '```json\n[{"bbox_2d": [1, 2, 3, 4], "label": "car"}]\n```'
    assert parse_grounding(fenced) == [{"bbox_2d": [1.0, 2.0, 3.0, 4.0], "label": "car"}]


def test_grounding_garbage_gives_empty_list() -> None:
    for text in ("", "I cannot see a vehicle.", '[{"bbox_2d": [1, 2, 3]}]', "{[(", "\x00"):
        assert parse_grounding(text) == []


# ------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------


def test_parse_task_output_per_task() -> None:
    out = parse_task_output("trajectory", "<|im_start|>assistant\nKeep lane.<|traj_future_start|>")
    assert isinstance(out, TaskOutput)
    assert out.text == "Keep lane." and out.cot == "Keep lane." and out.warning is None

    out = parse_task_output("meta_action", META_FIXTURE + "<|traj_future_start|>")
    assert out.cot == "The lead vehicle is slowing, so the ego should keep distance."
    assert out.meta_action == "Longitudinal: Keep Speed.\nLateral: Go Straight.\nLane: Lane Keep."
    assert out.meta_action_fields == {
        "longitudinal": "Keep Speed",
        "lateral": "Go Straight",
        "lane": "Lane Keep",
    }

    out = parse_task_output("meta_action", "only reasoning<|im_end|>")
    assert out.cot == "only reasoning" and out.meta_action is None and out.warning

    js = '{"trajectory_analysis": "Ego follows the supplied trajectory."}<|im_end|>'
    out = parse_task_output("auto_labeling", js)
    assert out.auto_label["trajectory_analysis"] == "Ego follows the supplied trajectory."
    assert out.warning is None

    out = parse_task_output("auto_labeling", "no json here<|im_end|>")
    assert out.auto_label == dict.fromkeys(AUTO_LABELING_KEYS) and "no JSON object" in out.warning

    box_text = '[{"bbox_2d": [10, 20, 30, 40], "label": "lead car"}]'
    out = parse_task_output("grounding", box_text + "<|im_end|>")
    assert out.boxes == [{"bbox_2d": [10.0, 20.0, 30.0, 40.0], "label": "lead car"}]
    assert out.answer == '[{"bbox_2d": [10, 20, 30, 40], "label": "lead car"}]'
    out = parse_task_output("grounding", "nothing")
    assert out.boxes == [] and out.warning

    answer = "The lane is partially blocked by construction equipment."
    out = parse_task_output("vqa", answer + "<|im_end|>")
    assert out.answer == answer

    with pytest.raises(ValueError, match="expected one of"):
        parse_task_output("poetry", "x")
