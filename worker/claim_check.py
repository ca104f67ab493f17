"""Claim-check fetching: the bytes behind an ``ImageRef`` URI, bounded and verified.

Only ``file://`` is built in. A file URI is served only when its real path (symlinks resolved)
lies inside one of ``ALPAMAYO_CLAIM_CHECK_ROOTS`` (comma list of ``file:///dir/`` URIs or plain
directories); a path with a ``..`` segment is refused before anything is resolved. The read is
capped at the reference's declared ``size`` (+1 byte to detect a longer file) and at
``max_bytes``; size and SHA-256 are then checked with :func:`schemas.verify_claim_check`.

Other schemes (``s3://``, ``https://``) are added with :meth:`ClaimCheckFetcher.register`: a
callable ``(uri, limit) -> bytes`` that returns at most ``limit`` bytes and raises ``OSError`` /
``ValueError`` with a readable message when it cannot.

Every failure is a :class:`schemas.ContractError` with code ``claim_check_failed`` and the image's
field path (``$.images[3]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from urllib.parse import unquote, urlsplit

from schemas import ContractError, ErrorCode, ImageRef, verify_claim_check

__all__ = ["ClaimCheckFetcher", "SchemeFetcher", "normalize_roots"]

SchemeFetcher = Callable[[str, int], bytes]
"""(uri, limit) -> at most ``limit`` bytes; raises OSError/ValueError on failure."""

DEFAULT_MAX_BYTES = 64 << 20
"""Largest single claim-checked image accepted (64 MiB)."""


def normalize_roots(roots: Iterable[str]) -> tuple[str, ...]:
    """Allowed roots as real directory paths (``file:///data/`` and ``/data`` are the same root)."""
    out = []
    for raw in roots:
        raw = raw.strip()
        if not raw:
            continue
        if raw.startswith("file:"):
            parts = urlsplit(raw)
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"claim-check root {raw!r}: only local file:// roots are supported")
            raw = unquote(parts.path)
        if not os.path.isabs(raw):
            raise ValueError(f"claim-check root {raw!r} must be an absolute path or a file:/// URI")
        out.append(os.path.realpath(raw))
    return tuple(dict.fromkeys(out))


class ClaimCheckFetcher:
    """Fetches and verifies claim-checked image bytes (thread-safe, blocking I/O)."""

    def __init__(self, roots: Iterable[str] = (), max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.roots = normalize_roots(roots)
        self.max_bytes = int(max_bytes)
        self._schemes: dict[str, SchemeFetcher] = {"file": self._fetch_file}

    def register(self, scheme: str, fetcher: SchemeFetcher) -> None:
        """Serve ``scheme://`` URIs with ``fetcher`` (e.g. an object-store client)."""
        self._schemes[scheme.lower()] = fetcher

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(sorted(self._schemes))

    def fetch(self, ref: ImageRef, field: str = "$.images") -> bytes:
        """The verified bytes of ``ref``. Raises ContractError(claim_check_failed, field, ...)."""
        if ref.size > self.max_bytes:
            raise ContractError(ErrorCode.CLAIM_CHECK_FAILED, field,
                                f"{_short(ref.uri)}: declared size {ref.size} exceeds the limit {self.max_bytes}")
        scheme = urlsplit(ref.uri).scheme.lower()
        fetcher = self._schemes.get(scheme)
        if fetcher is None:
            raise ContractError(ErrorCode.CLAIM_CHECK_FAILED, field,
                                f"{_short(ref.uri)}: scheme {scheme or '(none)'!r} is not supported "
                                f"(supported: {', '.join(self.schemes)})")
        try:
            data = fetcher(ref.uri, ref.size + 1)
        except ContractError as err:
            raise ContractError(ErrorCode.CLAIM_CHECK_FAILED, field, err.message) from None
        except (OSError, ValueError) as exc:
            msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ContractError(ErrorCode.CLAIM_CHECK_FAILED, field, f"{_short(ref.uri)}: {msg}") from None
        verify_claim_check(ref, data, field=field)
        return data

    # ------------------------------------------------------------------ file://
    def _fetch_file(self, uri: str, limit: int) -> bytes:
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URI host {parts.netloc!r} is not local")
        if parts.query or parts.fragment:
            raise ValueError("file URI must not carry a query or fragment")
        path = unquote(parts.path)
        if "\x00" in path:
            raise ValueError("file URI path contains a NUL byte")
        if not path.startswith("/"):
            raise ValueError("file URI path must be absolute")
        if any(seg == ".." for seg in path.split("/")):
            raise ValueError("path traversal ('..') is not allowed")
        if not self.roots:
            raise ValueError("file:// claim checks are disabled: no ALPAMAYO_CLAIM_CHECK_ROOTS configured")
        real = os.path.realpath(path)
        if not any(real == root or real.startswith(root.rstrip("/") + "/") for root in self.roots):
            raise ValueError("path is outside the allowed claim-check roots")
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0))     # a FIFO must not block: S_ISREG below refuses it
        try:
            import stat

            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            chunks, left = [], limit
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


def _short(uri: str, n: int = 200) -> str:
    return uri if len(uri) <= n else uri[: n - 3] + "..."
