"""Parsing of the VLM's generated text for each task (no torch).

Docs: alpamayo2-model.md section 5 (5.1 common decoding, 5.2 meta action, 5.3 auto-labeling JSON,
5.4 grounding, 5.5 VQA) and 3.2 (tasks).

The functions never raise on model garbage, with one documented exception:
:func:`parse_auto_labeling` raises ``ValueError`` when no JSON object is found, as the reference
does; :func:`parse_task_output` catches that and reports it in ``TaskOutput.warning``.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from schemas import TASKS

__all__ = [
    "ASSISTANT_PREFIX",
    "TRAJ_FUTURE_START",
    "IM_END",
    "AUTO_LABELING_KEYS",
    "META_ACTION_KEYS",
    "extract_text",
    "split_meta_action",
    "parse_meta_action",
    "parse_auto_labeling",
    "parse_grounding",
    "looks_like_box",
    "TaskOutput",
    "parse_task_output",
]

ASSISTANT_PREFIX = "<|im_start|>assistant\n"
TRAJ_FUTURE_START = "<|traj_future_start|>"
IM_END = "<|im_end|>"

#: Fixed key order of the auto-labeling JSON (section 5.3).
AUTO_LABELING_KEYS = (
    "critical_components_analysis",
    "ego_vehicle_motion_analysis",
    "trajectory_analysis",
    "chain_of_causation",
)
#: Fields of a meta action, in output order (section 5.2).
META_ACTION_KEYS = ("longitudinal", "lateral", "lane")

_META_MARKER = re.compile(r"(?:Longitudinal|Lateral|Lane)\s*:")
_META_FIELD = re.compile(r"(Longitudinal|Lateral|Lane)\s*:")
_NUM = r"""([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"""
_BOX_KEY_RE = re.compile(
    r"""["'](bbox_2d|bbox|box)["']\s*:\s*\[\s*"""
    + r"\s*,\s*".join([_NUM] * 4)
    + r"""\s*\](?:\s*,\s*["']label["']\s*:\s*(?:"([^"]*)"|'([^']*)'))?"""
)
_LABEL_RE = re.compile(r"""["']label["']\s*:\s*(?:"([^"]*)"|'([^']*)')""")
_FENCE_RE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)


# --------------------------------------------------------------------------------------------
# 5.1 common decoding
# --------------------------------------------------------------------------------------------


def extract_text(decoded: str) -> str:
    """Generated text of one row, from ``batch_decode(skip_special_tokens=False)`` output.

    Keeps the text after the last ``<|im_start|>assistant\\n`` (if present), cuts at the first
    ``<|traj_future_start|>``, then at the first ``<|im_end|>``, and strips whitespace.
    """
    text = decoded or ""
    idx = text.rfind(ASSISTANT_PREFIX)
    if idx >= 0:
        text = text[idx + len(ASSISTANT_PREFIX):]
    text = text.split(TRAJ_FUTURE_START, 1)[0]
    text = text.split(IM_END, 1)[0]
    return text.strip()


def split_meta_action(text: str) -> tuple[str, str | None]:
    """Split CoT and meta action at the first ``(?:Longitudinal|Lateral|Lane)\\s*:``.

    Returns ``(cot, meta_action)``: the text before the marker right-stripped, and the text
    from the marker on left-stripped; ``(text, None)`` when there is no marker.
    """
    m = _META_MARKER.search(text)
    if m is None:
        return text, None
    return text[: m.start()].rstrip(), text[m.start():].lstrip()


def parse_meta_action(block: str | None) -> dict[str, str | None]:
    """Fields of a meta-action block ``Longitudinal: <v>.\\nLateral: <v>.\\nLane: <v>.``.

    Returns ``{"longitudinal", "lateral", "lane"}``. Each value is the text after its key up to
    the next key or the end of the line, stripped, with one trailing ``.`` removed; the first
    occurrence of a key wins; a missing or empty field is None. Works whether the fields are on
    separate lines or on one line.
    """
    out: dict[str, str | None] = {k: None for k in META_ACTION_KEYS}
    if not block:
        return out
    matches = list(_META_FIELD.finditer(block))
    for i, m in enumerate(matches):
        key = m.group(1).lower()
        end = matches[i + 1].start() if i + 1 < len(matches) else len(block)
        value = block[m.end(): end].split("\n", 1)[0].strip()
        if value.endswith("."):
            value = value[:-1].rstrip()
        if out[key] is None and value:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------
# 5.3 auto-labeling
# --------------------------------------------------------------------------------------------


def parse_auto_labeling(text: str) -> dict[str, str | None]:
    """The four auto-labeling fields from generated text (`parse_auto_labeling_json`).

    Scans every ``{`` and tries ``json.JSONDecoder.raw_decode`` from it; the first dict found
    wins (prose before/after is ignored). Missing or null keys become None; non-strings are
    converted with ``str()``; strings are stripped and an empty string becomes None.

    Returns:
        dict with exactly the keys of :data:`AUTO_LABELING_KEYS`, in that order.

    Raises:
        ValueError: no JSON object in the text.
    """
    text = text or ""
    decoder = json.JSONDecoder()
    obj: dict[str, Any] | None = None
    pos = text.find("{")
    while pos >= 0:
        try:
            value, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            obj = value
            break
        pos = text.find("{", pos + 1)
    if obj is None:
        preview = text[:80].replace("\n", " ")
        raise ValueError(
            f"auto-labeling output contains no JSON object (expected keys "
            f"{', '.join(AUTO_LABELING_KEYS)}; text starts {preview!r})"
        )
    out: dict[str, str | None] = {}
    for key in AUTO_LABELING_KEYS:
        value = obj.get(key)
        if value is None:
            out[key] = None
            continue
        s = value if isinstance(value, str) else str(value)
        s = s.strip()
        out[key] = s or None
    return out


# --------------------------------------------------------------------------------------------
# 5.4 grounding
# --------------------------------------------------------------------------------------------


def looks_like_box(text: str) -> bool:
    """Section 5.1 step 6: contains ``bbox_2d``/``bbox``/``box``, or is ``[...]`` with a digit."""
    t = text.strip()
    if "bbox_2d" in t or "bbox" in t or "box" in t:
        return True
    return t.startswith("[") and t.endswith("]") and any(c.isdigit() for c in t)


def _as_box(value: Any) -> list[float] | None:
    if isinstance(value, (list, tuple)) and len(value) == 4:
        try:
            box = [float(v) for v in value]
        except (TypeError, ValueError):
            return None
        if all(v == v and v not in (float("inf"), float("-inf")) for v in box):
            return box
    return None


def _boxes_from_obj(obj: Any) -> list[dict[str, Any]]:
    """Normalise a parsed structure: a dict, a list of dicts, or bare [x1, y1, x2, y2] lists."""
    items = obj if isinstance(obj, (list, tuple)) else [obj]
    if _as_box(items) is not None and not any(isinstance(v, (list, tuple, dict)) for v in items):
        items = [items]  # a single bare box
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, dict):
            box = None
            for key in ("bbox_2d", "bbox", "box"):
                if key in item:
                    box = _as_box(item[key])
                    if box is not None:
                        break
            if box is None:
                continue
            label = item.get("label")
            out.append({"bbox_2d": box, "label": None if label is None else str(label)})
        else:
            box = _as_box(item)
            if box is not None:
                out.append({"bbox_2d": box, "label": None})
    return out


def _regex_boxes(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in _BOX_KEY_RE.finditer(text):
        label = m.group(6) if m.group(6) is not None else m.group(7)
        if label is None:
            # a label written before the box key, inside the same object
            start = text.rfind("{", 0, m.start())
            if start >= 0:
                lm = None
                for lm in _LABEL_RE.finditer(text, start, m.start()):
                    pass
                if lm is not None:
                    label = lm.group(1) if lm.group(1) is not None else lm.group(2)
        out.append({"bbox_2d": [float(m.group(i)) for i in range(2, 6)], "label": label})
    return out


def parse_grounding(text: str) -> list[dict[str, Any]]:
    """Boxes from a grounding answer (Qwen style ``[{"bbox_2d": [x1, y1, x2, y2], "label": ...}]``).

    Parse order: ``json.loads``, ``ast.literal_eval``, ``ast.literal_eval("[" + text + "]")``,
    then a regex fallback matching ``"(bbox_2d|bbox|box)": [n, n, n, n]`` with an optional
    ``"label": "..."`` (which salvages truncated lists). A surrounding Markdown code fence is
    removed first. Coordinates are returned exactly as given (no rescaling of 0-1000 or 0-1
    values).

    Returns:
        list of ``{"bbox_2d": [4 floats], "label": str | None}``; ``[]`` when nothing parses.
    """
    t = (text or "").strip()
    fence = _FENCE_RE.match(t)
    if fence:
        t = fence.group(1).strip()
    if not t:
        return []
    parsers = (
        lambda s: json.loads(s),
        lambda s: ast.literal_eval(s),
        lambda s: ast.literal_eval("[" + s + "]"),
    )
    for parse in parsers:
        try:
            obj = parse(t)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        boxes = _boxes_from_obj(obj)
        if boxes:
            return boxes
    return _regex_boxes(t)


# --------------------------------------------------------------------------------------------
# per-task dispatch
# --------------------------------------------------------------------------------------------


@dataclass
class TaskOutput:
    """Parsed output of one generated sequence.

    Attributes:
        task: the task name.
        text: the extracted generated text (section 5.1 steps 2-3).
        cot: chain-of-thought text (trajectory, meta_action).
        meta_action: the raw meta-action block ``Longitudinal: ...`` (meta_action), or None.
        meta_action_fields: ``{"longitudinal", "lateral", "lane"}`` parsed from it, or None.
        auto_label: the four auto-labeling fields (auto_labeling); all None if unparseable.
        boxes: grounding boxes (grounding).
        answer: the answer text (vqa, grounding).
        warning: why a task output could not be parsed, or None.
    """

    task: str
    text: str
    cot: str | None = None
    meta_action: str | None = None
    meta_action_fields: dict[str, str | None] | None = None
    auto_label: dict[str, str | None] | None = None
    boxes: list[dict[str, Any]] | None = None
    answer: str | None = None
    warning: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse_task_output(task: str, text: str) -> TaskOutput:
    """Parse one generated sequence for ``task``.

    ``text`` may be the raw ``batch_decode(skip_special_tokens=False)`` string or already
    extracted text (:func:`extract_text` is applied either way; it is idempotent on clean text).

    * ``trajectory``: ``cot = text``.
    * ``meta_action``: ``cot`` / ``meta_action`` split per :func:`split_meta_action`, fields per
      :func:`parse_meta_action`; a warning when no meta action was found.
    * ``auto_labeling``: ``auto_label`` per :func:`parse_auto_labeling`; when no JSON object is
      found all four fields are None and ``warning`` says so (no exception).
    * ``grounding``: ``boxes`` per :func:`parse_grounding`, ``answer = text``; a warning when
      no box was found.
    * ``vqa``: ``answer = text``.

    Raises:
        ValueError: unknown task name (a caller error, not model output).
    """
    if task not in TASKS:
        raise ValueError(f"parse_task_output: task={task!r}, expected one of {', '.join(TASKS)}")
    clean = extract_text(text)
    out = TaskOutput(task=task, text=clean)
    if task == "trajectory":
        out.cot = clean
    elif task == "meta_action":
        cot, meta = split_meta_action(clean)
        out.cot = cot
        out.meta_action = meta
        if meta is None:
            out.warning = "meta_action: no 'Longitudinal:/Lateral:/Lane:' block in the output"
        else:
            out.meta_action_fields = parse_meta_action(meta)
    elif task == "auto_labeling":
        try:
            out.auto_label = parse_auto_labeling(clean)
        except ValueError as e:
            out.auto_label = {k: None for k in AUTO_LABELING_KEYS}
            out.warning = f"auto_labeling: {e}"
    elif task == "grounding":
        out.answer = clean
        out.boxes = parse_grounding(clean)
        if not out.boxes:
            out.warning = "grounding: no bounding box found in the output"
    else:  # vqa
        out.answer = clean
    return out
