"""A minimal Kafka wire-protocol client that tells whether a local broker is ready.

Stdlib only (no Kafka client library in the system python). Two requests are enough:
ApiVersions (the listener answers, TLS included) and Metadata for no topics (the brokers the
cluster has registered and its cluster id). Only unfenced (registered, caught-up) brokers are
listed by a KRaft broker, so "Metadata lists every node" is the readiness test of the cluster.
"""

from __future__ import annotations

import socket
import ssl
import struct

API_METADATA = 3
API_VERSIONS = 18


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the broker")
        buf += chunk
    return bytes(buf)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def uvarint(self) -> int:
        shift = result = 0
        while True:
            b = self.data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def string(self) -> str | None:
        n = self.take(">h")
        if n < 0:
            return None
        s = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return s

    def compact_string(self) -> str | None:
        n = self.uvarint() - 1
        if n < 0:
            return None
        s = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return s

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()


def _roundtrip(sock: socket.socket, api_key: int, version: int, body: bytes, *, flexible: bool,
               corr: int = 1) -> _Reader:
    cid = b"alpamayo-local-probe"
    header = struct.pack(">hhih", api_key, version, corr, len(cid)) + cid
    if flexible:
        header += b"\x00"  # request header v2: empty tagged fields
    msg = header + body
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    size = struct.unpack(">i", _recv_exact(sock, 4))[0]
    r = _Reader(_recv_exact(sock, size))
    got = r.take(">i")
    if got != corr:
        raise ConnectionError(f"correlation id mismatch ({got} != {corr})")
    if flexible and api_key != API_VERSIONS:  # ApiVersions responses always use header v0
        r.skip_tags()
    return r


def _connect(host: str, port: int, timeout: float, ssl_context: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(timeout)
    if ssl_context is not None:
        try:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
    return sock


def _api_versions(sock: socket.socket) -> dict[int, tuple[int, int]]:
    r = _roundtrip(sock, API_VERSIONS, 0, b"", flexible=False)
    err = r.take(">h")
    out: dict[int, tuple[int, int]] = {}
    for _ in range(r.take(">i")):
        key, lo, hi = r.take(">hhh")
        out[key] = (lo, hi)
    if err and not out:
        raise ConnectionError(f"ApiVersions error code {err}")
    return out


def probe_api_versions(host: str, port: int, timeout: float = 3.0,
                       ssl_context: ssl.SSLContext | None = None) -> dict[int, tuple[int, int]]:
    """Send a real ApiVersions request; return {api_key: (min, max)}. Raises OSError on failure."""
    with _connect(host, port, timeout, ssl_context) as sock:
        return _api_versions(sock)


def probe_metadata(host: str, port: int, timeout: float = 3.0,
                   ssl_context: ssl.SSLContext | None = None) -> dict:
    """ApiVersions + a Metadata request for no topics on a PLAINTEXT (or TLS, no SASL) listener.

    Returns ``{"brokers": {node_id: (host, port)}, "cluster_id": str|None, "controller_id": int}``.
    Only unfenced (registered, caught-up) brokers are listed by a KRaft broker.
    """
    with _connect(host, port, timeout, ssl_context) as sock:
        versions = _api_versions(sock)
        lo, hi = versions.get(API_METADATA, (4, 8))
        if lo <= 8 and hi >= 4:
            v = min(hi, 8)
            body = struct.pack(">ib", 0, 0)  # topics: empty array, allow_auto_topic_creation=false
            if v >= 8:
                body += struct.pack(">bb", 0, 0)
            r = _roundtrip(sock, API_METADATA, v, body, flexible=False, corr=2)
            r.take(">i")  # throttle_time_ms
            brokers = {}
            for _ in range(r.take(">i")):
                node = r.take(">i")
                bhost = r.string()
                bport = r.take(">i")
                r.string()  # rack
                brokers[node] = (bhost, bport)
            cluster_id = r.string()
            controller = r.take(">i")
        else:
            v = min(hi, 12)
            body = _uvarint(1) + b"\x00"  # topics: empty compact array, allow_auto_topic_creation
            if v <= 10:
                body += b"\x00"  # include_cluster_authorized_operations
            body += b"\x00" + b"\x00"  # include_topic_authorized_operations, tagged fields
            r = _roundtrip(sock, API_METADATA, v, body, flexible=True, corr=2)
            r.take(">i")
            brokers = {}
            for _ in range(r.uvarint() - 1):
                node = r.take(">i")
                bhost = r.compact_string()
                bport = r.take(">i")
                r.compact_string()
                r.skip_tags()
                brokers[node] = (bhost, bport)
            cluster_id = r.compact_string()
            controller = r.take(">i")
        return {"brokers": brokers, "cluster_id": cluster_id, "controller_id": controller,
                "metadata_version": v}
