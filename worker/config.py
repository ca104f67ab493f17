"""Every environment variable the worker reads, parsed once into `Settings`.

Bad configuration raises ConfigError whose message is one line saying what to change; the
entry points print it and exit 2 before anything is loaded.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from schemas import CONTENT_TYPE_JSON, CONTENT_TYPE_MSGPACK
from worker.errors import Refusal

PROFILES = ("bf16", "fp8", "bf16-dflash2", "fp8-dflash2")
SPEC_METRICS = ("summary", "detailed", "none")
LOAD_FORMATS = ("auto", "dummy")       # vLLM's --load-format: weights from the shards, or random of the right shapes
GUARANTEES = ("at_least_once", "exactly_once")
SECURITY = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
DEFAULT_SASL_MECHANISM = "SCRAM-SHA-512"
MAX_K = 16
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
RESULT_FORMATS = {"msgpack": CONTENT_TYPE_MSGPACK, "json": CONTENT_TYPE_JSON}
"""ALPAMAYO_RESULT_FORMAT -> the content type of every result and dead letter the worker writes."""


class ConfigError(Refusal, ValueError):
    """One line: what is wrong and what to change."""


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """ALPAMAYO_CACHE: where the venv, Kafka jars, demo checkpoint and head are cached.

    The one reader of ALPAMAYO_CACHE in Python, with one exception: deploy/local/cluster.py reads
    it itself because it runs on the system python without the venv (see the comment there)."""
    env = os.environ if env is None else env
    return Path(env.get("ALPAMAYO_CACHE") or Path.home() / ".cache" / "alpamayo-worker").expanduser()


@dataclass(frozen=True)
class Settings:
    # --- model (the seed's variables)
    profile: str = "bf16"
    k_values: tuple[int, ...] = (1,)
    spec_metrics: str = "none"
    speculative_model: Path | None = None      # custom head (NIM_ALPAMAYO_SPECULATIVE_MODEL)
    ft_checkpoint: Path | None = None          # NIM_FT_CHECKPOINT; None = embedded demo checkpoint
    load_format: str = "auto"                  # ALPAMAYO_LOAD_FORMAT: auto (the shards) | dummy (random weights)
    max_model_len: int | None = None
    device: str | None = None
    # --- kafka
    bootstrap_servers: str = "127.0.0.1:9092"
    request_topic: str = "alpamayo.requests"
    result_topic: str = "alpamayo.results"
    dead_letter_topic: str = "alpamayo.dead-letters"
    group_id: str = "alpamayo-workers"
    group_instance_id: str | None = None
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: Path | None = None
    processing_guarantee: str = "at_least_once"
    review_topic: str | None = None             # results at or above review_threshold are also published here
    review_threshold: float = 0.5
    result_content_type: str = CONTENT_TYPE_MSGPACK    # ALPAMAYO_RESULT_FORMAT: results and dead letters
    # --- batching, limits, process
    max_batch_size: int = 8
    max_batch_wait_ms: int = 20
    max_inflight: int = 64
    max_request_bytes: int = 128 << 20
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    drain_timeout_s: float = 60.0
    gpu_memory_fraction: float = 0.90           # weights + KV cache + reserve, of the GPU's memory
    kafka_wait_s: float = 5.0                   # startup: how long to wait for a reachable broker
    stats_interval_s: float = 10.0              # the stats line and dead-letter warnings (0: off)
    claim_check_roots: tuple[str, ...] = ()
    worker_id: str = "worker"
    cache: Path = field(default_factory=cache_dir)
    log_level: str = "INFO"
    # --- test/benchmark knob: reasoning-token cap of trajectory requests (None = the release's 256)
    max_reasoning_tokens: int | None = None

    @property
    def precision(self) -> str:
        return self.profile.split("-")[0]

    @property
    def speculative(self) -> bool:
        return self.profile.endswith("-dflash2")


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer: set it to a number in {lo}..{hi}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name}={v} is out of range: set it to a number in {lo}..{hi}")
    return v


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float, what: str,
           low_open: bool = False) -> float:
    """A number in [lo, hi] ((lo, hi] with low_open); ConfigError "<name>=<raw> <what>" otherwise."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not ((lo < v) if low_open else (lo <= v)) or not v <= hi:
        raise ConfigError(f"{name}={raw!r} {what}")
    return v


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw not in choices:
        raise ConfigError(f"{name}={raw!r} is not valid: use one of {', '.join(choices)}")
    return raw


def _k_values(raw: str | None) -> tuple[int, ...]:
    if raw is None or raw.strip() == "":
        return (1,)
    out = []
    for part in raw.split(","):
        part = part.strip()
        if not re.fullmatch(r"\d+", part) or not 1 <= int(part) <= MAX_K:
            raise ConfigError(f"NIM_ALPAMAYO_TRAJ_SAMPLES={raw!r}: each entry must be an integer in 1..{MAX_K}, "
                              f"e.g. NIM_ALPAMAYO_TRAJ_SAMPLES=1,2,3")
        out.append(int(part))
    return tuple(sorted(set(out)))


def _dir(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name)
    return Path(raw) if raw else None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Parse the environment. Raises ConfigError (one line) on bad configuration."""
    env = os.environ if env is None else env
    profile = _choice(env, "NIM_MODEL_PROFILE", PROFILES, None)
    precision = _choice(env, "NIM_PRECISION", ("bf16", "fp8"), None)
    if profile and precision:
        raise ConfigError(f"NIM_MODEL_PROFILE={profile} and NIM_PRECISION={precision} are both set: "
                          "unset NIM_PRECISION (it only selects a baseline profile)")
    profile = profile or precision or "bf16"
    head = _dir(env, "NIM_ALPAMAYO_SPECULATIVE_MODEL")
    ft = _dir(env, "NIM_FT_CHECKPOINT")
    if head and ft:
        raise ConfigError("NIM_ALPAMAYO_SPECULATIVE_MODEL cannot be combined with NIM_FT_CHECKPOINT: "
                          "unset one of them")
    if head and not profile.endswith("-dflash2"):
        raise ConfigError(f"NIM_ALPAMAYO_SPECULATIVE_MODEL is set but the profile is the baseline {profile}: "
                          "select NIM_MODEL_PROFILE=bf16-dflash2 or fp8-dflash2 (and unset NIM_PRECISION)")
    for name, d, what in (("NIM_FT_CHECKPOINT", ft, "checkpoint"), ("NIM_ALPAMAYO_SPECULATIVE_MODEL", head, "DFlash2 head")):
        if d is not None and not d.is_dir():
            raise ConfigError(f"{name}={d} is not a directory: point it at the {what} directory, or unset it")
    spec_metrics = _choice(env, "NIM_ALPAMAYO_SPEC_METRICS", SPEC_METRICS,
                           "summary" if profile.endswith("-dflash2") else "none")
    if not profile.endswith("-dflash2"):
        spec_metrics = "none"       # baseline profiles never emit the block nor the counters
    max_len = env.get("NIM_ALPAMAYO_MAX_MODEL_LEN")
    guarantee = _choice(env, "ALPAMAYO_PROCESSING_GUARANTEE", GUARANTEES, "at_least_once")
    security = _choice(env, "ALPAMAYO_KAFKA_SECURITY_PROTOCOL", SECURITY, "PLAINTEXT")
    mechanism = _choice(env, "ALPAMAYO_KAFKA_SASL_MECHANISM", SASL, None)
    user, password = env.get("ALPAMAYO_KAFKA_SASL_USERNAME"), env.get("ALPAMAYO_KAFKA_SASL_PASSWORD")
    if security.startswith("SASL"):
        if not (user and password):
            raise ConfigError(f"ALPAMAYO_KAFKA_SECURITY_PROTOCOL={security} needs ALPAMAYO_KAFKA_SASL_USERNAME "
                              "and ALPAMAYO_KAFKA_SASL_PASSWORD")
        mechanism = mechanism or DEFAULT_SASL_MECHANISM
    cafile = _dir(env, "ALPAMAYO_KAFKA_SSL_CAFILE")
    if cafile and not cafile.is_file():
        raise ConfigError(f"ALPAMAYO_KAFKA_SSL_CAFILE={cafile} does not exist: point it at the CA certificate (PEM)")
    device = _choice(env, "ALPAMAYO_DEVICE", ("cuda", "cpu"), None)
    host = socket.gethostname()
    instance = env.get("ALPAMAYO_GROUP_INSTANCE_ID") or None
    roots = tuple(r.strip() for r in (env.get("ALPAMAYO_CLAIM_CHECK_ROOTS") or "").split(",") if r.strip())
    for r in roots:
        if not (r.startswith("/") or r.startswith("file:///")):
            raise ConfigError(f"ALPAMAYO_CLAIM_CHECK_ROOTS entry {r!r} is not a local directory: use absolute "
                              "paths or file:/// URIs, e.g. ALPAMAYO_CLAIM_CHECK_ROOTS=file:///data/images/")
    drain = env.get("ALPAMAYO_DRAIN_TIMEOUT_S")
    try:
        drain_s = float(drain) if drain else 60.0
    except ValueError:
        raise ConfigError(f"ALPAMAYO_DRAIN_TIMEOUT_S={drain!r} is not a number of seconds") from None
    gpu_fraction = _float(env, "ALPAMAYO_GPU_MEMORY_FRACTION", 0.90, 0.0, 1.0,
                          "is not a fraction of GPU memory: use a number in (0, 1], e.g. "
                          "ALPAMAYO_GPU_MEMORY_FRACTION=0.90", low_open=True)
    kafka_wait = _float(env, "ALPAMAYO_KAFKA_WAIT_S", 5.0, 0.0, 86400.0,
                        "is not a number of seconds (0 to 86400), e.g. ALPAMAYO_KAFKA_WAIT_S=300 to wait for "
                        "Kafka at startup")
    stats_interval = _float(env, "ALPAMAYO_STATS_INTERVAL_S", 10.0, 0.0, 86400.0,
                            "is not a number of seconds (0 to 86400), e.g. ALPAMAYO_STATS_INTERVAL_S=10 "
                            "(0 turns the stats line off)")
    review_threshold = _float(env, "ALPAMAYO_REVIEW_THRESHOLD", 0.5, 0.0, 1.0,
                              "is not an uncertainty: use a number in [0, 1], e.g. ALPAMAYO_REVIEW_THRESHOLD=0.5")
    if env.get("ALPAMAYO_REVIEW_THRESHOLD") and not env.get("ALPAMAYO_REVIEW_TOPIC"):
        raise ConfigError("ALPAMAYO_REVIEW_THRESHOLD is set but ALPAMAYO_REVIEW_TOPIC is not: set the review topic "
                          "(e.g. ALPAMAYO_REVIEW_TOPIC=alpamayo.review) or unset the threshold")
    for t in ("ALPAMAYO_REQUEST_TOPIC", "ALPAMAYO_RESULT_TOPIC", "ALPAMAYO_DEAD_LETTER_TOPIC",
              "ALPAMAYO_REVIEW_TOPIC"):
        v = env.get(t)
        if v is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", v):
            raise ConfigError(f"{t}={v!r} is not a valid Kafka topic name: use letters, digits, '.', '_' and '-'")
    return Settings(
        profile=profile,
        k_values=_k_values(env.get("NIM_ALPAMAYO_TRAJ_SAMPLES")),
        spec_metrics=spec_metrics,
        speculative_model=head,
        ft_checkpoint=ft,
        load_format=_choice(env, "ALPAMAYO_LOAD_FORMAT", LOAD_FORMATS, "auto"),
        max_model_len=_int(env, "NIM_ALPAMAYO_MAX_MODEL_LEN", 0, 64, 1 << 20) if max_len else None,
        device=device,
        bootstrap_servers=env.get("ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS") or "127.0.0.1:9092",
        request_topic=env.get("ALPAMAYO_REQUEST_TOPIC") or "alpamayo.requests",
        result_topic=env.get("ALPAMAYO_RESULT_TOPIC") or "alpamayo.results",
        dead_letter_topic=env.get("ALPAMAYO_DEAD_LETTER_TOPIC") or "alpamayo.dead-letters",
        group_id=env.get("ALPAMAYO_GROUP_ID") or "alpamayo-workers",
        group_instance_id=instance,
        security_protocol=security,
        sasl_mechanism=mechanism,
        sasl_username=user,
        sasl_password=password,
        ssl_cafile=cafile,
        processing_guarantee=guarantee,
        review_topic=env.get("ALPAMAYO_REVIEW_TOPIC") or None,
        review_threshold=review_threshold,
        result_content_type=RESULT_FORMATS[_choice(env, "ALPAMAYO_RESULT_FORMAT", tuple(RESULT_FORMATS), "msgpack")],
        max_batch_size=_int(env, "ALPAMAYO_MAX_BATCH_SIZE", 8, 1, 256),
        max_batch_wait_ms=_int(env, "ALPAMAYO_MAX_BATCH_WAIT_MS", 20, 0, 60_000),
        max_inflight=_int(env, "ALPAMAYO_MAX_INFLIGHT", 64, 1, 100_000),
        max_request_bytes=_int(env, "ALPAMAYO_MAX_REQUEST_BYTES", 128 << 20, 1024, 1 << 30),
        http_host=env.get("ALPAMAYO_HTTP_HOST") or "0.0.0.0",
        http_port=_int(env, "ALPAMAYO_HTTP_PORT", 8000, 0, 65535),
        drain_timeout_s=drain_s,
        gpu_memory_fraction=gpu_fraction,
        kafka_wait_s=kafka_wait,
        stats_interval_s=stats_interval,
        claim_check_roots=roots,
        worker_id=instance or env.get("ALPAMAYO_WORKER_ID") or host,
        cache=cache_dir(env),
        log_level=_choice(env, "ALPAMAYO_LOG_LEVEL", LOG_LEVELS, "INFO"),
        max_reasoning_tokens=(_int(env, "ALPAMAYO_MAX_REASONING_TOKENS", 0, 1, 256)
                              if env.get("ALPAMAYO_MAX_REASONING_TOKENS") else None),
    )


# Documentation of every variable (README's configuration table is generated from this).
VARIABLES: dict[str, str] = {
    "NIM_MODEL_PROFILE": "bf16 | fp8 | bf16-dflash2 | fp8-dflash2 (default bf16); not together with NIM_PRECISION",
    "NIM_PRECISION": "bf16 | fp8: selects the matching baseline profile; never enables DFlash2 (default unset)",
    "NIM_ALPAMAYO_TRAJ_SAMPLES": "comma list of served K values, each warmed before ready (default 1)",
    "NIM_ALPAMAYO_SPEC_METRICS": "summary (default on dflash2) | detailed | none (always none on baseline profiles)",
    "NIM_ALPAMAYO_SPECULATIVE_MODEL": "custom DFlash2 head directory (dflash2 profiles only; not with NIM_FT_CHECKPOINT; default: the "
                                      "embedded demo head)",
    "NIM_FT_CHECKPOINT": "checkpoint directory to serve: bf16, or a ModelOpt FP8 export on the fp8 profiles (default: "
                         "the embedded demo checkpoint)",
    "ALPAMAYO_LOAD_FORMAT": "auto (default): weights from the checkpoint's shards | dummy: a config-only directory "
                            "(config, tokenizer, preprocessor files), random weights of the right shapes and dtype "
                            "made on the device, as vLLM's --load-format dummy (benchmarks; a random head on dflash2 "
                            "profiles)",
    "NIM_ALPAMAYO_MAX_MODEL_LEN": "context limit in tokens (prompt + generated; default 8192)",
    "ALPAMAYO_DEVICE": "cuda | cpu (default: cuda when available)",
    "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": "Kafka bootstrap servers (default 127.0.0.1:9092)",
    "ALPAMAYO_REQUEST_TOPIC": "scene jobs (default alpamayo.requests)",
    "ALPAMAYO_RESULT_TOPIC": "results, keyed by request_id (default alpamayo.results)",
    "ALPAMAYO_DEAD_LETTER_TOPIC": "dead letters (default alpamayo.dead-letters)",
    "ALPAMAYO_REVIEW_TOPIC": "optional: results whose uncertainty reaches ALPAMAYO_REVIEW_THRESHOLD are also "
                             "published here, in the result's transaction (default unset: no review topic)",
    "ALPAMAYO_REVIEW_THRESHOLD": "uncertainty in [0, 1] from which a result goes to the review topic (default 0.5)",
    "ALPAMAYO_GROUP_ID": "consumer group (default alpamayo-workers)",
    "ALPAMAYO_GROUP_INSTANCE_ID": "static group membership id (e.g. the pod name); default unset: dynamic membership",
    "ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT (default) | SSL | SASL_PLAINTEXT | SASL_SSL",
    "ALPAMAYO_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512 (default with SASL) | SCRAM-SHA-256 | PLAIN",
    "ALPAMAYO_KAFKA_SASL_USERNAME": "SASL user (default unset; required with SASL_*)",
    "ALPAMAYO_KAFKA_SASL_PASSWORD": "SASL password (default unset; required with SASL_*)",
    "ALPAMAYO_KAFKA_SSL_CAFILE": "CA certificate (PEM) for SSL/SASL_SSL (default: the system's CA store)",
    "ALPAMAYO_PROCESSING_GUARANTEE": "at_least_once (default) | exactly_once (transactions, read_committed)",
    "ALPAMAYO_RESULT_FORMAT": "msgpack (default) | json: encoding of results and dead letters (content-type header "
                              "application/msgpack | application/json)",
    "ALPAMAYO_MAX_BATCH_SIZE": "most requests in one forward batch (default 8)",
    "ALPAMAYO_MAX_BATCH_WAIT_MS": "longest a partial batch waits for mates (default 20)",
    "ALPAMAYO_MAX_INFLIGHT": "requests held before partitions are paused (default 64)",
    "ALPAMAYO_MAX_REQUEST_BYTES": "largest request message accepted (default 128 MiB)",
    "ALPAMAYO_HTTP_HOST": "side port bind address (default 0.0.0.0)",
    "ALPAMAYO_HTTP_PORT": "side port: health, models, metrics (default 8000)",
    "ALPAMAYO_DRAIN_TIMEOUT_S": "SIGTERM grace: finish, publish and commit within this (default 60)",
    "ALPAMAYO_KAFKA_WAIT_S": "startup: seconds to wait for a reachable Kafka broker before refusing (default 5; the "
                             "producer tools wait as long)",
    "ALPAMAYO_STATS_INTERVAL_S": "seconds between the stats lines logged while there is traffic (results/s, queue, "
                                 "in flight, dead letters by code, acceptance, GPU memory) and between "
                                 "warnings per dead-letter code (default 10; 0: off)",
    "ALPAMAYO_GPU_MEMORY_FRACTION": "share of GPU memory for weights + KV cache + reserve, as vLLM's "
                                    "gpu_memory_utilization (default 0.90); sizes the cache's rows",
    "ALPAMAYO_CLAIM_CHECK_ROOTS": "comma list of allowed claim-check URI prefixes (file:///data/,...); default unset: claim "
                                  "checks are refused",
    "ALPAMAYO_WORKER_ID": "worker id in lineage (default: group instance id or host name)",
    "ALPAMAYO_LOG_LEVEL": "DEBUG | INFO (default) | WARNING | ERROR",
    "ALPAMAYO_MAX_REASONING_TOKENS": "test/benchmark knob: reasoning-token cap of trajectory requests, 1..256 "
                                     "(default: the release's 256)",
    "ALPAMAYO_CACHE": "cache directory for venv, Kafka jars and demo recipe builds (default ~/.cache/alpamayo-worker)",
}
