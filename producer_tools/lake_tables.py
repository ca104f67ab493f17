"""What the lake's tables hold: one fixed Arrow schema and one row builder per table, the one place
where a column is added (to the schema and to its table's row builder).

| table | from | rows |
|---|---|---|
| ``results`` | the results topic | one per result record |
| ``dead_letters`` | the dead-letter topic | one per dead-letter record |
| ``samples`` (``sink --samples``) | the results topic | one per sample (K per result) |
| ``requests`` (``sink --requests``) | the request topic | one per request record, images left out; ego history and ground truth as columns, so ADE is a join |

Every table has ``run_id`` as a column (also the Hive directory) and the record's Kafka
coordinates. A row builder turns one Kafka record into a list of rows (undecodable values give
one row with ``decode_error``; none for ``samples``). Where the files go: ``producer_tools.lake``.
"""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import schemas as S

__all__ = ["RESULT_SCHEMA", "DEAD_LETTER_SCHEMA", "SAMPLE_SCHEMA", "REQUEST_SCHEMA", "TABLES", "ROW_BUILDERS",
           "result_rows", "dead_letter_rows", "sample_rows", "request_rows", "rows_to_table", "table_bytes"]

_F32 = pa.float32()
_STR = pa.string()
_TS_UTC = pa.timestamp("us", tz="UTC")
_XYZ = pa.list_(pa.list_(_F32, 3))                      # N x [x, y, z] metres
_META_ACTION = pa.struct([("longitudinal", _STR), ("lateral", _STR), ("lane", _STR)])

# the result's uncertainty block flattened into columns: uncertainty, uncertainty_trajectory_spread_m, ...
_UNCERTAINTY_COLUMNS = {f: f if f == "uncertainty" else f"uncertainty_{f}" for f in S.Uncertainty.__struct_fields__}

_LINEAGE_FIELDS = [
    pa.field("kafka_topic", _STR, nullable=False),
    pa.field("kafka_partition", pa.int32(), nullable=False),
    pa.field("kafka_offset", pa.int64(), nullable=False),
    pa.field("kafka_timestamp", pa.timestamp("ms", tz="UTC")),
    pa.field("decode_error", _STR),
]

RESULT_SCHEMA = pa.schema([
    pa.field("request_id", _STR),
    pa.field("run_id", _STR),
    pa.field("scene_id", _STR),                                                  # labels["scene_id"]
    pa.field("submitted_at", _TS_UTC),                                           # the request's
    pa.field("task", _STR),
    pa.field("schema_version", pa.int16()),
    pa.field("num_samples", pa.int32()),
    pa.field("labels", pa.map_(_STR, _STR)),
    pa.field("pred_trajectories", pa.list_(pa.list_(pa.list_(_F32, 3), 64))),   # K x 64 x [x, y, z]
    pa.field("pred_rotations", pa.list_(pa.list_(pa.list_(_F32, 9), 64))),      # K x 64 x row-major 3x3
    pa.field("answer", _STR),
    pa.field("output_texts", pa.list_(_STR)),
    pa.field("cots", pa.list_(_STR)),
    pa.field("meta_actions", pa.list_(_META_ACTION)),
    pa.field("auto_labels", pa.list_(pa.struct([
        ("critical_components_analysis", _STR), ("ego_vehicle_motion_analysis", _STR),
        ("trajectory_analysis", _STR), ("chain_of_causation", _STR)]))),
    pa.field("boxes", pa.list_(pa.list_(pa.struct([("bbox_2d", pa.list_(pa.float64())), ("label", _STR)])))),
    pa.field("reasoning_texts", pa.list_(_STR)),
    pa.field("generated_tokens", pa.list_(pa.int32())),
    pa.field("spec_num_spec_tokens", pa.int32()),
    pa.field("spec_num_spec_steps", pa.int64()),
    pa.field("spec_num_draft_tokens", pa.int64()),
    pa.field("spec_num_accepted_draft_tokens", pa.int64()),
    pa.field("spec_draft_acceptance_rate", pa.float64()),
    pa.field("spec_mean_acceptance_length", pa.float64()),
    pa.field("spec_acceptance_histogram", pa.list_(pa.int64())),
    pa.field("spec_per_step_accepted", pa.list_(pa.int32())),
    pa.field("spec_per_step_drafted", pa.list_(pa.int32())),
    pa.field("queue_ms", pa.float64()),
    pa.field("image_prep_ms", pa.float64()),
    pa.field("prefill_ms", pa.float64()),
    pa.field("decode_ms", pa.float64()),
    pa.field("diffusion_ms", pa.float64()),
    pa.field("total_ms", pa.float64()),
    pa.field("warnings", pa.list_(_STR)),
    pa.field("model_id", _STR),
    pa.field("model_profile", _STR),
    pa.field("model_precision", _STR),
    pa.field("model_checkpoint_hash", _STR),
    pa.field("model_speculative_decoding", _STR),
    pa.field("model_speculative_model", _STR),
    pa.field("request_topic", _STR),
    pa.field("request_partition", pa.int32()),
    pa.field("request_offset", pa.int64()),
    pa.field("worker_id", _STR),
    pa.field("attempt", pa.int32()),
    pa.field("replay_of", _STR),
    pa.field("completed_at", _TS_UTC),
    *[pa.field(column, pa.float64()) for column in _UNCERTAINTY_COLUMNS.values()],
    *_LINEAGE_FIELDS,
])
"""Results table: one row per result record (the ``uncertainty`` block flattened: ``uncertainty``,
``uncertainty_trajectory_spread_m``, ...; null for K = 1)."""

DEAD_LETTER_SCHEMA = pa.schema([
    pa.field("request_id", _STR),
    pa.field("run_id", _STR),
    pa.field("schema_version", pa.int16()),
    pa.field("error_code", _STR),
    pa.field("error_field", _STR),
    pa.field("error_message", _STR),
    pa.field("retryable", pa.bool_()),
    pa.field("original_value", pa.large_binary()),
    pa.field("original_value_truncated", pa.bool_()),
    pa.field("original_size", pa.int64()),
    pa.field("original_key", pa.binary()),
    pa.field("original_headers", pa.list_(pa.struct([("key", _STR), ("value", pa.binary())]))),
    pa.field("source_topic", _STR),
    pa.field("source_partition", pa.int32()),
    pa.field("source_offset", pa.int64()),
    pa.field("attempt", pa.int32()),
    pa.field("worker_id", _STR),
    pa.field("failed_at", _TS_UTC),
    pa.field("kafka_key", pa.binary()),
    *_LINEAGE_FIELDS,
])
"""Dead-letter table: error code/field/message and the original bytes (for ``dlq replay``)."""

SAMPLE_SCHEMA = pa.schema([
    pa.field("request_id", _STR),
    pa.field("run_id", _STR),
    pa.field("scene_id", _STR),
    pa.field("task", _STR),
    pa.field("num_samples", pa.int32()),
    pa.field("sample", pa.int32()),                                              # 0..K-1
    pa.field("pred_xyz", pa.list_(pa.list_(_F32, 3), 64)),                       # 64 x [x, y, z]
    pa.field("text", _STR),
    pa.field("cot", _STR),
    pa.field("meta_action", _META_ACTION),
    pa.field("generated_tokens", pa.int32()),
    pa.field("model_profile", _STR),
    pa.field("completed_at", _TS_UTC),
    *_LINEAGE_FIELDS,
])
"""Samples table (``sink --samples``): one row per sample of a result."""

REQUEST_SCHEMA = pa.schema([
    pa.field("request_id", _STR),
    pa.field("run_id", _STR),
    pa.field("scene_id", _STR),
    pa.field("submitted_at", _TS_UTC),
    pa.field("task", _STR),
    pa.field("num_traj_samples", pa.int32()),
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("top_k", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("max_tokens", pa.int32()),
    pa.field("labels", pa.map_(_STR, _STR)),
    pa.field("num_images", pa.int32()),
    pa.field("image_refs", pa.int32()),
    pa.field("ego_history_xyz", _XYZ),                                           # 16 x [x, y, z], t0 last
    pa.field("ego_future_xyz", _XYZ),                                            # ground truth, 64 x [x, y, z]
    pa.field("question", _STR),
    pa.field("attempt", pa.int32()),
    pa.field("replay_of", _STR),
    *_LINEAGE_FIELDS,
])
"""Requests table (``sink --requests``): what was asked, without the images."""

TABLES = {"results": RESULT_SCHEMA, "dead_letters": DEAD_LETTER_SCHEMA, "samples": SAMPLE_SCHEMA,
          "requests": REQUEST_SCHEMA}


def _ts_ms(ts: int | None) -> dt.datetime | None:
    return None if ts is None or ts < 0 else dt.datetime.fromtimestamp(ts / 1000.0, dt.timezone.utc)


def _ts_s(secs: float | None) -> dt.datetime | None:
    if secs is None:
        return None
    try:
        return dt.datetime.fromtimestamp(float(secs), dt.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None


def _lineage(record) -> dict[str, Any]:
    return {"kafka_topic": record.topic, "kafka_partition": record.partition, "kafka_offset": record.offset,
            "kafka_timestamp": _ts_ms(record.timestamp), "decode_error": None}


def _shape_ok(arr, shape: tuple[int, ...]) -> bool:
    if not isinstance(arr, list):
        return False
    if len(shape) == 0:
        return True
    if shape[0] >= 0 and len(arr) != shape[0]:
        return False
    return all(_shape_ok(a, shape[1:]) if len(shape) > 1 else isinstance(a, (int, float)) for a in arr)


def _undecodable(record, err: S.ContractError) -> dict[str, Any]:
    headers = list(record.headers or ())
    key = record.key.decode("utf-8", "replace") if record.key else None
    return {**_lineage(record), "request_id": S.header_value(headers, S.HEADER_REQUEST_ID) or err.request_id or key,
            "run_id": S.header_value(headers, S.HEADER_RUN_ID) or err.run_id, "decode_error": str(err)[:2000]}


def _decoded_result(record) -> tuple[S.InferResult | None, dict[str, Any]]:
    """(the result or None, the columns every results/samples row of it shares)."""
    try:
        res = S.decode_result(record.value, list(record.headers or ()))
    except S.ContractError as err:
        return None, _undecodable(record, err)
    return res, {**_lineage(record), "request_id": res.request_id, "run_id": res.run_id,
                 "scene_id": res.labels.get("scene_id"), "task": res.task, "num_samples": res.num_samples,
                 "model_profile": res.model.profile, "completed_at": _ts_s(res.completed_at)}


def result_rows(record) -> list[dict[str, Any]]:
    """The ``results`` row of one result record (undecodable: a row with ``decode_error``)."""
    res, row = _decoded_result(record)
    if res is None:
        return [row]
    m = res.metrics
    t = m.timings
    sd = m.speculative_decoding
    traj = res.pred_trajectories
    rot = res.pred_rotations
    problems = []
    if traj is not None and not _shape_ok(traj, (-1, 64, 3)):
        problems.append("pred_trajectories is not K x 64 x 3")
        traj = None
    if rot is not None:
        if _shape_ok(rot, (-1, 64, 3, 3)):
            rot = [[[v for r3 in mat for v in r3] for mat in smp] for smp in rot]
        else:
            problems.append("pred_rotations is not K x 64 x 3 x 3")
            rot = None
    lin = res.lineage
    mdl = res.model
    row.update(
        schema_version=res.schema_version, labels=list(res.labels.items()), pred_trajectories=traj,
        pred_rotations=rot, answer=res.answer,
        output_texts=[o.text for o in res.outputs], cots=[o.cot for o in res.outputs],
        meta_actions=[_meta_action(o) for o in res.outputs],
        auto_labels=[None if o.auto_label is None else
                     {"critical_components_analysis": o.auto_label.critical_components_analysis,
                      "ego_vehicle_motion_analysis": o.auto_label.ego_vehicle_motion_analysis,
                      "trajectory_analysis": o.auto_label.trajectory_analysis,
                      "chain_of_causation": o.auto_label.chain_of_causation} for o in res.outputs],
        boxes=[None if o.boxes is None else [{"bbox_2d": list(b.bbox_2d), "label": b.label} for b in o.boxes]
               for o in res.outputs],
        reasoning_texts=list(m.reasoning_texts), generated_tokens=list(m.generated_tokens),
        queue_ms=t.queue_ms, image_prep_ms=t.image_prep_ms, prefill_ms=t.prefill_ms, decode_ms=t.decode_ms,
        diffusion_ms=t.diffusion_ms, total_ms=t.total_ms, warnings=list(res.warnings),
        model_id=mdl.id, model_precision=mdl.precision,
        model_checkpoint_hash=mdl.checkpoint_hash, model_speculative_decoding=mdl.speculative_decoding,
        model_speculative_model=mdl.speculative_model,
        request_topic=lin.topic if lin else None, request_partition=lin.partition if lin else None,
        request_offset=lin.offset if lin else None, worker_id=lin.worker_id if lin else None,
        attempt=lin.attempt if lin else None, replay_of=lin.replay_of if lin else None,
        submitted_at=_ts_s(res.submitted_at),
    )
    if res.uncertainty is not None:
        row.update({column: getattr(res.uncertainty, f) for f, column in _UNCERTAINTY_COLUMNS.items()})
    if sd is not None:
        row.update(spec_num_spec_tokens=sd.num_spec_tokens, spec_num_spec_steps=sd.num_spec_steps,
                   spec_num_draft_tokens=sd.num_draft_tokens,
                   spec_num_accepted_draft_tokens=sd.num_accepted_draft_tokens,
                   spec_draft_acceptance_rate=sd.draft_acceptance_rate,
                   spec_mean_acceptance_length=sd.mean_acceptance_length,
                   spec_acceptance_histogram=list(sd.acceptance_histogram),
                   spec_per_step_accepted=sd.per_step_accepted, spec_per_step_drafted=sd.per_step_drafted)
    if problems:
        row["decode_error"] = "; ".join(problems)
    return [row]


def _meta_action(o: S.SampleOutput) -> dict[str, Any] | None:
    ma = o.meta_action
    return None if ma is None else {"longitudinal": ma.longitudinal, "lateral": ma.lateral, "lane": ma.lane}


def sample_rows(record) -> list[dict[str, Any]]:
    """The ``samples`` rows of one result record: one per sample (none when undecodable)."""
    res, shared = _decoded_result(record)
    if res is None:
        return []
    traj = res.pred_trajectories if res.pred_trajectories is not None and \
        _shape_ok(res.pred_trajectories, (-1, 64, 3)) else None
    tokens = res.metrics.generated_tokens
    n = max(res.num_samples, len(res.outputs), len(traj or ()))
    return [{**shared, "sample": i, "pred_xyz": traj[i] if traj and i < len(traj) else None,
             "text": res.outputs[i].text if i < len(res.outputs) else None,
             "cot": res.outputs[i].cot if i < len(res.outputs) else None,
             "meta_action": _meta_action(res.outputs[i]) if i < len(res.outputs) else None,
             "generated_tokens": tokens[i] if i < len(tokens) else None} for i in range(n)]


def dead_letter_rows(record) -> list[dict[str, Any]]:
    """The ``dead_letters`` row of one dead-letter record."""
    headers = list(record.headers or ())
    try:
        d = S.decode_dead_letter(record.value, headers)
    except S.ContractError as err:
        return [{**_undecodable(record, err), "kafka_key": record.key,
                 "error_code": S.header_value(headers, S.HEADER_ERROR_CODE)}]
    return [{**_lineage(record), "kafka_key": record.key,
             "request_id": d.request_id, "run_id": d.run_id, "schema_version": d.schema_version,
             "error_code": d.error_code.value, "error_field": d.error_field, "error_message": d.error_message,
             "retryable": d.retryable, "original_value": d.original_value,
             "original_value_truncated": d.original_value_truncated, "original_size": d.original_size,
             "original_key": d.original_key,
             "original_headers": [{"key": k, "value": v} for k, v in d.original_headers],
             "source_topic": d.source.topic, "source_partition": d.source.partition,
             "source_offset": d.source.offset, "attempt": d.attempt, "worker_id": d.worker_id,
             "failed_at": _ts_s(d.failed_at)}]


def request_rows(record) -> list[dict[str, Any]]:
    """The ``requests`` row of one request record (images counted, not copied)."""
    headers = list(record.headers or ())
    try:
        req = S.decode_request(record.value, headers)
    except S.ContractError as err:
        return [_undecodable(record, err)]
    ego, fut = req.egomotion, req.future_egomotion
    attempt = S.header_value(headers, S.HEADER_ATTEMPT)
    return [{**_lineage(record), "request_id": req.request_id, "run_id": req.run_id,
             "scene_id": req.labels.get("scene_id"), "submitted_at": _ts_s(req.submitted_at), "task": req.task,
             "num_traj_samples": req.num_traj_samples, "temperature": req.temperature, "top_p": req.top_p,
             "top_k": req.top_k, "seed": req.seed, "max_tokens": req.max_tokens, "labels": list(req.labels.items()),
             "num_images": len(req.images), "image_refs": sum(isinstance(i, S.ImageRef) for i in req.images),
             "ego_history_xyz": [list(p) for p in ego.ego_history_xyz] if ego else None,
             "ego_future_xyz": [list(p) for p in fut.ego_future_xyz] if fut else None,
             "question": req.question, "attempt": int(attempt) if attempt and attempt.isdigit() else None,
             "replay_of": S.header_value(headers, S.HEADER_REPLAY_OF)}]


ROW_BUILDERS: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "results": result_rows, "dead_letters": dead_letter_rows, "samples": sample_rows, "requests": request_rows}


_CONVERT_CHUNK_ROWS = 64     # Arrow's conversion of Python rows holds the GIL: in short calls, so that
                             # the sink's event loop (another thread) gets it back between them


def rows_to_table(rows: list[dict[str, Any]], table: str) -> pa.Table:
    schema = TABLES[table]
    if len(rows) <= _CONVERT_CHUNK_ROWS:
        return pa.Table.from_pylist(rows, schema=schema)
    return pa.concat_tables([pa.Table.from_pylist(rows[i:i + _CONVERT_CHUNK_ROWS], schema=schema)
                             for i in range(0, len(rows), _CONVERT_CHUNK_ROWS)])


def table_bytes(tbl: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(tbl, buf, compression="zstd")
    return buf.getvalue()
