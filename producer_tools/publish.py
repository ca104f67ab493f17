"""``alpamayo-producer publish``: scenes -> InferRequests -> the request topic.

Sources (exactly one; ``producer_tools.scene_sources`` has the manifest row format):

* ``--scenes-dir DIR``: ``*.msgpack`` scene files (``worker.scenes.write_scenes``).
* ``--manifest FILE``: JSONL (one object per line) or Parquet rows, scene files or raw scenes.
* ``--synthetic N --seed S``: synthetic scenes ``S .. S+N-1`` (``worker.scenes``).

Requests: one per (scene, task) for ``--mix all`` (default) or one per scene with the tasks taken
in turn for ``--mix round-robin``; ``num_traj_samples = --k``. Request ids are stable:
``f"{run_id}:{scene_id}:{task}:k{K}"``; every request carries ``run_id`` and the label
``scene_id``. Each request is built by ``worker.scenes.request.build_request``.

Claim check (``producer_tools.claim_check``): when a request's message would exceed
``--claim-check-threshold`` (default 900 KiB), its largest images are written to the object store
(``--object-store file:///root``) and replaced by ``ImageRef`` s until the message fits; only then
is the message sent. The worker must allow the store's prefix (``ALPAMAYO_CLAIM_CHECK_ROOTS``).

Delivery: an idempotent producer (``acks=all``, ``enable_idempotence``). Every acknowledged
request is appended to the local run manifest ``<runs-dir>/<run_id>.jsonl``
(``producer_tools.run_manifest``) with its partition and offset. Re-running with the same
``--run-id`` skips every request id the manifest holds; a request acknowledged by the broker but
not yet recorded when the process died is sent again with the same request id, and the worker and
the lake (``audit``) identify it by that id.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable, Iterator, Sequence

import msgspec
from aiokafka import AIOKafkaProducer
from tqdm import tqdm

import schemas as S
from producer_tools.claim_check import DEFAULT_CLAIM_CHECK_THRESHOLD, ObjectStore, encode_with_claim_check
from producer_tools.common import KafkaOptions, ToolError, client_kwargs, new_run_id
from producer_tools.run_manifest import RunManifest
from worker.scenes.request import SceneInputError, SceneItem, build_request

__all__ = [
    "PublishOptions",
    "request_id_for",
    "plan_requests",
    "planned_total",
    "run_request",
    "publish",
]

_ID_RE = re.compile(S.ID_PATTERN)


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


def planned_total(scene_tasks: Iterable[list[str] | None], tasks: Sequence[str], mix: str = "all") -> int:
    """How many requests a run plans: :func:`plan_requests` over each scene's own tasks (None:
    the run's)."""
    return sum(1 for _ in plan_requests((SimpleNamespace(tasks=t) for t in scene_tasks), tasks, mix))


def run_request(item: SceneItem, task: str, k: int, run_id: str, *, temperature: float | None = None,
                top_p: float | None = None, seed: int | None = None, max_tokens: int | None = None,
                labels: dict[str, str] | None = None, submitted_at: float | None = None,
                ground_truth: bool = False) -> S.InferRequest:
    """The request of a publish run for one scene and task: ``build_request`` with the run's stable
    request id, ``run_id``, ``submitted_at`` (now by default) and the label ``scene_id``;
    ``ground_truth``: the scene's future egomotion too, on requests with ego history (the lake's
    requests table then holds it for ADE; the worker reads it for auto_labeling only)."""
    try:
        req = build_request(
            item, task, k, request_id=request_id_for(run_id, item.scene_id, task, k), run_id=run_id,
            submitted_at=time.time() if submitted_at is None else submitted_at,
            labels={"scene_id": item.scene_id, **item.labels, **(labels or {})}, temperature=temperature,
            top_p=top_p, seed=seed, max_tokens=max_tokens)
    except SceneInputError as exc:
        raise ToolError(str(exc)) from None
    if ground_truth and req.egomotion is not None and req.future_egomotion is None and item.ego_future_xyz is not None:
        req = msgspec.structs.replace(req, future_egomotion=S.FutureEgomotion(
            ego_future_xyz=item.ego_future_xyz, ego_future_rot=item.ego_future_rot,
            ego_future_quat=item.ego_future_quat))
    return req


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
    ground_truth: bool = False          # the scene's future egomotion on every request with ego history
    claim_check_threshold: int = DEFAULT_CLAIM_CHECK_THRESHOLD
    object_store: str | None = None
    content_type: str = S.CONTENT_TYPE_MSGPACK
    rate: float | None = None           # requests per second
    max_inflight: int = 64
    compression: str | None = None
    limit: int | None = None            # publish at most this many (new) requests
    progress: bool = True
    source: str = ""                    # description for the manifest header
    planned: int | None = None          # requests the run plans (default: scenes x tasks)
    resume_command: str | None = None   # the command that resumes the run (audit shows it)


async def publish(kafka: KafkaOptions, items: Iterable[SceneItem], opts: PublishOptions,
                  total_scenes: int | None = None) -> dict[str, Any]:
    """Publish a run; returns a summary (run_id, manifest, published, skipped, ...)."""
    run_id = opts.run_id or new_run_id()
    if not _ID_RE.match(run_id):
        raise ToolError(f"run id {run_id!r} is not 1..128 characters of [A-Za-z0-9._:-]")
    for t in opts.tasks:
        if t not in S.TASKS:
            raise ToolError(f"unknown task {t!r}: use one of {', '.join(S.TASKS)}")
    manifest = RunManifest.for_run(opts.runs_dir, run_id)
    resumed = manifest.exists
    made = manifest.header or {}
    if resumed and "k" in made and (made["k"], made.get("tasks")) != (opts.k, list(opts.tasks)):
        raise ToolError(f"run {run_id} was created with --tasks {','.join(made.get('tasks') or [])} --k {made['k']}, "
                        f"not --tasks {','.join(opts.tasks)} --k {opts.k}: resume it with the same --tasks and --k, "
                        "or publish these requests under a new --run-id")
    done = manifest.published_ids()
    store = ObjectStore(opts.object_store) if opts.object_store else None
    total = opts.planned
    if total is None and total_scenes is not None:
        total = planned_total([None] * total_scenes, opts.tasks, opts.mix)
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
                   "k": opts.k, "source": opts.source}, planned=total, resume_command=opts.resume_command)
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
            req = run_request(item, task, opts.k, run_id, temperature=opts.temperature, top_p=opts.top_p,
                              seed=opts.sampling_seed, max_tokens=opts.max_tokens, labels=opts.labels,
                              ground_truth=opts.ground_truth)
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
