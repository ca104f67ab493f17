"""What the worker's Kafka tests share: the worker's environment (CPU, reasoning capped at a few
tokens by ALPAMAYO_MAX_REASONING_TOKENS), `python -m worker serve` subprocesses (:class:`Proc`),
producing requests and collecting results and dead letters from a real broker, reading the
Prometheus text of /v1/metrics.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import defaultdict
from pathlib import Path

import aiohttp

import schemas as S
from worker.scenes.request import build_request

MAX_REASONING = "4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique(prefix: str) -> str:
    """A group / instance / transactional id no other test run on the same broker uses."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def worker_env(bootstrap, req, res, dl, group, instance, port, ckpt, **over) -> dict[str, str]:
    env = {
        "NIM_FT_CHECKPOINT": str(ckpt), "NIM_MODEL_PROFILE": "bf16", "NIM_ALPAMAYO_TRAJ_SAMPLES": "1",
        "ALPAMAYO_DEVICE": "cpu", "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "ALPAMAYO_REQUEST_TOPIC": req, "ALPAMAYO_RESULT_TOPIC": res, "ALPAMAYO_DEAD_LETTER_TOPIC": dl,
        "ALPAMAYO_GROUP_ID": group, "ALPAMAYO_GROUP_INSTANCE_ID": instance,
        "ALPAMAYO_HTTP_HOST": "127.0.0.1", "ALPAMAYO_HTTP_PORT": str(port),
        "ALPAMAYO_MAX_REASONING_TOKENS": MAX_REASONING, "ALPAMAYO_MAX_BATCH_SIZE": "2",
        "ALPAMAYO_MAX_BATCH_WAIT_MS": "20", "ALPAMAYO_DRAIN_TIMEOUT_S": "60", "ALPAMAYO_LOG_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
    }
    env.update({k: str(v) for k, v in over.items()})
    return env


class Proc:
    """A `python -m worker serve` subprocess with its log in a file."""

    def __init__(self, env: dict, log: Path):
        from worker.process import spawn_worker

        self.env, self.log_path = env, log
        self.url = f"http://127.0.0.1:{env['ALPAMAYO_HTTP_PORT']}"
        self._log = open(log, "ab")
        self.p = spawn_worker(env, stdout=self._log, stderr=self._log)

    def tail(self, n=40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    async def wait_ready(self, timeout=180.0) -> list[int]:
        """Poll /v1/health/ready until 200; returns the statuses seen (503s while loading)."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.p.poll() is not None:
                    raise AssertionError(f"worker exited {self.p.returncode} before ready:\n{self.tail()}")
                try:
                    async with http.get(self.url + "/v1/health/ready") as r:
                        seen.append(r.status)
                        if r.status == 200:
                            return seen
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"worker not ready after {timeout}s:\n{self.tail()}")

    async def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.p.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.p.poll() is None:
            self.p.kill()
            raise AssertionError(f"worker did not exit within {timeout}s:\n{self.tail()}")
        self._log.close()
        return self.p.returncode

    def signal(self, sig):
        self.p.send_signal(sig)

    def cleanup(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        self._log.close()


async def http_get(url: str):
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            body = await r.read()
            return r.status, body, r.headers.get("Content-Type", "")


def metric_values(text: str, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of every sample of `name` in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name:
                out[tuple(sorted(smp.labels.items()))] = smp.value
    return out


def L(**labels) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


async def produce(bootstrap, topic, items, partition_of=None) -> dict[str, tuple[int, int]]:
    """items: (ident, key, value, headers). Returns {ident: (partition, offset)}."""
    from aiokafka import AIOKafkaProducer

    out = {}
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=4 << 20)
    await p.start()
    try:
        for i, (ident, key, value, headers) in enumerate(items):
            part = partition_of(i) if partition_of else None
            md = await p.send_and_wait(topic, value, key=key, headers=headers, partition=part)
            out[ident] = (md.partition, md.offset)
    finally:
        await p.stop()
    return out


def request_item(req: S.InferRequest):
    value, headers = S.encode_request(req)
    return req.request_id, S.request_key(req), value, headers


class Outputs:
    """Results and dead letters read from the output topics (read_committed by default)."""

    def __init__(self):
        self.by_id: dict[str, list] = defaultdict(list)
        self.keys: dict[str, list[bytes]] = defaultdict(list)

    @staticmethod
    def ident(msg) -> str:
        if isinstance(msg, S.DeadLetter):
            return msg.request_id or str(msg.source)
        return msg.request_id


async def collect(bootstrap, res_topic, dl_topic, expected, *, partitions: int, timeout=120.0,
                  isolation="read_committed", settle=0.0, stop_when=None) -> Outputs:
    """Read both topics from the beginning until every id in `expected` has an output (then keep
    reading to the end offsets, plus `settle` seconds)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    out = Outputs()
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t in (res_topic, dl_topic) for p in range(partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout
        settle_until = None
        while time.monotonic() < deadline:
            data = await c.getmany(timeout_ms=300)
            for tp, recs in data.items():
                for r in recs:
                    msg = (S.decode_result(r.value, r.headers) if tp.topic == res_topic
                           else S.decode_dead_letter(r.value, r.headers))
                    out.by_id[Outputs.ident(msg)].append(msg)
                    out.keys[Outputs.ident(msg)].append(r.key)
            if stop_when is not None and stop_when(out):
                return out
            if stop_when is None and set(expected) <= set(out.by_id):
                ends = await c.end_offsets(tps)
                at_end = all([await c.position(tp) >= ends[tp] for tp in tps])
                if at_end:
                    settle_until = settle_until or time.monotonic() + settle
                    if time.monotonic() >= settle_until:
                        return out
        missing = sorted(set(expected) - set(out.by_id))
        if stop_when is None:
            raise AssertionError(f"unanswered after {timeout}s: {missing}")
        return out
    finally:
        await c.stop()


async def committed_offsets(bootstrap, group, topic, partitions) -> dict[int, int | None]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        return {p: await c.committed(TopicPartition(topic, p)) for p in partitions}
    finally:
        await c.stop()


def trajectory_requests(scene, n, prefix, k=1):
    return [build_request(scene, "trajectory", k, request_id=f"{prefix}-{i}", temperature=0.7 if k > 1 else 0.0,
                          seed=i) for i in range(n)]
