"""Shared pytest fixtures: a real local Apache Kafka and fresh topics on it.

Fixtures
--------
``local_kafka`` (session)
    The :class:`deploy.local.cluster.LocalKafka` named ``pytest`` (``$ALPAMAYO_TEST_KAFKA_NAME``),
    started once per session (fresh data when it was not already running), stopped at the end
    unless another live pytest session still holds it. ``None`` when
    ``$ALPAMAYO_TEST_KAFKA_BOOTSTRAP`` points the tests at an external broker.
``kafka_bootstrap`` (session)
    ``"127.0.0.1:PORT"``. A broker that cannot start fails every test that uses it (no skip).
``topic_factory`` (function)
    Creates uniquely named topics through aiokafka's ``AIOKafkaAdminClient`` and waits until
    every partition has a leader::

        name = await topic_factory(3)                      # 3 partitions, RF 1
        names = await topic_factory.many(2, partitions=4)  # two topics
        name = topic_factory.sync(2)                       # from a sync test (own loop, own thread)
        name = await topic_factory(1, prefix="req", config={"max.message.bytes": "2097152"})

``scene`` (module)
    The synthetic scene of seed 7 (:func:`worker.scenes.generate_scene`).

Tests that use ``kafka_bootstrap``/``topic_factory``/``local_kafka`` are marked ``kafka``
automatically.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import pytest

from deploy.local.cluster import LocalKafka, LocalKafkaError
from worker.scenes import Scene, generate_scene

KAFKA_FIXTURES = {"kafka_bootstrap", "topic_factory", "local_kafka"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kafka: needs the local Apache Kafka broker (started by the test session)")
    config.addinivalue_line("markers", "slow: long harness, opt-in")
    config.addinivalue_line("markers", "multinode: starts its own 3-node local Kafka cluster")


_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True)
def _triton_interpret_unchanged(request: pytest.FixtureRequest):
    """A test that sets TRITON_INTERPRET in this process (importing `worker.kernel_check` on a
    machine without a GPU does) makes every worker process started after it run its Triton kernels
    interpreted: later service tests then time out far from the cause. Restore it and fail here."""
    yield
    if os.environ.get("TRITON_INTERPRET") != _TRITON_INTERPRET:
        if _TRITON_INTERPRET is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _TRITON_INTERPRET
        pytest.fail(f"{request.node.nodeid} set TRITON_INTERPRET in the test process (an in-process import of "
                    "worker.kernel_check?); run such code through tests/worker/model/interpreted.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if KAFKA_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def local_kafka() -> LocalKafka | None:
    if os.environ.get("ALPAMAYO_TEST_KAFKA_BOOTSTRAP"):
        yield None
        return
    kafka = LocalKafka(name=os.environ.get("ALPAMAYO_TEST_KAFKA_NAME", "pytest"), nodes=1)
    t0 = time.monotonic()
    try:
        kafka.acquire(fresh_if_stopped=True)
    except LocalKafkaError as exc:
        pytest.fail(f"the local Kafka for tests did not start: {exc}", pytrace=False)
    kafka.startup_seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    try:
        yield kafka
    finally:
        kafka.release()


@pytest.fixture(scope="session")
def kafka_bootstrap(local_kafka: LocalKafka | None) -> str:
    external = os.environ.get("ALPAMAYO_TEST_KAFKA_BOOTSTRAP")
    if external:
        return external
    assert local_kafka is not None
    return local_kafka.bootstrap


class TopicFactory:
    """Creates fresh, uniquely named topics (see module docstring)."""

    def __init__(self, bootstrap: str, client_config: dict | None = None) -> None:
        self.bootstrap = bootstrap
        self.client_config = dict(client_config or {"bootstrap_servers": bootstrap})
        self.created: list[str] = []

    async def __call__(self, partitions: int = 1, *, prefix: str = "t", replication_factor: int = 1,
                       config: dict[str, str] | None = None, name: str | None = None,
                       timeout: float = 30.0) -> str:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        name = name or f"{prefix}-{uuid.uuid4().hex[:12]}"
        admin = AIOKafkaAdminClient(**self.client_config)
        await admin.start()
        try:
            resp = await admin.create_topics(
                [NewTopic(name, num_partitions=partitions, replication_factor=replication_factor,
                          topic_configs={k: str(v) for k, v in (config or {}).items()})],
                timeout_ms=int(timeout * 1000))
            for err in getattr(resp, "topic_errors", []):
                code = err[1]
                if code not in (0, 36):  # 36 = TOPIC_ALREADY_EXISTS (a retried request)
                    raise RuntimeError(f"creating topic {name!r} failed: {err}")
            deadline = time.monotonic() + timeout
            while True:
                topics = await admin.describe_topics([name])
                parts = topics[0].get("partitions", []) if topics else []
                if (topics and topics[0].get("error_code") == 0 and len(parts) == partitions
                        and all(p.get("leader", -1) >= 0 for p in parts)):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"topic {name!r} has no leader for every partition after {timeout}s: {topics}")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
        self.created.append(name)
        return name

    async def many(self, count: int, partitions: int = 1, **kw) -> list[str]:
        return [await self(partitions, **kw) for _ in range(count)]

    def sync(self, partitions: int = 1, **kw) -> str:
        """Same as ``await factory(...)``, callable from sync code (runs its own loop in a thread)."""
        out: dict = {}

        def run() -> None:
            try:
                out["name"] = asyncio.run(self(partitions, **kw))
            except BaseException as exc:  # re-raised in the caller
                out["error"] = exc

        t = threading.Thread(target=run, name="topic-factory")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["name"]


@pytest.fixture
def topic_factory(kafka_bootstrap: str) -> TopicFactory:
    return TopicFactory(kafka_bootstrap)


@pytest.fixture(scope="module")
def scene() -> Scene:
    return generate_scene(7)
