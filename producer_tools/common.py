"""Helpers shared by the producer tools: Kafka connection settings, atomic files, run ids.

Kafka connection: the tools read the same environment variables as the worker
(``ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS``, ``ALPAMAYO_KAFKA_SECURITY_PROTOCOL``,
``ALPAMAYO_KAFKA_SASL_*``, ``ALPAMAYO_KAFKA_SSL_CAFILE``, the three ``ALPAMAYO_*_TOPIC`` names),
parsed by :func:`worker.config.load_settings`, so a user configures both sides the same way.
Only the Kafka-related variables are handed to it, so an unrelated worker variable (a model
profile, say) never stops a producer tool. Command-line flags override the environment.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import secrets
import sys
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, NoReturn

from worker.config import load_settings
from worker.kafka_clients import kafka_preflight, security_kwargs

__all__ = [
    "KAFKA_ENV_VARS",
    "KafkaOptions",
    "kafka_options",
    "check_brokers",
    "client_kwargs",
    "atomic_write_bytes",
    "fsync_dir",
    "new_run_id",
    "percentile",
    "die",
    "ToolError",
    "parse_size",
]

KAFKA_ENV_VARS = (
    "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS",
    "ALPAMAYO_REQUEST_TOPIC",
    "ALPAMAYO_RESULT_TOPIC",
    "ALPAMAYO_DEAD_LETTER_TOPIC",
    "ALPAMAYO_KAFKA_SECURITY_PROTOCOL",
    "ALPAMAYO_KAFKA_SASL_MECHANISM",
    "ALPAMAYO_KAFKA_SASL_USERNAME",
    "ALPAMAYO_KAFKA_SASL_PASSWORD",
    "ALPAMAYO_KAFKA_SSL_CAFILE",
    "ALPAMAYO_KAFKA_WAIT_S",
    "ALPAMAYO_CACHE",
)


class ToolError(RuntimeError):
    """A user-facing failure: printed as one line, exit status 2."""


def die(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


@dataclass(frozen=True)
class KafkaOptions:
    bootstrap_servers: str
    request_topic: str
    result_topic: str
    dead_letter_topic: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    kafka_wait_s: float = 5.0           # how long check_brokers waits for a reachable broker


def kafka_options(env: Mapping[str, str] | None = None, **overrides: Any) -> KafkaOptions:
    """Kafka settings from the worker's environment variables (worker.config), then overrides
    (None values are ignored). Raises worker.config.ConfigError on bad configuration."""
    env = os.environ if env is None else env
    s = load_settings({k: v for k, v in env.items() if k in KAFKA_ENV_VARS})
    opts = KafkaOptions(
        bootstrap_servers=s.bootstrap_servers,
        request_topic=s.request_topic,
        result_topic=s.result_topic,
        dead_letter_topic=s.dead_letter_topic,
        security_protocol=s.security_protocol,
        sasl_mechanism=s.sasl_mechanism,
        sasl_username=s.sasl_username,
        sasl_password=s.sasl_password,
        ssl_cafile=str(s.ssl_cafile) if s.ssl_cafile else None,
        kafka_wait_s=s.kafka_wait_s,
    )
    return replace(opts, **{k: v for k, v in overrides.items() if v is not None})


def check_brokers(opts: KafkaOptions) -> None:
    """The worker's startup preflight for a tool: one connection to a bootstrap server, before any
    client starts. Raises ConfigError (one line naming --bootstrap-servers and the variable)."""
    asyncio.run(kafka_preflight(opts, client_id="alpamayo-producer-preflight",  # type: ignore[arg-type]
                                address_names="--bootstrap-servers or ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS"))


def client_kwargs(opts: KafkaOptions) -> dict[str, Any]:
    """Keyword arguments for any aiokafka client (producer, consumer, admin): the bootstrap
    servers plus the worker's own security settings (worker.kafka_clients.security_kwargs)."""
    return {"bootstrap_servers": opts.bootstrap_servers, **security_kwargs(opts)}


def metric_sum(base_url: str | None, prefix: str) -> float:
    """Sum of a worker's Prometheus samples whose line starts with `prefix` (a metric name, with
    the opening of a label set to pick series: 'alpamayo_engine_seconds_total{phase="infer"'), read
    from `base_url`/v1/metrics; 0.0 when the worker does not answer."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/metrics", timeout=3) as r:
            text = r.read().decode()
    except (OSError, TypeError, ValueError):
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix):
            try:
                total += float(line.split()[-1])
            except ValueError:
                pass
    return total


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Iterable[bytes]) -> Path:
    """Write to a temp file in the same directory, fsync, rename over ``path``, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                for chunk in data:
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


# --------------------------------------------------------------------------------------------
# misc
# --------------------------------------------------------------------------------------------


def new_run_id(prefix: str = "run") -> str:
    """``run-YYYYmmddTHHMMSSZ-<6 hex>``: sortable, unique, in the contract's id character set."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{prefix}-{now}-{secrets.token_hex(3)}"


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def parse_size(text: str) -> int:
    """``900KiB``, ``1MiB``, ``1048576``, ``2M`` -> bytes."""
    t = text.strip()
    units = {"kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
             "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "b": 1}
    low = t.lower()
    for u in sorted(units, key=len, reverse=True):
        if low.endswith(u):
            num = low[: -len(u)].strip()
            return int(float(num) * units[u])
    return int(t)
