"""Stable error codes of the wire contract and the one exception type that carries them.

Every problem a message can have - from bytes that are not msgpack/JSON at all to a model
runtime failure - is reported as a :class:`ContractError` with

* ``code``: an :class:`ErrorCode` (stable snake_case string; it is what dead letters, metrics
  labels and dashboards key on, so codes are never renamed within a ``schema_version``),
* ``field``: a JSON path into the request (``$`` = the whole message, ``$.temperature``,
  ``$.egomotion.ego_history_xyz[3]``),
* ``message``: one human-readable line.

No torch, numpy or Kafka import here: producers import this module too.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ErrorCode", "ContractError", "RETRYABLE_CODES"]


class ErrorCode(StrEnum):
    """Stable machine-readable reason why a request did not produce a result.

    The first group is raised while decoding/validating a request (``schemas.codec``), the
    second by the worker after decoding (serving configuration, claim check, model runtime).
    """

    # -- decoding (bytes -> message) -------------------------------------------------------
    UNDECODABLE_BYTES = "undecodable_bytes"
    """The value is empty/None, not msgpack/JSON, truncated, not an object, or nested absurdly deep."""
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    """The ``content-type`` header names neither ``application/msgpack`` nor ``application/json``."""
    UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
    """``schema_version`` is not one this build understands (see ``SUPPORTED_SCHEMA_VERSIONS``)."""
    OVERSIZE = "oversize"
    """The message value is larger than the configured byte limit (128 MiB by default)."""
    # -- field validation ------------------------------------------------------------------
    MISSING_FIELD = "missing_field"
    """A required field is absent (``request_id``, ``images``; ``question`` for vqa/grounding)."""
    WRONG_TYPE = "wrong_type"
    """A field has the wrong type (string where a number is expected, bad base64, ...)."""
    OUT_OF_RANGE = "out_of_range"
    """A value violates a documented range/length/pattern (temperature 0..2, 1..16 samples, ...)."""
    # -- images ----------------------------------------------------------------------------
    BAD_IMAGE = "bad_image"
    """An image is empty, not JPEG/PNG/WebP/BMP, or its header cannot be read."""
    IMAGE_COUNT_MISMATCH = "image_count_mismatch"
    """``len(images)`` != number of cameras x ``num_frames_per_camera``."""
    IMAGE_SIZE_MISMATCH = "image_size_mismatch"
    """Images of one request do not all have the same width x height."""
    # -- sampling / serving ----------------------------------------------------------------
    K_NOT_SERVED = "k_not_served"
    """``num_traj_samples`` is not one of the K values this deployment warmed up."""
    K_REQUIRES_TEMPERATURE = "k_requires_temperature"
    """``num_traj_samples`` > 1 with ``temperature`` == 0 (K > 1 needs sampling)."""
    # -- egomotion -------------------------------------------------------------------------
    MISSING_EGOMOTION = "missing_egomotion"
    """trajectory / meta_action / auto_labeling request without ``egomotion``."""
    MISSING_FUTURE_EGOMOTION = "missing_future_egomotion"
    """auto_labeling request without ``future_egomotion``."""
    BAD_EGOMOTION = "bad_egomotion"
    """Egomotion of the wrong shape, with NaN/inf, both or neither of rot/quat, or a zero quaternion."""
    # -- worker side -----------------------------------------------------------------------
    CLAIM_CHECK_FAILED = "claim_check_failed"
    """An ``ImageRef`` could not be fetched, or its bytes do not match ``size``/``sha256``."""
    UNKNOWN_TASK = "unknown_task"
    """``task`` is not one of the contract's tasks (or not one this worker serves)."""
    INFERENCE_FAILED = "inference_failed"
    """The model runtime failed on this request (e.g. out of memory, non-finite output)."""
    INTERNAL_ERROR = "internal_error"
    """A bug or unexpected condition in the worker."""

    @property
    def retryable(self) -> bool:
        """True for codes whose cause may be transient (a retry of the same bytes may succeed)."""
        return self in RETRYABLE_CODES


RETRYABLE_CODES: frozenset[ErrorCode] = frozenset(
    {ErrorCode.CLAIM_CHECK_FAILED, ErrorCode.INFERENCE_FAILED, ErrorCode.INTERNAL_ERROR}
)
"""Codes a dead-letter replay may reasonably retry; every other code is a property of the bytes."""


class ContractError(Exception):
    """A message violates the wire contract (or could not be served).

    Attributes:
        code: the stable :class:`ErrorCode`.
        field: JSON path of the offending value; ``$`` for the whole message.
        message: one human-readable line.
        request_id: the message's ``request_id`` when it could be read (for dead letters), else None.
        run_id: the message's ``run_id`` when it could be read, else None.
    """

    code: ErrorCode
    field: str
    message: str
    request_id: str | None
    run_id: str | None

    def __init__(
        self,
        code: ErrorCode | str,
        field: str = "$",
        message: str = "",
        *,
        request_id: str | None = None,
        run_id: str | None = None,
    ) -> None:
        code = ErrorCode(code)
        super().__init__(code, field, message)
        self.code = code
        self.field = field or "$"
        self.message = message or code.value.replace("_", " ")
        self.request_id = request_id
        self.run_id = run_id

    def __str__(self) -> str:
        return f"{self.code.value} at {self.field}: {self.message}"

    def __repr__(self) -> str:
        return f"ContractError({self.code.value!r}, {self.field!r}, {self.message!r})"

    def __reduce__(self):  # keep request_id/run_id across pickling (process pools, logging)
        return (
            _rebuild_contract_error,
            (self.code.value, self.field, self.message, self.request_id, self.run_id),
        )

    def with_ids(self, request_id: str | None, run_id: str | None) -> ContractError:
        """Fill in ``request_id``/``run_id`` where not yet known; returns self."""
        if self.request_id is None:
            self.request_id = request_id
        if self.run_id is None:
            self.run_id = run_id
        return self


def _rebuild_contract_error(code, field, message, request_id, run_id) -> ContractError:
    return ContractError(code, field, message, request_id=request_id, run_id=run_id)
