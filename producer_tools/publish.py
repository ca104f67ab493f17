"""``alpamayo-producer publish``: scenes -> InferRequests -> the request topic.

Sources (exactly one):

* ``--scenes-dir DIR``: ``*.msgpack`` scene files (``worker.scenes.write_scenes``).
* ``--manifest FILE``: JSONL (one object per line) or Parquet rows. A row is either
  ``{"scene_path": "scene-x.msgpack"}`` (relative to the manifest's directory) or a raw scene:
  ``scene_id``, ``images`` (camera-major image file paths or ``file://`` URIs), ``camera_order``,
  optional ``num_frames_per_camera``, ``vqa_images``/``vqa_camera_order``, ``ego_history_xyz`` with
  ``ego_history_rot`` or ``ego_history_quat``, ``ego_future_xyz`` with ``ego_future_rot`` or
  ``ego_future_quat``. Any row may add ``task`` (a task or a list of tasks, overriding
  ``--tasks``), ``question``, ``nav_text`` and ``labels``.
* ``--synthetic N --seed S``: synthetic scenes ``S .. S+N-1`` (``worker.scenes``).

Requests: one per (scene, task) for ``--mix all`` (default) or one per scene with the tasks taken
in turn for ``--mix round-robin``; ``num_traj_samples = --k``. Request ids are stable:
``f"{run_id}:{scene_id}:{task}:k{K}"``; every request carries ``run_id`` and the label
``scene_id``.

Claim check: when a request's message (value + key + headers) would exceed
``--claim-check-threshold`` (default 900 KiB), its largest images are written to the object store
(``--object-store file:///root``; content-addressed ``sha256/<aa>/<sha256>.<ext>``, written to a
temp file, fsynced and renamed) and replaced by ``ImageRef(uri, sha256, size, content_type)``
until the message fits; only then is the message sent. The worker must allow the store's prefix
(``ALPAMAYO_CLAIM_CHECK_ROOTS``).

Delivery: an idempotent producer (``acks=all``, ``enable_idempotence``). Every acknowledged
request is appended to the local run manifest ``<runs-dir>/<run_id>.jsonl`` with its partition
and offset. Re-running with the same ``--run-id`` skips every request id the manifest holds; a
request acknowledged by the broker but not yet recorded when the process died is sent again with
the same request id, and the worker and the lake (``audit``) identify it by that id.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence
from urllib.parse import unquote, urlparse

import msgspec

import schemas as S
from producer_tools.common import (KafkaOptions, ToolError, atomic_write_bytes, client_kwargs, fsync_dir,
                                   new_run_id)

__all__ = [
    "DEFAULT_CLAIM_CHECK_THRESHOLD",
    "SceneItem",
    "ObjectStore",
    "RunManifest",
    "PublishOptions",
    "request_id_for",
    "scene_item",
    "iter_scene_dir",
    "iter_manifest",
    "iter_synthetic",
    "plan_requests",
    "build_request",
    "encode_with_claim_check",
    "resolve_images",
    "publish",
]

DEFAULT_CLAIM_CHECK_THRESHOLD = 900 * 1024
_ID_RE = re.compile(S.ID_PATTERN)
_EXT = {"image/jpeg": ".jpg", "image/png": ".png", "image/webp": ".webp", "image/bmp": ".bmp"}


# --------------------------------------------------------------------------------------------
# scenes
# --------------------------------------------------------------------------------------------


@dataclass
class SceneItem:
    """One scene ready to become requests. Images are loaded lazily (``load_images``)."""

    scene_id: str
    camera_order: list[str] | None
    num_frames: int
    load_images: Callable[[], list[bytes]]
    ego_history_xyz: list | None = None
    ego_history_rot: list | None = None
    ego_history_quat: list | None = None
    ego_future_xyz: list | None = None
    ego_future_rot: list | None = None
    ego_future_quat: list | None = None
    vqa_camera_order: list[str] | None = None
    load_vqa_images: Callable[[], list[bytes]] | None = None
    vqa_question: str | None = None
    grounding_question: str | None = None
    nav_text: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    tasks: list[str] | None = None


def scene_item(scene, **overrides) -> SceneItem:
    """A synthetic ``worker.scenes.Scene`` as a SceneItem."""
    item = SceneItem(
        scene_id=scene.scene_id,
        camera_order=list(scene.camera_order),
        num_frames=len(scene.frame_offsets_s),
        load_images=lambda: list(scene.images),
        ego_history_xyz=scene.ego_history_xyz,
        ego_history_rot=scene.ego_history_rot,
        ego_future_xyz=scene.ego_future_xyz,
        ego_future_rot=scene.ego_future_rot,
        vqa_camera_order=list(scene.vqa_camera_order),
        load_vqa_images=lambda: list(scene.vqa_images),
        vqa_question=scene.text.vqa_question,
        grounding_question=scene.text.grounding_question,
    )
    for k, v in overrides.items():
        if v is not None:
            setattr(item, k, v)
    return item


def _lazy_scene(path: Path, **overrides) -> SceneItem:
    """Scene file -> SceneItem; the file is read now (ids and egomotion) but dropped afterwards
    only if the caller drops the item."""
    from worker.scenes import read_scene

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
        import pyarrow.parquet as pq

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


def iter_synthetic(n: int, seed: int = 0, image_size: tuple[int, int] = (64, 64),
                   image_format: str = "png") -> tuple[int, Iterator[SceneItem]]:
    """(n, items) of synthetic scenes seed .. seed+n-1, generated lazily."""
    from worker.scenes import generate_scene

    return n, (scene_item(generate_scene(seed + i, image_size, image_format=image_format)) for i in range(n))


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


def request_id_for(run_id: str, scene_id: str, task: str, k: int) -> str:
    """The stable request id ``f"{run_id}:{scene_id}:{task}:k{K}"`` (checked against the contract)."""
    rid = f"{run_id}:{scene_id}:{task}:k{k}"
    if not _ID_RE.match(rid):
        raise ToolError(f"request id {rid!r} is not 1..128 characters of [A-Za-z0-9._:-]: "
                        "use shorter/plainer run and scene ids")
    return rid


def plan_requests(items: Iterable[SceneItem], tasks: Sequence[str], mix: str = "all") -> Iterator[tuple[SceneItem, str]]:
    """(scene, task) pairs: every task per scene (``all``) or tasks in turn (``round-robin``)."""
    for i, item in enumerate(items):
        t = item.tasks or list(tasks)
        if mix == "round-robin" and not item.tasks:
            yield item, t[i % len(t)]
        else:
            for task in t:
                yield item, task


def build_request(item: SceneItem, task: str, k: int, run_id: str, *, temperature: float | None = None,
                  top_p: float | None = None, seed: int | None = None, max_tokens: int | None = None,
                  labels: dict[str, str] | None = None, submitted_at: float | None = None) -> S.InferRequest:
    """The InferRequest for one scene and task, all images inline."""
    if task not in S.TASKS:
        raise ToolError(f"unknown task {task!r}: use one of {', '.join(S.TASKS)}")
    vqa = task == "vqa"
    if vqa and item.load_vqa_images is not None:
        images, cams = item.load_vqa_images(), item.vqa_camera_order
    else:
        images, cams = item.load_images(), item.camera_order
    ego = fut = None
    if task in S.TASKS_NEEDING_EGOMOTION:
        if item.ego_history_xyz is None:
            raise ToolError(f"scene {item.scene_id}: task {task} needs ego history")
        ego = S.Egomotion(ego_history_xyz=item.ego_history_xyz, ego_history_rot=item.ego_history_rot,
                          ego_history_quat=item.ego_history_quat)
    if task == "auto_labeling":
        if item.ego_future_xyz is None:
            raise ToolError(f"scene {item.scene_id}: task auto_labeling needs the ego future")
        fut = S.FutureEgomotion(ego_future_xyz=item.ego_future_xyz, ego_future_rot=item.ego_future_rot,
                                ego_future_quat=item.ego_future_quat)
    question = None
    if task == "vqa":
        question = item.vqa_question
    elif task == "grounding":
        question = item.grounding_question
    if task in S.TASKS_NEEDING_QUESTION and not question:
        raise ToolError(f"scene {item.scene_id}: task {task} needs a question (manifest 'question')")
    lab = {"scene_id": item.scene_id, **item.labels, **(labels or {})}
    kw: dict[str, Any] = {}
    if temperature is not None:
        kw["temperature"] = temperature
    elif k == 1:
        kw["temperature"] = 0.0
    if top_p is not None:
        kw["top_p"] = top_p
    return S.InferRequest(
        request_id=request_id_for(run_id, item.scene_id, task, k), run_id=run_id,
        submitted_at=time.time() if submitted_at is None else submitted_at, labels=lab, task=task,
        images=images, camera_order=cams, num_frames_per_camera=item.num_frames, egomotion=ego,
        future_egomotion=fut, num_traj_samples=k, seed=seed,
        max_tokens=max_tokens if task != "trajectory" else None, nav_text=item.nav_text, question=question,
        **kw)


# --------------------------------------------------------------------------------------------
# claim check
# --------------------------------------------------------------------------------------------


class ObjectStore:
    """A ``file://`` object store: content-addressed, atomic, idempotent."""

    def __init__(self, root: str | os.PathLike):
        r = str(root)
        if r.startswith("file://"):
            r = unquote(urlparse(r).path)
        elif "://" in r:
            raise ToolError(f"object store {root!r}: only file:// roots are supported by this tool")
        self.root = Path(r).resolve()

    def put(self, data: bytes, content_type: str | None = None) -> S.ImageRef:
        """Store ``data`` (durably, before returning) and return its ImageRef."""
        digest = hashlib.sha256(data).hexdigest()
        ct = content_type or S.sniff_image_format(data)
        path = self.root / "sha256" / digest[:2] / f"{digest}{_EXT.get(ct or '', '.bin')}"
        try:
            present = path.stat().st_size == len(data)
        except FileNotFoundError:
            present = False
        if not present:
            atomic_write_bytes(path, data)
        return S.ImageRef(uri=path.as_uri(), sha256=digest, size=len(data), content_type=ct)

    @staticmethod
    def get(ref: S.ImageRef) -> bytes:
        """Fetch and verify a ``file://`` reference (ContractError ``claim_check_failed`` otherwise)."""
        if not ref.uri.startswith("file://"):
            raise ToolError(f"cannot fetch {ref.uri}: only file:// URIs")
        try:
            data = Path(unquote(urlparse(ref.uri).path)).read_bytes()
        except OSError as exc:
            raise S.ContractError(S.ErrorCode.CLAIM_CHECK_FAILED, "$.images", f"{ref.uri}: {exc}") from None
        S.verify_claim_check(ref, data)
        return data


def _bin_len(n: int) -> int:
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


_REF_ENC = msgspec.msgpack.Encoder()


def _message_size(value: bytes, key: bytes, headers: S.Headers) -> int:
    return len(value) + len(key) + sum(len(k) + len(v) for k, v in headers)


def encode_with_claim_check(req: S.InferRequest, threshold: int = DEFAULT_CLAIM_CHECK_THRESHOLD,
                            store: ObjectStore | None = None, content_type: str = S.CONTENT_TYPE_MSGPACK
                            ) -> tuple[bytes, S.Headers, S.InferRequest, int]:
    """(value, headers, request as sent, number of images moved to the store).

    Images move largest first until the message is at most ``threshold`` bytes; every moved
    image is durably stored before this returns (so before the message can be sent)."""
    value, headers = S.encode_request(req, content_type)
    key = S.request_key(req)
    size = _message_size(value, key, headers)
    if size <= threshold:
        return value, headers, req, 0
    if store is None:
        raise ToolError(f"request {req.request_id} is {size} bytes, above the claim-check threshold "
                        f"{threshold}: give --object-store file:///DIR")
    images: list = list(req.images)
    order = sorted((i for i, im in enumerate(images) if isinstance(im, bytes)), key=lambda i: -len(images[i]))
    moved = 0
    est = size
    idx = 0
    while True:
        while est > threshold and idx < len(order):
            i = order[idx]
            idx += 1
            ref = store.put(images[i])
            est -= _bin_len(len(images[i])) - len(_REF_ENC.encode(ref))
            images[i] = ref
            moved += 1
        new = msgspec.structs.replace(req, images=images)
        value, headers = S.encode_request(new, content_type)
        size = _message_size(value, key, headers)
        if size <= threshold:
            return value, headers, new, moved
        if idx >= len(order):
            raise ToolError(f"request {req.request_id} is {size} bytes with every image in the object store, "
                            f"still above the threshold {threshold}")
        est = size


def resolve_images(req: S.InferRequest) -> list[bytes]:
    """The request's image bytes, fetching (and verifying) claim-check references."""
    return [im if isinstance(im, bytes) else ObjectStore.get(im) for im in req.images]


# --------------------------------------------------------------------------------------------
# run manifest
# --------------------------------------------------------------------------------------------


class RunManifest:
    """``<runs-dir>/<run_id>.jsonl``: a header line, then one line per acknowledged request.

    Lines: ``{"kind": "run", ...}`` (first), ``{"kind": "session", ...}`` (each publish
    invocation), ``{"kind": "published", "request_id", "scene_id", "task", "k", "topic",
    "partition", "offset", "bytes", "image_refs", "ts"}``. A torn last line (crash mid-write)
    is ignored on reading.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header: dict | None = None
        self.records: list[dict] = []
        self._f = None
        self._last_sync = 0.0
        if self.path.exists():
            self._load()

    @classmethod
    def for_run(cls, runs_dir: str | os.PathLike, run_id: str) -> "RunManifest":
        return cls(Path(runs_dir) / f"{run_id}.jsonl")

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue  # torn line
                kind = obj.get("kind")
                if kind == "run" and self.header is None:
                    self.header = obj
                elif kind == "published":
                    self.records.append(obj)

    @property
    def exists(self) -> bool:
        return self.header is not None

    @property
    def run_id(self) -> str | None:
        return self.header.get("run_id") if self.header else None

    def published_ids(self) -> set[str]:
        return {r["request_id"] for r in self.records}

    def open(self, header: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        if not new and self.header is None:
            raise ToolError(f"{self.path} exists but has no run header: not a run manifest")
        if not new:
            # a torn last line must not glue onto the next record
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                if f.tell() > 0:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        with open(self.path, "ab") as g:
                            g.write(b"\n")
        self._f = open(self.path, "a", encoding="utf-8")
        if new:
            self.header = {"kind": "run", **header}
            self._write(self.header)
            self.sync()
            fsync_dir(self.path.parent)
        self._write({"kind": "session", "started_at": time.time(), "pid": os.getpid(), "resumed": not new,
                     "already_published": len(self.records)})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def append(self, record: dict) -> None:
        rec = {"kind": "published", **record}
        self.records.append(rec)
        self._write(rec)
        now = time.monotonic()
        if now - self._last_sync > 1.0:
            self.sync()

    def sync(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None


# --------------------------------------------------------------------------------------------
# publishing
# --------------------------------------------------------------------------------------------


@dataclass
class PublishOptions:
    tasks: Sequence[str] = ("trajectory",)
    mix: str = "all"
    k: int = 1
    run_id: str | None = None
    runs_dir: str = "runs"
    temperature: float | None = None
    top_p: float | None = None
    sampling_seed: int | None = None
    max_tokens: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    claim_check_threshold: int = DEFAULT_CLAIM_CHECK_THRESHOLD
    object_store: str | None = None
    content_type: str = S.CONTENT_TYPE_MSGPACK
    rate: float | None = None           # requests per second
    max_inflight: int = 64
    compression: str | None = None
    limit: int | None = None            # publish at most this many (new) requests
    progress: bool = True
    source: str = ""                    # description for the manifest header


async def publish(kafka: KafkaOptions, items: Iterable[SceneItem], opts: PublishOptions,
                  total_scenes: int | None = None) -> dict[str, Any]:
    """Publish a run; returns a summary (run_id, manifest, published, skipped, ...)."""
    from aiokafka import AIOKafkaProducer
    from tqdm import tqdm

    run_id = opts.run_id or new_run_id()
    if not _ID_RE.match(run_id):
        raise ToolError(f"run id {run_id!r} is not 1..128 characters of [A-Za-z0-9._:-]")
    for t in opts.tasks:
        if t not in S.TASKS:
            raise ToolError(f"unknown task {t!r}: use one of {', '.join(S.TASKS)}")
    manifest = RunManifest.for_run(opts.runs_dir, run_id)
    resumed = manifest.exists
    done = manifest.published_ids()
    store = ObjectStore(opts.object_store) if opts.object_store else None
    total = None
    if total_scenes is not None:
        total = total_scenes if opts.mix == "round-robin" else total_scenes * len(opts.tasks)
    producer = AIOKafkaProducer(
        **client_kwargs(kafka), acks="all", enable_idempotence=True, linger_ms=5,
        max_request_size=max(1 << 20, opts.claim_check_threshold + (64 << 10)),
        compression_type=opts.compression)
    summary = {"run_id": run_id, "manifest": str(manifest.path), "resumed": resumed, "published": 0,
               "skipped": 0, "claim_checked": 0, "image_refs": 0, "bytes": 0, "topic": kafka.request_topic}

    pending: set[asyncio.Future] = set()
    failure: list[BaseException] = []

    async def track(fut, rid: str, item: SceneItem, task: str, nbytes: int, nrefs: int) -> None:
        try:
            md = await fut
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            failure.append(exc)
            return
        manifest.append({"request_id": rid, "scene_id": item.scene_id, "task": task, "k": opts.k,
                         "topic": md.topic, "partition": md.partition, "offset": md.offset, "bytes": nbytes,
                         "image_refs": nrefs, "ts": time.time()})
        summary["published"] += 1
        summary["bytes"] += nbytes
        bar.update(1)

    try:
        await producer.start()
    except BaseException:
        await producer.stop()
        raise
    manifest.open({"run_id": run_id, "created_at": time.time(), "request_topic": kafka.request_topic,
                   "bootstrap_servers": kafka.bootstrap_servers, "tasks": list(opts.tasks), "mix": opts.mix,
                   "k": opts.k, "source": opts.source})
    t_start = time.monotonic()
    bar = tqdm(total=total, unit="req", desc=f"publish {run_id}", disable=not opts.progress, file=sys.stderr)
    sent = 0
    try:
        for item, task in plan_requests(items, opts.tasks, opts.mix):
            if failure:
                break
            rid = request_id_for(run_id, item.scene_id, task, opts.k)
            if rid in done:
                summary["skipped"] += 1
                bar.update(1)
                continue
            if opts.limit is not None and sent >= opts.limit:
                break
            if opts.rate:
                delay = t_start + sent / opts.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            req = build_request(item, task, opts.k, run_id, temperature=opts.temperature, top_p=opts.top_p,
                                seed=opts.sampling_seed, max_tokens=opts.max_tokens, labels=opts.labels)
            try:
                S.validate_request(req)
            except S.ContractError as err:
                raise ToolError(f"scene {item.scene_id} task {task}: invalid request: {err}") from None
            value, headers, _sent_req, nrefs = encode_with_claim_check(
                req, opts.claim_check_threshold, store, opts.content_type)
            if nrefs:
                summary["claim_checked"] += 1
                summary["image_refs"] += nrefs
            fut = await producer.send(kafka.request_topic, value, key=S.request_key(rid), headers=headers)
            done.add(rid)
            sent += 1
            pending.add(asyncio.ensure_future(track(fut, rid, item, task, len(value), nrefs)))
            if len(pending) >= opts.max_inflight:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            await asyncio.gather(*pending)
        await producer.flush()
    finally:
        try:
            await producer.stop()
        finally:
            manifest.close()
            bar.close()
    if failure:
        raise ToolError(f"sending failed after {summary['published']} acknowledged requests: "
                        f"{type(failure[0]).__name__}: {failure[0]} (resume with --run-id {run_id})")
    summary["elapsed_s"] = round(time.monotonic() - t_start, 3)
    return summary
