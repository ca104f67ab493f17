"""A minimal Kafka wire-protocol client that tells whether a local broker is ready.

Stdlib only (no Kafka client library in the system python). Two requests are enough:
ApiVersions v0 (the listener answers, TLS included) and Metadata v4..v8 for no topics (the brokers
the cluster has registered and its cluster id). Only unfenced (registered, caught-up) brokers are
listed by a KRaft broker, so "Metadata lists every node" is the readiness test of the cluster.
Both requests use the classic (non-flexible) encoding, which the pinned Kafka (pom.xml) answers;
a broker that does not is reported as not ready, naming the versions it offers.
"""

from __future__ import annotations

import socket
import ssl
import struct

API_METADATA = 3
API_VERSIONS = 18
METADATA_VERSIONS = (4, 8)  # the newest non-flexible ones: plain int16-length strings, no tagged fields


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the broker")
        buf += chunk
    return bytes(buf)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str | None:
        n = self.take(">h")
        if n < 0:
            return None
        s = self.data[self.pos:self.pos + n].decode()
        self.pos += n
        return s


def _roundtrip(sock: socket.socket, api_key: int, version: int, body: bytes, corr: int) -> _Reader:
    cid = b"alpamayo-local-probe"
    msg = struct.pack(">hhih", api_key, version, corr, len(cid)) + cid + body  # request header v1
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    size = struct.unpack(">i", _recv_exact(sock, 4))[0]
    r = _Reader(_recv_exact(sock, size))
    got = r.take(">i")
    if got != corr:
        raise ConnectionError(f"correlation id mismatch ({got} != {corr})")
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
    r = _roundtrip(sock, API_VERSIONS, 0, b"", corr=1)
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

    Returns ``{"brokers": {node_id: (host, port)}, "cluster_id": str|None, "controller_id": int,
    "metadata_version": int}``. Raises OSError on failure, also when the broker offers no Metadata
    version in ``METADATA_VERSIONS``.
    """
    with _connect(host, port, timeout, ssl_context) as sock:
        lo, hi = _api_versions(sock).get(API_METADATA, METADATA_VERSIONS)
        v = min(hi, METADATA_VERSIONS[1])
        if v < max(lo, METADATA_VERSIONS[0]):
            raise ConnectionError(f"the broker offers Metadata v{lo}..v{hi}; this probe speaks "
                                  f"v{METADATA_VERSIONS[0]}..v{METADATA_VERSIONS[1]}")
        body = struct.pack(">ib", 0, 0)  # topics: empty array, allow_auto_topic_creation=false
        if v >= 8:
            body += struct.pack(">bb", 0, 0)  # include cluster/topic authorized operations: false
        r = _roundtrip(sock, API_METADATA, v, body, corr=2)
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
        return {"brokers": brokers, "cluster_id": cluster_id, "controller_id": controller,
                "metadata_version": v}
