"""Where ``alpamayo-producer publish`` takes its scenes from, as ``SceneItem`` s (images loaded lazily).

* ``iter_scene_dir``: ``*.msgpack`` scene files (``worker.scenes.write_scenes``).
* ``iter_manifest``: JSONL (one object per line) or Parquet rows. A row is either
  ``{"scene_path": "scene-x.msgpack"}`` (relative to the manifest's directory) or a raw scene:
  ``scene_id``, ``images`` (camera-major image file paths or ``file://`` URIs), ``camera_order``,
  optional ``num_frames_per_camera``, ``vqa_images``/``vqa_camera_order``, ``ego_history_xyz`` with
  ``ego_history_rot`` or ``ego_history_quat``, ``ego_future_xyz`` with ``ego_future_rot`` or
  ``ego_future_quat``. Any row may add ``task`` (a task or a list of tasks, overriding
  ``--tasks``), ``question``, ``nav_text`` and ``labels``.
* ``iter_synthetic``: synthetic scenes ``S .. S+N-1`` (``worker.scenes``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

import schemas as S
from producer_tools.common import ToolError
from worker.scenes import DEFAULT_IMAGE_SIZE, generate_scene, read_scene
from worker.scenes.request import SceneItem, scene_item

__all__ = ["iter_scene_dir", "iter_manifest", "manifest_tasks", "iter_synthetic"]


def _lazy_scene(path: Path, **overrides) -> SceneItem:
    """Scene file -> SceneItem; the file is read now (ids and egomotion) but dropped afterwards
    only if the caller drops the item."""
    return scene_item(read_scene(path), **overrides)


def iter_scene_dir(directory: str | os.PathLike) -> tuple[int, Iterator[SceneItem]]:
    """(count, items) for the ``*.msgpack`` scene files of a directory (sorted by name)."""
    paths = sorted(Path(directory).glob("*.msgpack"))
    if not paths:
        raise ToolError(f"no *.msgpack scene files in {directory}")
    return len(paths), (_lazy_scene(p) for p in paths)


def _read_path_or_uri(ref: str, base: Path) -> bytes:
    if ref.startswith("file://"):
        return Path(unquote(urlparse(ref).path)).read_bytes()
    p = Path(ref)
    return (p if p.is_absolute() else base / p).read_bytes()


def _row_tasks(row: dict) -> list[str] | None:
    t = row.get("task") or row.get("tasks")
    if t is None:
        return None
    tasks = [t] if isinstance(t, str) else list(t)
    for x in tasks:
        if x not in S.TASKS:
            raise ToolError(f"manifest row {row.get('scene_id') or row.get('scene_path')}: unknown task {x!r}")
    return tasks


def _manifest_item(row: dict, base: Path, lineno: int) -> SceneItem:
    common = dict(tasks=_row_tasks(row), nav_text=row.get("nav_text"),
                  labels={str(k): str(v) for k, v in (row.get("labels") or {}).items()})
    q = row.get("question")
    if row.get("scene_path"):
        p = Path(row["scene_path"])
        item = _lazy_scene(p if p.is_absolute() else base / p, scene_id=row.get("scene_id"), **common)
        if q is not None:
            item.vqa_question = item.grounding_question = q
        return item
    if not row.get("scene_id") or not row.get("images"):
        raise ToolError(f"manifest line {lineno}: a row needs scene_path, or scene_id and images")
    imgs = list(row["images"])
    vqa = list(row.get("vqa_images") or []) or None
    cams = row.get("camera_order")
    return SceneItem(
        scene_id=str(row["scene_id"]),
        camera_order=list(cams) if cams else None,
        num_frames=int(row.get("num_frames_per_camera") or 4),
        load_images=lambda: [_read_path_or_uri(x, base) for x in imgs],
        ego_history_xyz=row.get("ego_history_xyz"), ego_history_rot=row.get("ego_history_rot"),
        ego_history_quat=row.get("ego_history_quat"), ego_future_xyz=row.get("ego_future_xyz"),
        ego_future_rot=row.get("ego_future_rot"), ego_future_quat=row.get("ego_future_quat"),
        vqa_camera_order=list(row["vqa_camera_order"]) if row.get("vqa_camera_order") else None,
        load_vqa_images=(lambda: [_read_path_or_uri(x, base) for x in vqa]) if vqa else None,
        vqa_question=q, grounding_question=q, **common)


def _manifest_rows(path: Path) -> list[dict]:
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq  # heavy optional dependency: only Parquet manifests need it

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ToolError(f"{path}:{i}: not JSON: {exc}") from None
    return rows


def iter_manifest(path: str | os.PathLike) -> tuple[int, Iterator[SceneItem]]:
    """(count, items) of a JSONL/Parquet manifest (see the module docstring for the row format)."""
    path = Path(path)
    rows = _manifest_rows(path)
    if not rows:
        raise ToolError(f"manifest {path} has no rows")
    return len(rows), (_manifest_item(r, path.parent, i) for i, r in enumerate(rows, 1))


def manifest_tasks(path: str | os.PathLike) -> list[list[str] | None]:
    """Each manifest row's own tasks (None: the run's --tasks), to count the requests of a run."""
    return [_row_tasks(r) for r in _manifest_rows(Path(path))]


def iter_synthetic(n: int, seed: int = 0, image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE,
                   image_format: str = "png") -> tuple[int, Iterator[SceneItem]]:
    """(n, items) of synthetic scenes seed .. seed+n-1, generated lazily."""
    return n, (scene_item(generate_scene(seed + i, image_size, image_format=image_format)) for i in range(n))
