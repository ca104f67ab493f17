"""The ``poison`` scenario: requests with oversized keys, headers and values at the limits.

Topics of 2 MiB (dead letters 2.25 MiB), the worker's producer at its default request size
(1 MiB), ``ALPAMAYO_MAX_REQUEST_BYTES`` = :data:`MAX_REQUEST_BYTES`. The scenes cycle through
:data:`KINDS`; each must end as exactly the output its kind allows (a result, or a dead letter of
the given code), the worker must stay up (no unplanned exit) and nothing may be lost.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaProducer

import schemas as S
from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import Figures
from producer_tools.chaos.pipeline import DEFAULT_PARTITIONS, Pipeline, _scenes, _work_dir
from worker.scenes.request import build_request

__all__ = ["KINDS", "MAX_REQUEST_BYTES", "PoisonCase", "poison_cases", "run_poison"]

BIG = 1_200_000
"""An oversized key or header: above the producer's default 1 MiB request size."""
MAX_REQUEST_BYTES = 1_500_000
"""The worker's request size limit in this scenario (values are sent at it and just above it)."""
KINDS = {   # kind -> the output it must end as ("result" or a dead-letter code)
    "big-header": "result", "big-header-invalid": "missing_egomotion", "big-key": "result",
    "big-key-invalid": "missing_egomotion", "many-headers-invalid": "missing_egomotion",
    "value-at-limit": "oversize",         # accepted, but 1.4 MB of warnings: its result cannot fit
    "value-over-limit": "oversize", "plain": "result",
}


@dataclass
class PoisonCase:
    kind: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]

    @property
    def expected(self) -> str:
        return KINDS[self.kind]


def _padded(req: S.InferRequest, size: int) -> bytes:
    """The request's msgpack grown to exactly ``size`` bytes with unknown top-level fields (each
    one becomes a result warning)."""
    d = msgspec.structs.asdict(req)
    d["z"] = ""
    for i in range((size - len(msgspec.msgpack.encode(d)) - 1000) // 103):    # 103 bytes per field
        d[f"x{i:07d}" + "y" * 92] = 0
    d["z"] = "z" * (size - len(msgspec.msgpack.encode(d)) - 2)     # "" is 1 byte, a str16 header 3
    value = msgspec.msgpack.encode(d)
    assert len(value) == size, (len(value), size)
    return value


def poison_cases(n: int, run_id: str) -> list[PoisonCase]:
    scenes = _scenes()
    kinds = list(KINDS)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        rid = f"{kind}-{i:05d}"
        req = build_request(scenes[i % len(scenes)], "trajectory", 1, request_id=rid, run_id=run_id)
        if kind.endswith("-invalid"):
            req = msgspec.structs.replace(req, egomotion=None)
        value, headers = S.encode_request(req)
        key = S.request_key(req)
        if kind.startswith("big-header"):
            headers = headers + [("x-trace", b"h" * BIG)]
        elif kind.startswith("big-key"):
            key = b"k" * BIG
        elif kind == "many-headers-invalid":
            headers = headers + [(f"x-{j:05d}", b"m" * 100) for j in range(12_000)]
        elif kind == "value-at-limit":
            value = _padded(req, MAX_REQUEST_BYTES)
        elif kind == "value-over-limit":
            value = _padded(req, MAX_REQUEST_BYTES + 1)
        out.append(PoisonCase(kind, key, value, headers))
    return out


async def run_poison(broker: Broker, *, scenes: int = 40, guarantee: str = "exactly_once",
                     work: str | os.PathLike | None = None, partitions: int = DEFAULT_PARTITIONS,
                     timeout: float = 900.0) -> Figures:
    """``scenes`` poison requests (the :data:`KINDS` in turn) through one worker."""
    work = _work_dir(work, "poison")
    extra = {"ALPAMAYO_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)}
    async with Pipeline(broker, scenario="poison", guarantee=guarantee, work=Path(work) / guarantee,
                        partitions=partitions, sink=False, worker_extra=extra) as pl:
        f = pl.fig
        await pl.start_worker()
        cases = poison_cases(scenes, pl.run_id)
        sent: dict[tuple[str, int, int], PoisonCase] = {}
        producer = AIOKafkaProducer(**broker.client_kw(), acks="all", enable_idempotence=True,
                                    max_request_size=4 << 20)
        await producer.start()
        t_send = time.monotonic()
        try:
            for c in cases:
                md = await producer.send_and_wait(pl.topics.req, c.value, key=c.key, headers=c.headers)
                sent[(md.topic, md.partition, md.offset)] = c
        finally:
            await producer.stop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(src in pl.monitor.by_source for src in sent):
            await asyncio.sleep(0.5)
        await pl.monitor.wait_at_end(15)
        f.extra["processed"] = f"{len(sent)} requests in {time.monotonic() - t_send:.1f}s"
        wrong: list[str] = []
        per_kind: dict[str, Counter] = {k: Counter() for k in KINDS}
        for src, c in sent.items():
            outs = pl.monitor.by_source.get(src, [])
            f.lost += not outs
            f.duplicated += max(0, len(outs) - 1)
            for kind, code in outs:
                got = code or "result"
                per_kind[c.kind][got] += 1
                if got != c.expected:
                    wrong.append(f"{c.kind} at {src[1]}:{src[2]} -> {got} (expected {c.expected})")
        f.published = len(sent)
        f.answered = len(sent) - f.lost
        f.results = sum(n for k in per_kind.values() for code, n in k.items() if code == "result")
        f.dead_letters = sum(n for k in per_kind.values() for code, n in k.items() if code != "result")
        f.extra["outputs per kind"] = {k: dict(v) for k, v in per_kind.items()}
        f.extra["_wrong"] = wrong
        if wrong:
            f.failures.append(f"{len(wrong)} requests answered wrongly, e.g. {wrong[:3]}")
        if pl.worker.unplanned_exits or not pl.worker.alive:
            f.failures.append(f"the worker did not stay up ({pl.worker.unplanned_exits} unplanned exits)")
        if f.duplicated:
            f.failures.append(f"{f.duplicated} duplicate outputs (the worker never restarted)")
        return await pl.finish()
