"""Bytes <-> messages for Kafka: msgpack (default) and JSON, headers, keys, typed errors.

``decode_request`` is the single entry point for untrusted bytes and raises nothing but
:class:`~schemas.errors.ContractError`:

1. ``None``/empty -> ``undecodable_bytes``; longer than ``max_bytes`` -> ``oversize``.
2. Format from the ``content-type`` header; absent -> sniffed (JSON if the first non-blank byte is
   ``{``, else msgpack); any other content type -> ``unsupported_content_type``.
3. A cheap envelope pass (top-level keys only, values left undecoded) reads ``schema_version``,
   ``request_id`` and ``run_id``; an unknown version -> ``unsupported_schema_version`` before the
   full decode. The ids it reads (or the ``request-id``/``run-id`` headers) are attached to any
   later error so the dead letter can be keyed.
4. The typed decode; msgspec errors map to ``missing_field`` / ``wrong_type`` / ``out_of_range``
   / ``unknown_task`` (``bad_egomotion`` inside egomotion) with msgspec's JSON path.
5. :func:`schemas.request.validate_request` (shapes, finiteness, task requirements, images).

Encoders and decoders are module-level msgspec instances (reused, no per-call setup).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

import msgspec

from .dead_letter import DeadLetter, dead_letter_key
from .errors import ContractError, ErrorCode
from .request import (
    SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    InferRequest,
    _valid_id,
    request_warnings,
    validate_request,
)
from .result import InferResult

__all__ = [
    "CONTENT_TYPE_MSGPACK",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPES",
    "HEADER_CONTENT_TYPE",
    "HEADER_SCHEMA_VERSION",
    "HEADER_REQUEST_ID",
    "HEADER_RUN_ID",
    "HEADER_ERROR_CODE",
    "DEFAULT_MAX_BYTES",
    "ContentType",
    "Headers",
    "decode_request",
    "decode_request_with_warnings",
    "encode_request",
    "encode_result",
    "decode_result",
    "encode_dead_letter",
    "decode_dead_letter",
    "request_key",
    "result_key",
    "dead_letter_key",
    "header_value",
    "resolve_content_type",
    "json_schema",
]

CONTENT_TYPE_MSGPACK = "application/msgpack"
CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPES: frozenset[str] = frozenset({CONTENT_TYPE_MSGPACK, CONTENT_TYPE_JSON})
ContentType = Literal["application/msgpack", "application/json"]
_CT_ALIASES = {
    "application/msgpack": CONTENT_TYPE_MSGPACK,
    "application/x-msgpack": CONTENT_TYPE_MSGPACK,
    "application/vnd.msgpack": CONTENT_TYPE_MSGPACK,
    "application/json": CONTENT_TYPE_JSON,
}

HEADER_CONTENT_TYPE = "content-type"
HEADER_SCHEMA_VERSION = "schema-version"
HEADER_REQUEST_ID = "request-id"
HEADER_RUN_ID = "run-id"
HEADER_ERROR_CODE = "error-code"

DEFAULT_MAX_BYTES = 128 * 1024 * 1024
"""128 MiB (134,217,728 bytes), the NIM's request size limit."""

Headers = list[tuple[str, bytes]]


# --------------------------------------------------------------------------------------------
# msgspec instances (module level, reused)
# --------------------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    """Arrays/tensors (anything with ``tolist``) encode as nested lists."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


_MP_ENC = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_JSON_ENC = msgspec.json.Encoder(enc_hook=_enc_hook)
_ENCODERS = {CONTENT_TYPE_MSGPACK: _MP_ENC, CONTENT_TYPE_JSON: _JSON_ENC}

_ENVELOPE_DECODERS = {
    CONTENT_TYPE_MSGPACK: msgspec.msgpack.Decoder(dict[str, msgspec.Raw]),
    CONTENT_TYPE_JSON: msgspec.json.Decoder(dict[str, msgspec.Raw]),
}
_ANY_DECODERS = {CONTENT_TYPE_MSGPACK: msgspec.msgpack.Decoder(), CONTENT_TYPE_JSON: msgspec.json.Decoder()}


class _Kind:
    __slots__ = ("name", "type", "decoders", "fields")

    def __init__(self, name: str, typ: type) -> None:
        self.name = name
        self.type = typ
        self.decoders = {
            CONTENT_TYPE_MSGPACK: msgspec.msgpack.Decoder(typ),
            CONTENT_TYPE_JSON: msgspec.json.Decoder(typ),
        }
        self.fields = frozenset(typ.__struct_fields__)


_REQUEST = _Kind("request", InferRequest)
_RESULT = _Kind("result", InferResult)
_DEAD_LETTER = _Kind("dead_letter", DeadLetter)


# --------------------------------------------------------------------------------------------
# headers and content type
# --------------------------------------------------------------------------------------------


def header_value(
    headers: Iterable[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None] | None, name: str
) -> str | None:
    """First header named ``name`` (case-insensitive) as text, or None. Never raises."""
    if not headers:
        return None
    try:
        items = headers.items() if isinstance(headers, Mapping) else headers
        lname = name.lower()
        for item in items:
            k, v = item[0], item[1]
            if isinstance(k, bytes):
                k = k.decode("utf-8", "replace")
            if not isinstance(k, str) or k.lower() != lname:
                continue
            if v is None:
                return None
            if isinstance(v, str):
                return v
            return bytes(v).decode("utf-8", "replace")
    except Exception:  # malformed header list: treat as absent
        return None
    return None


def resolve_content_type(value: bytes | bytearray | memoryview, content_type: str | None) -> str:
    """The canonical content type: from the header text if given, else sniffed from the bytes.

    Raises ``unsupported_content_type`` for a header naming anything but msgpack/JSON.
    """
    if content_type is not None and content_type.strip():
        base = content_type.split(";", 1)[0].strip().lower()
        canonical = _CT_ALIASES.get(base)
        if canonical is None:
            raise ContractError(
                ErrorCode.UNSUPPORTED_CONTENT_TYPE,
                "$",
                f"content-type {content_type[:100]!r} is not {CONTENT_TYPE_MSGPACK} or {CONTENT_TYPE_JSON}",
            )
        return canonical
    for b in bytes(value[:64]):
        if b in b" \t\r\n":
            continue
        return CONTENT_TYPE_JSON if b == 0x7B else CONTENT_TYPE_MSGPACK  # '{'
    return CONTENT_TYPE_MSGPACK


# --------------------------------------------------------------------------------------------
# msgspec error -> ContractError
# --------------------------------------------------------------------------------------------

_AT_RE = re.compile(r"^(?P<msg>.*?) - at `(?P<path>\$[^`]*)`$", re.S)
_KEY_IN_RE = re.compile(r"^(?P<msg>.*?) - at `key` in `(?P<path>\$[^`]*)`$", re.S)
_MISSING_RE = re.compile(r"^Object missing required field `(?P<name>[^`]*)`")
_CONSTRAINT_RE = re.compile(
    r"^Expected `[^`]*` (>=|<=|>|<|that's a multiple of|of length|matching regex)"
    r"|out of range"
)
_POSE_PREFIXES = ("$.egomotion", "$.future_egomotion")


def _map_validation_error(exc: msgspec.ValidationError, kind: _Kind) -> ContractError:
    text = str(exc)
    path = "$"
    msg = text
    m = _KEY_IN_RE.match(text)
    if m:
        path, msg = m["path"], m["msg"] + " (in a key)"
    else:
        m = _AT_RE.match(text)
        if m:
            path, msg = m["path"], m["msg"]
    missing = _MISSING_RE.match(msg)
    if missing:
        return ContractError(ErrorCode.MISSING_FIELD, f"{path}.{missing['name']}", f"required field {missing['name']!r} is missing")
    if msg.startswith("Invalid enum value"):
        if path == "$.task" and kind is _REQUEST:
            return ContractError(ErrorCode.UNKNOWN_TASK, path, msg)
        return ContractError(ErrorCode.OUT_OF_RANGE, path, msg)
    if _CONSTRAINT_RE.search(msg):
        code = ErrorCode.OUT_OF_RANGE
        if kind is _REQUEST and path.startswith(_POSE_PREFIXES):
            code = ErrorCode.BAD_EGOMOTION
        return ContractError(code, path, msg)
    return ContractError(ErrorCode.WRONG_TYPE, path, msg)


# --------------------------------------------------------------------------------------------
# generic decode
# --------------------------------------------------------------------------------------------


def _ids_from(env: dict[str, msgspec.Raw], any_dec) -> tuple[str | None, str | None]:
    out: list[str | None] = []
    for name in ("request_id", "run_id"):
        raw = env.get(name)
        v = None
        if raw is not None and len(raw) <= 1024:
            try:
                v = any_dec.decode(raw)
            except Exception:
                v = None
        out.append(v if isinstance(v, str) and _valid_id(v) else None)
    return out[0], out[1]


def _header_id(headers, name: str) -> str | None:
    v = header_value(headers, name)
    return v if v is not None and _valid_id(v) else None


def _decode(value, headers, max_bytes: int, kind: _Kind):
    """Returns (message, unknown top-level field names). Raises ContractError only."""
    rid = _header_id(headers, HEADER_REQUEST_ID)
    run = _header_id(headers, HEADER_RUN_ID)
    try:
        if value is None:
            raise ContractError(ErrorCode.UNDECODABLE_BYTES, "$", "message value is null (tombstone)")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ContractError(
                ErrorCode.UNDECODABLE_BYTES, "$", f"message value is {type(value).__name__}, not bytes"
            )
        size = value.nbytes if isinstance(value, memoryview) else len(value)
        if size == 0:
            raise ContractError(ErrorCode.UNDECODABLE_BYTES, "$", "message value is empty")
        if size > max_bytes:
            raise ContractError(ErrorCode.OVERSIZE, "$", f"message is {size} bytes, limit {max_bytes}")
        ct = resolve_content_type(value, header_value(headers, HEADER_CONTENT_TYPE))
        fmt = "JSON" if ct == CONTENT_TYPE_JSON else "msgpack"

        # -- envelope pass -----------------------------------------------------------------
        try:
            env = _ENVELOPE_DECODERS[ct].decode(value)
        except msgspec.ValidationError as exc:  # not a map / non-string keys
            err = _map_validation_error(exc, kind)
            raise ContractError(ErrorCode.WRONG_TYPE, err.field, f"{fmt} message must be an object: {err.message}") from None
        except msgspec.DecodeError as exc:
            raise ContractError(ErrorCode.UNDECODABLE_BYTES, "$", f"not valid {fmt}: {exc}") from None
        any_dec = _ANY_DECODERS[ct]
        env_rid, env_run = _ids_from(env, any_dec)
        rid = env_rid or rid
        run = env_run or run
        raw_version = env.get("schema_version")
        if raw_version is not None:
            try:
                version = any_dec.decode(raw_version)
            except Exception:
                version = None
            if type(version) is not int:
                raise ContractError(
                    ErrorCode.WRONG_TYPE, "$.schema_version", f"schema_version must be an integer, got {type(version).__name__}"
                )
            if version not in SUPPORTED_SCHEMA_VERSIONS:
                supported = ",".join(str(v) for v in sorted(SUPPORTED_SCHEMA_VERSIONS))
                raise ContractError(
                    ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
                    "$.schema_version",
                    f"schema_version {version} is not supported (supported: {supported})",
                )
        unknown = [k for k in env if k not in kind.fields]
        del env

        # -- typed pass --------------------------------------------------------------------
        try:
            msg = kind.decoders[ct].decode(value)
        except msgspec.ValidationError as exc:
            raise _map_validation_error(exc, kind) from None
        except msgspec.DecodeError as exc:
            raise ContractError(ErrorCode.UNDECODABLE_BYTES, "$", f"not valid {fmt}: {exc}") from None
        return msg, unknown
    except ContractError as err:
        raise err.with_ids(rid, run) from None
    except (RecursionError, MemoryError) as exc:
        raise ContractError(
            ErrorCode.UNDECODABLE_BYTES, "$", f"{type(exc).__name__} while decoding (nested too deep or too large)",
            request_id=rid, run_id=run,
        ) from None
    except Exception as exc:  # anything msgspec or the bytes might still throw
        raise ContractError(
            ErrorCode.UNDECODABLE_BYTES, "$", f"{type(exc).__name__}: {exc}"[:500], request_id=rid, run_id=run
        ) from None


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


def decode_request_with_warnings(
    value: bytes | bytearray | memoryview | None,
    headers: Iterable[tuple[str, bytes | None]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    k_values: Collection[int] | None = None,
) -> tuple[InferRequest, list[str]]:
    """Like :func:`decode_request`, also returning the non-fatal warnings for the result
    (unknown top-level fields, fields the task ignores)."""
    req, unknown = _decode(value, headers, max_bytes, _REQUEST)
    try:
        validate_request(req, k_values=k_values)
        warnings = request_warnings(req, unknown)
    except ContractError as err:
        raise err.with_ids(req.request_id, req.run_id) from None
    except Exception as exc:  # a bug in validation must still come out as a ContractError
        raise ContractError(
            ErrorCode.INTERNAL_ERROR, "$", f"validation crashed: {type(exc).__name__}: {exc}"[:500],
            request_id=req.request_id, run_id=req.run_id,
        ) from None
    return req, warnings


def decode_request(
    value: bytes | bytearray | memoryview | None,
    headers: Iterable[tuple[str, bytes | None]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    *,
    k_values: Collection[int] | None = None,
) -> InferRequest:
    """Decode and validate one request value. Raises :class:`ContractError` and nothing else.

    ``headers``: the Kafka record headers (``content-type`` picks the format). ``k_values``: the
    deployment's served K values (enables ``k_not_served``); None skips that check.
    """
    return decode_request_with_warnings(value, headers, max_bytes, k_values=k_values)[0]


def _check_ct(content_type: str) -> str:
    ct = _CT_ALIASES.get(content_type.split(";", 1)[0].strip().lower())
    if ct is None:
        raise ValueError(f"content_type must be {CONTENT_TYPE_MSGPACK} or {CONTENT_TYPE_JSON}, not {content_type!r}")
    return ct


def _base_headers(ct: str, version: int, request_id: str | None, run_id: str | None) -> Headers:
    headers: Headers = [
        (HEADER_CONTENT_TYPE, ct.encode()),
        (HEADER_SCHEMA_VERSION, str(version).encode()),
    ]
    if request_id is not None:
        headers.append((HEADER_REQUEST_ID, request_id.encode("utf-8")))
    if run_id is not None:
        headers.append((HEADER_RUN_ID, run_id.encode("utf-8")))
    return headers


def encode_request(
    req: InferRequest, content_type: str = CONTENT_TYPE_MSGPACK, *, validate: bool = False
) -> tuple[bytes, Headers]:
    """(value, headers) of a request. ``validate=True`` runs :func:`validate_request` first
    (raising :class:`ContractError`); the Kafka key is :func:`request_key`."""
    ct = _check_ct(content_type)
    if validate:
        validate_request(req)
    return _ENCODERS[ct].encode(req), _base_headers(ct, req.schema_version, req.request_id, req.run_id)


def request_key(req: InferRequest | str) -> bytes:
    """Kafka key of a request (and its result): the request_id in utf-8."""
    return (req if isinstance(req, str) else req.request_id).encode("utf-8")


result_key = request_key


# --------------------------------------------------------------------------------------------
# results and dead letters
# --------------------------------------------------------------------------------------------


def encode_result(res: InferResult, content_type: str = CONTENT_TYPE_MSGPACK) -> tuple[bytes, Headers]:
    """(value, headers) of a result; key with :func:`result_key`.

    JSON cannot carry NaN/inf (msgspec writes null, which does not decode back); the worker turns
    non-finite model output into an ``inference_failed`` dead letter instead.
    """
    ct = _check_ct(content_type)
    return _ENCODERS[ct].encode(res), _base_headers(ct, res.schema_version, res.request_id, res.run_id)


def decode_result(
    value: bytes | bytearray | memoryview | None,
    headers: Iterable[tuple[str, bytes | None]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> InferResult:
    """Decode a result value (msgpack or JSON). Raises :class:`ContractError` only."""
    return _decode(value, headers, max_bytes, _RESULT)[0]


def encode_dead_letter(dl: DeadLetter, content_type: str = CONTENT_TYPE_MSGPACK) -> tuple[bytes, Headers]:
    """(value, headers) of a dead letter (headers add ``error-code``); key with :func:`dead_letter_key`."""
    ct = _check_ct(content_type)
    headers = _base_headers(ct, dl.schema_version, dl.request_id, dl.run_id)
    headers.append((HEADER_ERROR_CODE, dl.error_code.value.encode()))
    return _ENCODERS[ct].encode(dl), headers


def decode_dead_letter(
    value: bytes | bytearray | memoryview | None,
    headers: Iterable[tuple[str, bytes | None]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> DeadLetter:
    """Decode a dead-letter value (msgpack or JSON). Raises :class:`ContractError` only."""
    return _decode(value, headers, max_bytes, _DEAD_LETTER)[0]


def json_schema(kind: Literal["request", "result", "dead_letter"]) -> dict[str, Any]:
    """JSON Schema (2020-12) of a message type, with every field's description."""
    typ = {"request": InferRequest, "result": InferResult, "dead_letter": DeadLetter}[kind]
    return msgspec.json.schema(typ)


assert SCHEMA_VERSION in SUPPORTED_SCHEMA_VERSIONS
