"""producer_tools.scene_sources: scene manifests (JSON lines and Parquet) of scene files and raw scenes."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

import schemas as S
from producer_tools import publish as P
from producer_tools.scene_sources import iter_manifest
from worker.scenes import write_scene


def test_manifest_sources(tmp_path, scene):
    write_scene(scene, tmp_path / "a.msgpack")
    imgs = []
    for i, b in enumerate(scene.images):
        (tmp_path / f"img{i}.png").write_bytes(b)
        imgs.append(f"img{i}.png" if i % 2 else (tmp_path / f"img{i}.png").as_uri())
    rows = [{"scene_path": "a.msgpack", "task": ["trajectory", "vqa"]},
            {"scene_id": "raw-1", "images": imgs, "camera_order": scene.camera_order,
             "ego_history_xyz": scene.ego_history_xyz, "ego_history_rot": scene.ego_history_rot,
             "labels": {"city": "x"}, "task": "trajectory"}]
    man = tmp_path / "m.jsonl"
    man.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    n, items = iter_manifest(man)
    pairs = list(P.plan_requests(items, ["grounding"]))
    assert n == 2 and [t for _, t in pairs] == ["trajectory", "vqa", "trajectory"]
    raw = P.run_request(pairs[2][0], "trajectory", 1, "r")
    S.validate_request(raw)
    assert raw.images == scene.images and raw.labels == {"scene_id": "raw-1", "city": "x"}
    pq.write_table(pa.Table.from_pylist([{"scene_path": str(tmp_path / "a.msgpack")}]), tmp_path / "m.parquet")
    n, items = iter_manifest(tmp_path / "m.parquet")
    assert n == 1 and next(items).scene_id == scene.scene_id
