"""Claim check for ``alpamayo-producer publish``: a ``file://`` object store and the encoding that
moves a request's largest images into it until the message fits.

When a request's message (value + key + headers) would exceed the threshold (default 900 KiB),
its largest images are written to the object store (content-addressed
``sha256/<aa>/<sha256>.<ext>``, written to a temp file, fsynced and renamed) and replaced by
``ImageRef(uri, sha256, size, content_type)`` until the message fits; only then is the message
sent. The worker must allow the store's prefix (``ALPAMAYO_CLAIM_CHECK_ROOTS``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import msgspec

import schemas as S
from producer_tools.common import ToolError, atomic_write_bytes

__all__ = ["DEFAULT_CLAIM_CHECK_THRESHOLD", "ObjectStore", "encode_with_claim_check", "resolve_images"]


DEFAULT_CLAIM_CHECK_THRESHOLD = 900 * 1024
_EXT = {"image/jpeg": ".jpg", "image/png": ".png", "image/webp": ".webp", "image/bmp": ".bmp"}


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
