"""Wire contract: round trips of every message type and one concrete bad input per error code."""

from __future__ import annotations

import hashlib
import pickle
import struct
import subprocess
import sys
import zlib
from typing import Any, Callable

import msgspec
import pytest

import schemas as S
from schemas import ContractError, ErrorCode

from tests import REPO_ROOT


# ------------------------------------------------------------------------------------------------
# fixtures / builders
# ------------------------------------------------------------------------------------------------


def png(w: int = 8, h: int = 4) -> bytes:
    """A tiny valid grey PNG (no Pillow needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(w) for _ in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


IMG = png()


def ego(quat: bool = True) -> S.Egomotion:
    xyz = [[-1.5 + 0.1 * i, 0.01 * i, 0.0] for i in range(16)]
    if quat:
        return S.Egomotion(ego_history_xyz=xyz, ego_history_quat=[[1.0, 0.0, 0.0, 0.0]] * 16)
    eye = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    return S.Egomotion(ego_history_xyz=xyz, ego_history_rot=[eye] * 16)


def future(quat: bool = False) -> S.FutureEgomotion:
    xyz = [[0.1 * (i + 1), 0.0, 0.0] for i in range(64)]
    if quat:
        return S.FutureEgomotion(ego_future_xyz=xyz, ego_future_quat=[[1.0, 0.0, 0.0, 0.0]] * 64)
    eye = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    return S.FutureEgomotion(ego_future_xyz=xyz, ego_future_rot=[eye] * 64)


def image_ref(i: int = 0) -> S.ImageRef:
    data = png(8, 4)
    return S.ImageRef(
        uri=f"file:///tmp/scene/{i}.png", sha256=hashlib.sha256(data).hexdigest(), size=len(data), content_type="image/png"
    )


def request(**kw: Any) -> S.InferRequest:
    base: dict[str, Any] = dict(request_id="req-0001", images=[IMG] * 24, egomotion=ego())
    base.update(kw)
    return S.InferRequest(**base)


def full_request() -> S.InferRequest:
    return S.InferRequest(
        request_id="scene:42.a_b-c",
        run_id="run-7",
        submitted_at=1_760_000_000.25,
        labels={"dataset": "pai-av", "clip": "0001"},
        task="auto_labeling",
        images=[IMG if i % 2 else image_ref(i) for i in range(24)],
        camera_order=[S.CAMERAS[i].name for i in S.DEFAULT_CAMERA_ORDER],
        num_frames_per_camera=4,
        egomotion=ego(quat=False),
        future_egomotion=future(),
        num_traj_samples=4,
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        seed=1234,
        max_tokens=512,
        nav_text="turn left at the next intersection",
        question=None,
    )


def as_dict(req: S.InferRequest) -> dict[str, Any]:
    """A request as plain msgpack builtins (bytes stay bytes) for mutation."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(req))


def spec() -> S.SpeculativeDecoding:
    return S.SpeculativeDecoding(
        num_spec_tokens=7,
        num_spec_steps=10,
        num_draft_tokens=70,
        num_accepted_draft_tokens=35,
        draft_acceptance_rate=0.5,
        mean_acceptance_length=4.5,
        acceptance_histogram=[1, 1, 1, 1, 2, 2, 1, 1],
    )


def result(**kw: Any) -> S.InferResult:
    k = 2
    base: dict[str, Any] = dict(
        request_id="req-0001",
        run_id="run-7",
        task="trajectory",
        labels={"dataset": "pai-av"},
        num_samples=k,
        pred_trajectories=[[[0.1 * t, 0.0, 0.0] for t in range(64)] for _ in range(k)],
        pred_rotations=[[[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]] * 64 for _ in range(k)],
        outputs=[S.SampleOutput(text="Keep lane.", cot="The road is clear.") for _ in range(k)],
        metrics=S.ResultMetrics(
            reasoning_texts=["The road is clear."] * k,
            generated_tokens=[12, 14],
            timings=S.StageTimings(queue_ms=1.5, image_prep_ms=3.0, prefill_ms=20.0, decode_ms=80.0, diffusion_ms=9.0, total_ms=115.0),
            speculative_decoding=spec(),
        ),
        warnings=["max_tokens is ignored for task trajectory"],
        model=S.ModelIdentity(
            id="nvidia/alpamayo-2-super",
            profile="bf16-dflash2",
            precision="bf16",
            checkpoint_hash="abc123",
            speculative_decoding="dflash2",
            speculative_model="/opt/heads/dflash2",
        ),
        lineage=S.Lineage(topic="alpamayo.requests", partition=3, offset=99, worker_id="w-0", attempt=2, replay_of="alpamayo.dead-letters:0:5"),
        completed_at=1_760_000_001.5,
    )
    base.update(kw)
    return S.InferResult(**base)


def dead_letter() -> S.DeadLetter:
    value, headers = S.encode_request(request(temperature=3.0))
    err = pytest.raises(ContractError, S.decode_request, value, headers).value
    return S.dead_letter_from_error(
        err,
        value=value,
        key=b"req-0001",
        headers=headers + [("x-null", None)],
        topic="alpamayo.requests",
        partition=1,
        offset=17,
        worker_id="w-0",
        attempt=1,
        failed_at=1_760_000_002.0,
    )


def enc(obj: Any, fmt: str) -> bytes:
    return msgspec.msgpack.encode(obj) if fmt == "msgpack" else msgspec.json.encode(obj)


def decode_err(value: bytes | None, headers=None, **kw) -> ContractError:
    with pytest.raises(ContractError) as info:
        S.decode_request(value, headers, **kw)
    err = info.value
    assert str(err) == f"{err.code.value} at {err.field}: {err.message}"
    return err


# ------------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------------

CTS = [S.CONTENT_TYPE_MSGPACK, S.CONTENT_TYPE_JSON]


@pytest.mark.parametrize("ct", CTS)
@pytest.mark.parametrize(
    "req",
    [
        pytest.param(request(), id="minimal"),
        pytest.param(full_request(), id="full"),
        pytest.param(request(egomotion=ego(quat=False), seed=0, top_k=1), id="rot"),
        pytest.param(request(task="vqa", egomotion=None, question="Is the light green?", temperature=0.0), id="vqa"),
        pytest.param(request(task="grounding", question="traffic lights", images=[image_ref(i) for i in range(24)]), id="grounding-refs"),
        pytest.param(
            request(camera_order=["camera_front_wide_120fov", "camera_front_tele_30fov"], num_frames_per_camera=2, images=[IMG] * 4),
            id="custom-layout",
        ),
    ],
)
def test_request_round_trip(req: S.InferRequest, ct: str) -> None:
    S.validate_request(req)
    value, headers = S.encode_request(req, ct, validate=True)
    assert dict(headers) == {
        "content-type": ct.encode(),
        "schema-version": b"1",
        "request-id": req.request_id.encode(),
        **({"run-id": req.run_id.encode()} if req.run_id else {}),
    }
    assert S.decode_request(value, headers) == req
    assert S.decode_request(value) == req  # sniffed
    assert S.request_key(req) == req.request_id.encode()


def test_inline_images_are_msgpack_bin_and_json_base64() -> None:
    req = request()
    raw = msgspec.msgpack.decode(S.encode_request(req)[0])
    assert isinstance(raw["images"][0], bytes)
    js = msgspec.json.decode(S.encode_request(req, S.CONTENT_TYPE_JSON)[0])
    assert isinstance(js["images"][0], str)
    import base64

    assert base64.b64decode(js["images"][0]) == IMG


def test_defaults_match_the_nim() -> None:
    req = S.decode_request(msgspec.json.encode({"request_id": "r", "images": [IMG] * 24, "egomotion": ego()}))
    assert (req.schema_version, req.task, req.num_frames_per_camera, req.num_traj_samples) == (1, "trajectory", 4, 1)
    assert (req.temperature, req.top_p, req.top_k, req.seed, req.max_tokens) == (0.6, 0.98, None, None, None)
    assert req.labels == {} and req.camera_order is None and req.run_id is None


@pytest.mark.parametrize("ct", CTS)
def test_result_round_trip(ct: str) -> None:
    res = result()
    value, headers = S.encode_result(res, ct)
    assert dict(headers)["request-id"] == b"req-0001"
    assert dict(headers)["content-type"] == ct.encode()
    assert S.decode_result(value, headers) == res
    assert S.decode_result(value) == res
    assert S.result_key(res.request_id) == b"req-0001"


@pytest.mark.parametrize("ct", CTS)
def test_result_variants_round_trip(ct: str) -> None:
    detailed = msgspec.structs.replace(spec(), per_step_accepted=[3] * 10, per_step_drafted=[7] * 10)
    variants = [
        result(metrics=msgspec.structs.replace(result().metrics, speculative_decoding=detailed)),
        result(task="vqa", num_samples=1, pred_trajectories=None, pred_rotations=None, answer="Yes.",
               outputs=[S.SampleOutput(text="Yes.")], lineage=None,
               metrics=S.ResultMetrics(reasoning_texts=[""], generated_tokens=[2], timings=S.StageTimings(total_ms=5.0))),
        result(task="meta_action", num_samples=1, pred_trajectories=None, pred_rotations=None,
               outputs=[S.SampleOutput(text="...", meta_action=S.MetaAction(longitudinal="Decelerate", lateral="Keep lane"))]),
        result(task="auto_labeling", outputs=[S.SampleOutput(text="{}", auto_label=S.AutoLabel(trajectory_analysis="straight"))] * 2,
               uncertainty=S.Uncertainty(uncertainty=0.0, auto_label_agreement=1.0)),
        result(uncertainty=S.Uncertainty(uncertainty=0.42, trajectory_spread_m=1.5, endpoint_spread_m=4.0,
                                         lateral_spread_m=0.95)),
        result(task="grounding", num_samples=1, outputs=[S.SampleOutput(text="[]", boxes=[S.GroundingBox(bbox_2d=[1, 2, 30, 40], label="car")])]),
    ]
    for res in variants:
        assert S.decode_result(S.encode_result(res, ct)[0]) == res


def test_speculative_decoding_omits_none_fields() -> None:
    summary = msgspec.msgpack.decode(msgspec.msgpack.encode(spec()))
    assert "per_step_accepted" not in summary and "per_step_drafted" not in summary
    detailed = msgspec.structs.replace(spec(), per_step_accepted=[1], per_step_drafted=[7])
    assert msgspec.json.decode(msgspec.json.encode(detailed))["per_step_accepted"] == [1]


def test_uncertainty_block_is_optional_and_checked() -> None:
    old = msgspec.msgpack.decode(S.encode_result(result())[0])
    assert old["uncertainty"] is None                                   # K = 1 and older results: no block
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(S.Uncertainty(uncertainty=0.1))) == {"uncertainty": 0.1}
    del old["uncertainty"]                                              # a result written before the block existed
    assert S.decode_result(msgspec.msgpack.encode(old)).uncertainty is None
    old["uncertainty"] = {"uncertainty": 1.5}
    with pytest.raises(S.ContractError, match="uncertainty"):
        S.decode_result(msgspec.msgpack.encode(old))


def test_encoder_converts_array_likes() -> None:
    class Arr:  # stands in for a numpy array / tensor
        def __init__(self, v):
            self.v = v

        def tolist(self):
            return self.v

    res = result(pred_trajectories=Arr([[[0.0, 0.0, 0.0]] * 64]), num_samples=1)
    assert S.decode_result(S.encode_result(res)[0]).pred_trajectories == [[[0.0, 0.0, 0.0]] * 64]


@pytest.mark.parametrize("ct", CTS)
def test_dead_letter_round_trip(ct: str) -> None:
    dl = dead_letter()
    assert dl.error_code is ErrorCode.OUT_OF_RANGE and dl.error_field == "$.temperature"
    assert dl.request_id == "req-0001" and dl.source == S.SourceCoordinates(topic="alpamayo.requests", partition=1, offset=17)
    assert ("x-null", b"") in dl.original_headers and not dl.retryable
    value, headers = S.encode_dead_letter(dl, ct)
    assert dict(headers)["error-code"] == b"out_of_range"
    back = S.decode_dead_letter(value, headers)
    assert back == dl
    assert S.dead_letter_key(back) == b"req-0001"
    # the original request can be re-read from the dead letter (and fails the same way)
    with pytest.raises(ContractError) as info:
        S.decode_request(back.original_value, back.original_headers)
    assert info.value.code is ErrorCode.OUT_OF_RANGE
    assert back.to_error().field == "$.temperature"


def test_dead_letter_without_request_id_is_keyed_by_coordinates() -> None:
    dl = S.dead_letter_from_error(
        ValueError("boom"), value=b"\xc1" * 100, topic="t", partition=0, offset=5, worker_id="w", max_value_bytes=10
    )
    assert dl.error_code is ErrorCode.INTERNAL_ERROR and dl.retryable
    assert dl.original_value == b"\xc1" * 10 and dl.original_value_truncated and dl.original_size == 100
    assert S.dead_letter_key(dl) == b"t:0:5"
    assert S.decode_dead_letter(S.encode_dead_letter(dl)[0]) == dl


# ------------------------------------------------------------------------------------------------
# error codes: one concrete bad input each
# ------------------------------------------------------------------------------------------------

Mut = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mut:
    def f(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value

    return f


def _drop(path: str) -> Mut:
    def f(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        del d[last]

    return f


def _row(path: str, i: int, value: Any) -> Mut:
    def f(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last][i] = value

    return f


NAN_ROW = [0.0, float("nan"), 0.0]
# (id, mutation of a valid request dict, expected code, expected field, k_values)
MUTATIONS: list[tuple[str, Mut, ErrorCode, str]] = [
    ("schema-99", _set("schema_version", 99), ErrorCode.UNSUPPORTED_SCHEMA_VERSION, "$.schema_version"),
    ("schema-str", _set("schema_version", "1"), ErrorCode.WRONG_TYPE, "$.schema_version"),
    ("no-request-id", _drop("request_id"), ErrorCode.MISSING_FIELD, "$.request_id"),
    ("no-images", _drop("images"), ErrorCode.MISSING_FIELD, "$.images"),
    ("no-xyz", _drop("egomotion.ego_history_xyz"), ErrorCode.MISSING_FIELD, "$.egomotion.ego_history_xyz"),
    ("temperature-str", _set("temperature", "hot"), ErrorCode.WRONG_TYPE, "$.temperature"),
    ("image-int", _row("images", 3, 5), ErrorCode.WRONG_TYPE, "$.images[3]"),
    ("xyz-str", _row("egomotion.ego_history_xyz", 2, [0.0, "x", 0.0]), ErrorCode.WRONG_TYPE, "$.egomotion.ego_history_xyz[2][1]"),
    ("labels-int", _set("labels", {"a": 1}), ErrorCode.WRONG_TYPE, "$.labels[...]"),
    ("temperature-3", _set("temperature", 3), ErrorCode.OUT_OF_RANGE, "$.temperature"),
    ("temperature-neg", _set("temperature", -0.1), ErrorCode.OUT_OF_RANGE, "$.temperature"),
    ("temperature-nan", _set("temperature", float("nan")), ErrorCode.OUT_OF_RANGE, "$.temperature"),
    ("top-p-0", _set("top_p", 0.0), ErrorCode.OUT_OF_RANGE, "$.top_p"),
    ("top-k-0", _set("top_k", 0), ErrorCode.OUT_OF_RANGE, "$.top_k"),
    ("max-tokens-2000", _set("max_tokens", 2000), ErrorCode.OUT_OF_RANGE, "$.max_tokens"),
    ("k-17", _set("num_traj_samples", 17), ErrorCode.OUT_OF_RANGE, "$.num_traj_samples"),
    ("frames-9", _set("num_frames_per_camera", 9), ErrorCode.OUT_OF_RANGE, "$.num_frames_per_camera"),
    ("seed-neg", _set("seed", -1), ErrorCode.OUT_OF_RANGE, "$.seed"),
    ("bad-request-id", _set("request_id", "bad id!"), ErrorCode.OUT_OF_RANGE, "$.request_id"),
    ("long-request-id", _set("request_id", "a" * 129), ErrorCode.OUT_OF_RANGE, "$.request_id"),
    ("bad-run-id", _set("run_id", "run/1"), ErrorCode.OUT_OF_RANGE, "$.run_id"),
    ("65-images", _set("images", [IMG] * 65), ErrorCode.OUT_OF_RANGE, "$.images"),
    ("unknown-camera", _set("camera_order", ["camera_front_wide_120fov", "camera_roof"]), ErrorCode.OUT_OF_RANGE, "$.camera_order[1]"),
    ("dup-camera", _set("camera_order", ["camera_front_wide_120fov"] * 2), ErrorCode.OUT_OF_RANGE, "$.camera_order[1]"),
    ("bad-sha", _row("images", 0, {"uri": "s3://b/k", "sha256": "xyz", "size": 3}), ErrorCode.OUT_OF_RANGE, "$.images[0].sha256"),
    ("bad-image", _row("images", 5, b"GIF89a-not-supported"), ErrorCode.BAD_IMAGE, "$.images[5]"),
    ("empty-image", _row("images", 0, b""), ErrorCode.BAD_IMAGE, "$.images[0]"),
    ("truncated-png", _row("images", 1, IMG[:14]), ErrorCode.BAD_IMAGE, "$.images[1]"),
    ("ref-gif", _row("images", 2, {"uri": "s3://b/k", "sha256": "a" * 64, "size": 3, "content_type": "image/gif"}),
     ErrorCode.BAD_IMAGE, "$.images[2].content_type"),
    ("23-images", _set("images", [IMG] * 23), ErrorCode.IMAGE_COUNT_MISMATCH, "$.images"),
    ("size-mismatch", _row("images", 7, png(16, 4)), ErrorCode.IMAGE_SIZE_MISMATCH, "$.images[7]"),
    ("k2-greedy", lambda d: d.update(num_traj_samples=2, temperature=0.0), ErrorCode.K_REQUIRES_TEMPERATURE, "$.temperature"),
    ("no-ego", _drop("egomotion"), ErrorCode.MISSING_EGOMOTION, "$.egomotion"),
    ("no-future", _set("task", "auto_labeling"), ErrorCode.MISSING_FUTURE_EGOMOTION, "$.future_egomotion"),
    ("vqa-no-question", lambda d: d.update(task="vqa"), ErrorCode.MISSING_FIELD, "$.question"),
    ("unknown-task", _set("task", "drive"), ErrorCode.UNKNOWN_TASK, "$.task"),
    ("xyz-15", lambda d: d["egomotion"]["ego_history_xyz"].pop(), ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_xyz"),
    ("xyz-row-2", _row("egomotion.ego_history_xyz", 3, [0.0, 0.0]), ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_xyz[3]"),
    ("xyz-nan", _row("egomotion.ego_history_xyz", 3, NAN_ROW), ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_xyz[3][1]"),
    ("quat-inf", _row("egomotion.ego_history_quat", 0, [float("inf"), 0, 0, 0]), ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_quat[0][0]"),
    ("quat-zero", _row("egomotion.ego_history_quat", 4, [0.0, 0.0, 0.0, 0.0]), ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_quat[4]"),
    ("quat-3", _row("egomotion.ego_history_quat", 4, [1.0, 0.0, 0.0]), ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_quat[4]"),
    ("rot-and-quat", _set("egomotion.ego_history_rot", [[[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]] * 16), ErrorCode.BAD_EGOMOTION, "$.egomotion"),
    ("neither", _drop("egomotion.ego_history_quat"), ErrorCode.BAD_EGOMOTION, "$.egomotion"),
    ("future-63", lambda d: d.update(future_egomotion=msgspec.to_builtins(msgspec.structs.replace(future(), ego_future_xyz=future().ego_future_xyz[:63]))),
     ErrorCode.BAD_EGOMOTION, "$.future_egomotion.ego_future_xyz"),
    ("future-rot-2x3", lambda d: d.update(future_egomotion={**msgspec.to_builtins(future()), "ego_future_rot": [[[1.0, 0, 0], [0, 1.0, 0]]] * 64}),
     ErrorCode.BAD_EGOMOTION, "$.future_egomotion.ego_future_rot[0]"),
    ("meta-action-frames", lambda d: d.update(task="meta_action", num_frames_per_camera=2, images=[IMG] * 12),
     ErrorCode.OUT_OF_RANGE, "$.num_frames_per_camera"),
]


NON_JSON = {"temperature-nan", "xyz-nan", "quat-inf"}  # JSON has no NaN/inf literal


@pytest.mark.parametrize(
    "name,mutate,code,field,fmt",
    [pytest.param(*m, fmt, id=f"{m[0]}-{fmt}") for fmt in ("msgpack", "json") for m in MUTATIONS if not (fmt == "json" and m[0] in NON_JSON)],
)
def test_error_codes_from_bad_fields(name: str, mutate: Mut, code: ErrorCode, field: str, fmt: str) -> None:
    d = as_dict(request(labels={"team": "x"}))
    mutate(d)
    err = decode_err(enc(d, fmt))
    assert (err.code, err.field) == (code, field), str(err)
    if name not in ("no-request-id", "bad-request-id", "long-request-id"):
        assert err.request_id == "req-0001"  # readable for the dead letter


def test_json_huge_number_in_egomotion_is_bad_egomotion() -> None:
    text = msgspec.json.encode(as_dict(request())).replace(b'"ego_history_xyz":[[-1.5', b'"ego_history_xyz":[[1e999', 1)
    err = decode_err(text)
    assert (err.code, err.field) == (ErrorCode.BAD_EGOMOTION, "$.egomotion.ego_history_xyz[0][0]")


@pytest.mark.parametrize(
    "value,headers,code",
    [
        (b"\xc1", None, ErrorCode.UNDECODABLE_BYTES),
        (None, None, ErrorCode.UNDECODABLE_BYTES),
        (b"", None, ErrorCode.UNDECODABLE_BYTES),
        (b"{not json", None, ErrorCode.UNDECODABLE_BYTES),
        (b'  {"request_id": "a",', None, ErrorCode.UNDECODABLE_BYTES),
        (b"\x81\xa1a" * 200_000 + b"\x00", None, ErrorCode.UNDECODABLE_BYTES),  # nested too deep
        (b'{"a":' * 200_000, [("content-type", b"application/json")], ErrorCode.UNDECODABLE_BYTES),
        (b'{"images":' + b"[" * 200_000, None, ErrorCode.UNDECODABLE_BYTES),
        (b"\x93\x01\x02\x03", None, ErrorCode.WRONG_TYPE),  # msgpack array, not a map
        (b"\x81\x01\x02", None, ErrorCode.WRONG_TYPE),  # non-string key
        (b"{}", [("content-type", b"text/plain")], ErrorCode.UNSUPPORTED_CONTENT_TYPE),
        (b"{}", [("Content-Type", b"application/avro")], ErrorCode.UNSUPPORTED_CONTENT_TYPE),
    ],
)
def test_error_codes_from_bad_bytes(value, headers, code) -> None:
    err = decode_err(value, headers)
    assert err.code is code and err.field == "$"


def test_truncated_msgpack_is_undecodable() -> None:
    value, headers = S.encode_request(request())
    err = decode_err(value[: len(value) // 2], headers)
    assert err.code is ErrorCode.UNDECODABLE_BYTES


def test_oversize() -> None:
    value, headers = S.encode_request(request())
    err = decode_err(value, headers, max_bytes=len(value) - 1)
    assert (err.code, err.field) == (ErrorCode.OVERSIZE, "$")
    assert S.decode_request(value, headers, max_bytes=len(value)) == request()
    assert S.DEFAULT_MAX_BYTES == 134_217_728


def test_content_type_header_wins_over_sniffing() -> None:
    value, _ = S.encode_request(request(), S.CONTENT_TYPE_JSON)
    err = decode_err(value, [("content-type", b"application/msgpack")])
    assert err.code in (ErrorCode.UNDECODABLE_BYTES, ErrorCode.WRONG_TYPE)
    assert S.decode_request(b"  \n" + value, [("content-type", b"application/json; charset=utf-8")]) == request()


def test_schema_version_checked_before_full_decode() -> None:
    # version 2 may change anything: a v1 worker must say "unsupported version", not "wrong type"
    err = decode_err(msgspec.msgpack.encode({"schema_version": 2, "request_id": "r9", "images": "whatever"}))
    assert (err.code, err.field, err.request_id) == (ErrorCode.UNSUPPORTED_SCHEMA_VERSION, "$.schema_version", "r9")


def test_k_not_served() -> None:
    value, headers = S.encode_request(request(num_traj_samples=4, seed=1))
    err = decode_err(value, headers, k_values=[1, 2])
    assert (err.code, err.field) == (ErrorCode.K_NOT_SERVED, "$.num_traj_samples")
    assert S.decode_request(value, headers, k_values={1, 4}).num_traj_samples == 4


def test_claim_check_failed() -> None:
    ref = image_ref()
    S.verify_claim_check(ref, png(8, 4))
    with pytest.raises(ContractError) as info:
        S.verify_claim_check(ref, png(8, 5), field="$.images[0]")
    assert (info.value.code, info.value.field) == (ErrorCode.CLAIM_CHECK_FAILED, "$.images[0]")
    with pytest.raises(ContractError, match="sha256"):
        S.verify_claim_check(ref, b"\x00" * ref.size)


def test_worker_side_codes() -> None:
    """inference_failed / internal_error are raised by the worker; they flow into dead letters."""
    err = ContractError(ErrorCode.INFERENCE_FAILED, "$", "CUDA out of memory", request_id="r")
    dl = S.dead_letter_from_error(err, value=b"x", topic="t", partition=0, offset=0, worker_id="w")
    assert (dl.error_code, dl.request_id, dl.retryable) == (ErrorCode.INFERENCE_FAILED, "r", True)
    assert S.dead_letter_from_error(KeyError("k"), value=None, topic="t", partition=0, offset=0, worker_id="w").error_code is ErrorCode.INTERNAL_ERROR


def test_every_code_has_a_concrete_case() -> None:
    covered = {m[2] for m in MUTATIONS} | {
        ErrorCode.UNDECODABLE_BYTES, ErrorCode.UNSUPPORTED_CONTENT_TYPE, ErrorCode.OVERSIZE,
        ErrorCode.K_NOT_SERVED, ErrorCode.CLAIM_CHECK_FAILED, ErrorCode.INFERENCE_FAILED, ErrorCode.INTERNAL_ERROR,
    }
    assert covered == set(ErrorCode)


def test_error_ids_fall_back_to_headers() -> None:
    err = decode_err(b"\xc1", [("request-id", b"from-header"), ("run-id", b"run-1")])
    assert (err.request_id, err.run_id) == ("from-header", "run-1")
    err = decode_err(b"\xc1", [("request-id", b"not valid id")])
    assert err.request_id is None


# ------------------------------------------------------------------------------------------------
# errors, warnings, misc
# ------------------------------------------------------------------------------------------------


def test_contract_error_shape() -> None:
    err = ContractError("bad_egomotion", "$.egomotion.ego_history_xyz[3]", "expected 3 values", request_id="r1")
    assert err.code is ErrorCode.BAD_EGOMOTION
    assert str(err) == "bad_egomotion at $.egomotion.ego_history_xyz[3]: expected 3 values"
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.field, back.message, back.request_id) == (err.code, err.field, err.message, "r1")
    assert ContractError(ErrorCode.OVERSIZE).field == "$"
    with pytest.raises(ValueError):
        ContractError("no_such_code")
    assert all(c.value == c.value.lower() and " " not in c.value for c in ErrorCode)
    assert len(ErrorCode) == 19


def test_warnings() -> None:
    d = as_dict(request(max_tokens=100, question="why?"))
    d["temprature"] = 0.3
    req, warnings = S.decode_request_with_warnings(msgspec.msgpack.encode(d))
    assert warnings == [
        "unknown field 'temprature' ignored",
        "max_tokens is ignored for task trajectory",
        "question is ignored for task trajectory",
    ]
    assert req.temperature == 0.6


def test_cameras() -> None:
    assert len(S.CAMERAS) == 7
    assert S.CAMERAS[0] == (0, "camera_cross_left_120fov", "Front left camera")
    assert S.CAMERAS[6].name == "camera_front_tele_30fov" and S.CAMERAS[6].display_name == "Front telephoto camera"
    assert S.CAMERAS[4].name == "camera_rear_tele_30fov"
    assert S.DEFAULT_CAMERA_ORDER == (0, 1, 2, 3, 5, 6) and S.VQA_CAMERA_ORDER == (0, 1, 2, 3, 4, 5)
    assert S.camera_names_for("vqa")[-1] == "camera_rear_right_70fov"
    assert S.camera_names_for("trajectory")[-1] == "camera_front_tele_30fov"
    assert set(S.CAMERA_IDS_BY_NAME) == set(S.CameraName.__args__)


def test_image_helpers_agree_with_pillow() -> None:
    Image = pytest.importorskip("PIL.Image")
    import io

    for fmt, kw in [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {}), ("WEBP", {}), ("WEBP", {"lossless": True}), ("BMP", {})]:
        buf = io.BytesIO()
        Image.new("RGB", (97, 41)).save(buf, format=fmt, **kw)
        assert S.image_dimensions(buf.getvalue()) == (97, 41), (fmt, kw)
        assert S.sniff_image_format(buf.getvalue()) == f"image/{fmt.lower()}"
    assert S.check_image_blobs([IMG, None, IMG]) == [(8, 4), None, (8, 4)]


def test_every_field_is_documented() -> None:
    for kind in ("request", "result", "dead_letter"):
        schema = S.json_schema(kind)
        for name, definition in schema["$defs"].items():
            for field, prop in definition.get("properties", {}).items():
                assert prop.get("description"), f"{name}.{field} has no description"


def test_contract_doc_mentions_every_code_and_field() -> None:
    doc = (REPO_ROOT / "docs" / "contract.md").read_text()
    for code in ErrorCode:
        assert f"`{code.value}`" in doc, code
    for typ in (S.InferRequest, S.ImageRef, S.Egomotion, S.FutureEgomotion, S.InferResult, S.ResultMetrics,
                S.SpeculativeDecoding, S.StageTimings, S.SampleOutput, S.ModelIdentity, S.Lineage, S.DeadLetter,
                S.Uncertainty):
        for field in typ.__struct_fields__:
            assert f"`{field}`" in doc, f"{typ.__name__}.{field}"


def test_no_torch_or_numpy_import() -> None:
    code = "import sys, schemas; bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
