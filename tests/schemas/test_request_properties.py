"""Property tests of the request decoder: it never crashes, every failure has a code and a path,
and every valid request round-trips exactly through msgpack and JSON."""

from __future__ import annotations

import hashlib
import math
import os
import struct
import zlib
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import schemas as S
from schemas import ContractError, ErrorCode

# SCHEMAS_HYPOTHESIS_SCALE=20 multiplies every example budget (a longer soak run); default ~10 s.
SCALE = max(1, int(os.environ.get("SCHEMAS_HYPOTHESIS_SCALE", "1")))
SETTINGS = settings(
    max_examples=400 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # no example database written into the working tree
)


def _png(w: int, h: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(w) for _ in range(h))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


PNGS = {(w, h): _png(w, h) for w in (4, 8) for h in (2, 4)}


def _check_error(err: ContractError) -> None:
    assert isinstance(err.code, ErrorCode)
    assert err.code is not ErrorCode.INTERNAL_ERROR, str(err)  # a validation crash = a bug
    assert err.field.startswith("$"), str(err)
    assert str(err).startswith(f"{err.code.value} at {err.field}: ")


def _decode(value: bytes, headers=None) -> S.InferRequest | ContractError:
    try:
        return S.decode_request(value, headers)
    except ContractError as err:
        _check_error(err)
        return err
    # anything else propagates and fails the test


# ------------------------------------------------------------------------------------------------
# arbitrary bytes
# ------------------------------------------------------------------------------------------------

CT_HEADERS = st.sampled_from(
    [
        None,
        [("content-type", b"application/msgpack")],
        [("content-type", b"application/json")],
        [("content-type", b"application/json; charset=utf-8")],
        [("content-type", b"\xff\xfe")],
        [("content-type", None)],
        [("request-id", b"\x00\xff"), ("schema-version", b"x")],
    ]
)


@SETTINGS
@given(value=st.one_of(st.binary(max_size=512), st.binary(min_size=1, max_size=64).map(lambda b: b"{" + b)), headers=CT_HEADERS)
def test_arbitrary_bytes_only_raise_contract_errors(value: bytes, headers) -> None:
    _decode(value, headers)


@SETTINGS
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
), fmt=st.sampled_from(["msgpack", "json"]))
def test_arbitrary_documents_only_raise_contract_errors(value: Any, fmt: str) -> None:
    try:
        data = msgspec.msgpack.encode(value) if fmt == "msgpack" else msgspec.json.encode(value)
    except Exception:
        return
    _decode(data)


# ------------------------------------------------------------------------------------------------
# valid requests
# ------------------------------------------------------------------------------------------------

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
ids = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-", min_size=1, max_size=128)
texts = st.text(max_size=40)


def _tiled(elem, n: int, distinct: int):
    """n items cycling through 1..distinct drawn ones (cheap to generate, still arbitrary values)."""
    return st.lists(elem, min_size=1, max_size=distinct).map(lambda xs: [xs[i % len(xs)] for i in range(n)])


def _poses(n: int, cls, prefix: str, distinct: int):
    vec3 = st.lists(finite, min_size=3, max_size=3)
    quat = _tiled(st.tuples(st.floats(0.1, 1.0), finite, finite, finite).map(list), n, distinct)
    rot = _tiled(st.lists(vec3, min_size=3, max_size=3), n, distinct)
    rotation = st.one_of(rot.map(lambda r: {f"{prefix}_rot": r}), quat.map(lambda q: {f"{prefix}_quat": q}))
    return st.builds(lambda xyz, r: cls(**{f"{prefix}_xyz": xyz}, **r), _tiled(vec3, n, distinct), rotation)


egomotions = _poses(16, S.Egomotion, "ego_history", 16)
futures = _poses(64, S.FutureEgomotion, "ego_future", 8)
refs = st.builds(
    S.ImageRef,
    uri=st.text(min_size=1, max_size=30),
    sha256=st.text(alphabet="0123456789abcdefABCDEF", min_size=64, max_size=64),
    size=st.integers(1, 1 << 31),
    content_type=st.sampled_from([None, "image/jpeg", "image/png", "image/webp", "image/bmp"]),
)


@st.composite
def valid_requests(draw) -> S.InferRequest:
    task = draw(st.sampled_from(S.TASKS))
    if task == "meta_action":
        camera_order = draw(st.sampled_from([None, S.camera_names_for("meta_action")]))
        nf = 4
    else:
        camera_order = draw(st.one_of(st.none(), st.sets(st.sampled_from(sorted(S.CAMERA_IDS_BY_NAME)), min_size=1).map(sorted)))
        nf = draw(st.integers(1, 8))
    n = len(S.camera_names_for(task, camera_order)) * nf
    size = draw(st.sampled_from(sorted(PNGS)))
    images = draw(st.lists(st.one_of(st.just(PNGS[size]), refs), min_size=n, max_size=n))
    k = draw(st.integers(1, 16))
    temperature = draw(st.floats(0.01, 2.0) if k > 1 else st.floats(0.0, 2.0))
    needs_ego = task in S.TASKS_NEEDING_EGOMOTION
    return S.InferRequest(
        request_id=draw(ids),
        run_id=draw(st.none() | ids),
        submitted_at=draw(st.none() | st.floats(0, 2e9)),
        labels=draw(st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=10), max_size=4)),
        task=task,
        images=images,
        camera_order=camera_order,
        num_frames_per_camera=nf,
        egomotion=draw(egomotions if needs_ego else st.none() | egomotions),
        future_egomotion=draw(futures if task == "auto_labeling" else st.none()),
        num_traj_samples=k,
        temperature=temperature,
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.none() | st.integers(1, 1000)),
        seed=draw(st.none() | st.integers(0, (1 << 63) - 1)),
        max_tokens=draw(st.none() | st.integers(1, 1024)),
        nav_text=draw(st.none() | texts),
        question=draw(texts.filter(str.strip) if task in S.TASKS_NEEDING_QUESTION else st.none()),
    )


def _normalize(req: S.InferRequest) -> S.InferRequest:
    """Decoded floats are floats: compare with a request whose numbers went through float()."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=S.InferRequest)


@settings(SETTINGS, max_examples=300 * SCALE)
@given(req=valid_requests(), ct=st.sampled_from([S.CONTENT_TYPE_MSGPACK, S.CONTENT_TYPE_JSON]))
def test_valid_requests_round_trip_exactly(req: S.InferRequest, ct: str) -> None:
    value, headers = S.encode_request(req, ct, validate=True)
    back = S.decode_request(value, headers)
    assert back == _normalize(req)
    assert S.encode_request(back, ct)[0] == value  # byte-identical re-encoding


# ------------------------------------------------------------------------------------------------
# mutated valid requests
# ------------------------------------------------------------------------------------------------

BASE = msgspec.msgpack.decode(
    msgspec.msgpack.encode(
        S.InferRequest(
            request_id="base-1",
            labels={"team": "x"},
            task="auto_labeling",
            images=[PNGS[(8, 4)]] * 23
            + [S.ImageRef(uri="s3://b/k", sha256=hashlib.sha256(b"x").hexdigest(), size=1, content_type="image/png")],
            egomotion=S.Egomotion(ego_history_xyz=[[0.0, 0.0, 0.0]] * 16, ego_history_quat=[[1.0, 0.0, 0.0, 0.0]] * 16),
            future_egomotion=S.FutureEgomotion(
                ego_future_xyz=[[1.0, 0.0, 0.0]] * 64, ego_future_rot=[[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]] * 64
            ),
            num_traj_samples=2,
            seed=3,
            top_k=5,
            max_tokens=10,
        )
    )
)
S.decode_request(msgspec.msgpack.encode(BASE))  # the base is valid


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    elif isinstance(obj, list):
        # a few indices are enough (first, last): keeps the path list small
        for i in sorted({0, len(obj) - 1}) if obj else ():
            out += _paths(obj[i], path + (i,))
    return out


PATHS = _paths(BASE)[1:]


def _json_path(path: tuple) -> str:
    out = "$"
    for i, p in enumerate(path):
        if isinstance(p, int):
            out += f"[{p}]"
        elif i > 0 and path[i - 1] == "labels":
            out += "[...]"
        else:
            out += f".{p}"
    return out


def _get_parent(doc: Any, path: tuple):
    for p in path[:-1]:
        doc = doc[p]
    return doc


def _copy(obj: Any) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))


scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
any_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@st.composite
def mutations(draw):
    """(bytes, headers, description, mutated path or None)."""
    fmt = draw(st.sampled_from(["msgpack", "json"]))
    op = draw(st.sampled_from(["truncate", "flip", "drop", "insert", "swap", "huge"]))
    doc = _copy(BASE)
    path = None
    if op in ("drop", "swap", "huge"):
        path = draw(st.sampled_from(PATHS))
        parent = _get_parent(doc, path)
        if op == "drop":
            if isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        elif op == "swap":
            parent[path[-1]] = draw(any_values)
        else:  # huge: an array of many copies where a value was
            parent[path[-1]] = [parent[path[-1]]] * draw(st.sampled_from([17, 65, 1000, 20000]))
    elif op == "insert":
        target = draw(st.sampled_from([p for p in [()] + PATHS if isinstance(_get_parent(doc, p + ("x",)), dict)]))
        parent = _get_parent(doc, target + ("x",))
        parent[draw(st.text(max_size=12))] = draw(any_values)
    try:
        data = msgspec.msgpack.encode(doc) if fmt == "msgpack" else msgspec.json.encode(doc)
    except Exception:  # e.g. NaN is fine in msgpack; nothing is unencodable, but be safe
        data = msgspec.msgpack.encode(BASE)
    if op == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif op == "flip":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] = draw(st.integers(0, 255))
        data = bytes(buf)
    headers = draw(st.sampled_from([None, [("content-type", ("application/" + fmt).encode())]]))
    return data, headers, op, path


@settings(SETTINGS, max_examples=500 * SCALE)
@given(m=mutations())
def test_mutated_messages_map_to_a_code_and_a_path(m) -> None:
    data, headers, op, path = m
    out = _decode(data, headers)
    event(f"{op} -> {out.code.value if isinstance(out, ContractError) else 'valid'}")
    if isinstance(out, ContractError) and op == "swap" and out.code in (ErrorCode.WRONG_TYPE, ErrorCode.MISSING_FIELD):
        # only the swapped value is wrong, so a type error must point at it (or inside it)
        assert out.field.startswith(_json_path(path)), (str(out), path)
    if isinstance(out, S.InferRequest):
        S.validate_request(out)


def test_huge_image_list_is_cheap() -> None:
    doc = _copy(BASE)
    doc["images"] = doc["images"] * 5000
    with pytest.raises(ContractError) as info:
        S.decode_request(msgspec.msgpack.encode(doc))
    assert (info.value.code, info.value.field) == (ErrorCode.OUT_OF_RANGE, "$.images")


def test_nan_anywhere_in_poses_is_bad_egomotion() -> None:
    for key, rows in (("egomotion", "ego_history_quat"), ("future_egomotion", "ego_future_rot")):
        doc = _copy(BASE)
        row = doc[key][rows][5]
        if isinstance(row[0], list):
            row[2][1] = math.nan
            want = f"$.{key}.{rows}[5][2][1]"
        else:
            row[3] = -math.inf
            want = f"$.{key}.{rows}[5][3]"
        with pytest.raises(ContractError) as info:
            S.decode_request(msgspec.msgpack.encode(doc))
        assert (info.value.code, info.value.field) == (ErrorCode.BAD_EGOMOTION, want)
