"""Wire contract of the Alpamayo 2 Super Kafka worker (see docs/contract.md).

Message types (msgspec Structs): :class:`InferRequest` (requests topic), :class:`InferResult`
(results topic), :class:`DeadLetter` (dead-letter topic). Codecs: :func:`decode_request`
(untrusted bytes -> validated request, raises :class:`ContractError` only), the ``encode_*`` /
``decode_*`` pairs, header names and Kafka key helpers. No torch import anywhere in this package.
"""

from .codec import (
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_MSGPACK,
    CONTENT_TYPES,
    DEFAULT_MAX_BYTES,
    HEADER_CONTENT_TYPE,
    HEADER_ERROR_CODE,
    HEADER_REQUEST_ID,
    HEADER_RUN_ID,
    HEADER_SCHEMA_VERSION,
    ContentType,
    Headers,
    decode_dead_letter,
    decode_request,
    decode_request_with_warnings,
    decode_result,
    encode_dead_letter,
    encode_request,
    encode_result,
    header_value,
    json_schema,
    request_key,
    resolve_content_type,
    result_key,
)
from .dead_letter import (
    HEADER_ATTEMPT,
    HEADER_REPLAY_OF,
    TRUNCATION_HEADER,
    DeadLetter,
    SourceCoordinates,
    dead_letter_from_error,
    dead_letter_key,
    normalize_headers,
)
from .errors import RETRYABLE_CODES, ContractError, ErrorCode
from .request import (
    CAMERA_IDS_BY_NAME,
    CAMERAS,
    DEFAULT_CAMERA_ORDER,
    ID_PATTERN,
    IMAGE_CONTENT_TYPES,
    MAX_IMAGES,
    NUM_FUTURE_POSES,
    NUM_HISTORY_POSES,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    TASK_CAMERA_ORDER,
    TASKS,
    TASKS_NEEDING_EGOMOTION,
    TASKS_NEEDING_QUESTION,
    VQA_CAMERA_ORDER,
    Camera,
    CameraName,
    Egomotion,
    FutureEgomotion,
    ImageRef,
    InferRequest,
    Task,
    camera_names_for,
    check_image_blobs,
    image_dimensions,
    request_warnings,
    sniff_image_format,
    validate_request,
    verify_claim_check,
)
from .result import (
    AutoLabel,
    GroundingBox,
    InferResult,
    Lineage,
    MetaAction,
    ModelIdentity,
    ResultMetrics,
    SampleOutput,
    SpeculativeDecoding,
    StageTimings,
    Uncertainty,
)

__all__ = [
    # errors
    "ErrorCode", "ContractError", "RETRYABLE_CODES",
    # request
    "SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "Task", "TASKS", "TASKS_NEEDING_EGOMOTION",
    "TASKS_NEEDING_QUESTION", "CameraName", "Camera", "CAMERAS", "CAMERA_IDS_BY_NAME",
    "DEFAULT_CAMERA_ORDER", "VQA_CAMERA_ORDER", "TASK_CAMERA_ORDER", "camera_names_for",
    "NUM_HISTORY_POSES", "NUM_FUTURE_POSES", "ID_PATTERN", "MAX_IMAGES", "IMAGE_CONTENT_TYPES",
    "ImageRef", "Egomotion", "FutureEgomotion", "InferRequest", "validate_request",
    "request_warnings", "sniff_image_format", "image_dimensions", "check_image_blobs",
    "verify_claim_check",
    # result
    "SpeculativeDecoding", "StageTimings", "ResultMetrics", "MetaAction", "AutoLabel",
    "GroundingBox", "SampleOutput", "ModelIdentity", "Lineage", "Uncertainty", "InferResult",
    # dead letter
    "SourceCoordinates", "DeadLetter", "dead_letter_from_error", "dead_letter_key", "normalize_headers",
    "TRUNCATION_HEADER", "HEADER_REPLAY_OF", "HEADER_ATTEMPT",
    # codec
    "CONTENT_TYPE_MSGPACK", "CONTENT_TYPE_JSON", "CONTENT_TYPES", "ContentType", "Headers",
    "HEADER_CONTENT_TYPE", "HEADER_SCHEMA_VERSION", "HEADER_REQUEST_ID", "HEADER_RUN_ID",
    "HEADER_ERROR_CODE", "DEFAULT_MAX_BYTES", "decode_request", "decode_request_with_warnings",
    "encode_request", "encode_result", "decode_result", "encode_dead_letter", "decode_dead_letter",
    "request_key", "result_key", "header_value", "resolve_content_type", "json_schema",
]
