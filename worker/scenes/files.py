"""Scene files: msgpack encoding and atomic ``scene-<scene_id>.msgpack`` files."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from worker.scenes.generate import iter_scenes
from worker.scenes.structs import DEFAULT_IMAGE_SIZE, Scene


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
                 image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE, **kwargs) -> list[Path]:  # fmt: skip
    """Write scene-<scene_id>.msgpack files for seeds seed0 .. seed0+n-1; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        write_scene(sc, out / f"scene-{sc.scene_id}.msgpack")
        for sc in iter_scenes(n, seed0, image_size, **kwargs)
    ]
