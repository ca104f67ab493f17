"""Poison pills and replay lineage against a real Apache Kafka (the conftest's local broker).

One in-process worker (tiny random checkpoint, CPU) on a request topic of 4 MiB, output topics at
the broker default (~1 MiB) and the producer's default request size (1 MiB):

* a 1.2 MB header or key on an invalid request: the dead letter is cut to fit (marker header,
  key prefix) instead of ending the worker with MessageSizeTooLargeError;
* a 1.2 MB header on a valid request: a result (headers are not copied into results);
* a result over the limit (1.2 MB of unknown field names become 1.2 MB of warnings): an
  ``oversize`` dead letter;
* a request replayed by ``dlq replay`` (``attempt`` / ``replay-of`` headers): its result's
  lineage and its dead letter carry both;

and the worker stays up: a plain request sent after all of them is answered too.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

import schemas as S
from worker.config import load_settings
from worker.output_limits import BROKER_DEFAULT_MESSAGE_BYTES, KEPT_KEY_BYTES, record_size
from worker.process import WorkerThread
from worker.scenes.request import build_request

from tests.worker.kafka_harness import collect, free_port, produce, request_item, worker_env

pytestmark = pytest.mark.kafka

BIG = 1_200_000


def unknown_fields_value(req: S.InferRequest, total: int) -> bytes:
    """The request with ``total`` bytes of unknown top-level field names (each one a warning)."""
    d = msgspec.structs.asdict(req)
    for i in range(total // 100):
        d[f"x{i:07d}" + "y" * 92] = 0
    return msgspec.msgpack.encode(d)


async def test_oversized_outputs_become_fitting_dead_letters_and_replays_carry_lineage(
        kafka_bootstrap, topic_factory, tiny, scene, tmp_path):
    ckpt, _head = tiny
    req_t = await topic_factory(1, prefix="req", config={"max.message.bytes": str(4 << 20)})
    res_t, dl_t = await topic_factory(1, prefix="res"), await topic_factory(1, prefix="dl")
    uniq = f"{os.getpid()}-{time.monotonic_ns()}"
    env = worker_env(kafka_bootstrap, req_t, res_t, dl_t, f"g-poison-{uniq}", f"w-poison-{uniq}", free_port(), ckpt)
    w = WorkerThread(load_settings(env)).start()
    try:
        assert await asyncio.to_thread(w.wait_ready, 300), f"worker ended: {w.exit_code} {w.error}"
        sr = build_request
        no_ego = lambda rid: msgspec.structs.replace(sr(scene, "trajectory", 1, request_id=rid), egomotion=None)  # noqa: E731
        replay = [("replay-of", f"{dl_t}:0:5".encode()), ("attempt", b"3")]
        items = []
        rid, key, value, headers = request_item(no_ego("big-header-bad"))
        items.append((rid, key, value, headers + [("x-trace", b"h" * BIG)]))
        rid, key, value, headers = request_item(no_ego("big-key-bad"))
        items.append((rid, b"k" * BIG, value, headers))
        rid, key, value, headers = request_item(sr(scene, "trajectory", 1, request_id="big-header-ok"))
        items.append((rid, key, value, headers + [("x-trace", b"h" * BIG)]))
        big = sr(scene, "trajectory", 1, request_id="big-result")
        items.append(("big-result", b"big-result", unknown_fields_value(big, BIG), S.encode_request(big)[1]))
        rid, key, value, headers = request_item(sr(scene, "trajectory", 1, request_id="replayed-ok"))
        items.append((rid, key, value, headers + replay))
        rid, key, value, headers = request_item(no_ego("replayed-bad"))
        items.append((rid, key, value, headers + replay))
        items.append(request_item(sr(scene, "trajectory", 1, request_id="after")))
        await produce(kafka_bootstrap, req_t, items)
        expected = [i[0] for i in items]
        out = await collect(kafka_bootstrap, res_t, dl_t, expected, partitions=1, timeout=240, settle=1.0)
        assert w.exit_code is None, f"the worker ended: {w.exit_code} {w.error}"
        assert {i: len(v) for i, v in out.by_id.items()} == {i: 1 for i in expected}

        (dl,) = out.by_id["big-header-bad"]
        assert isinstance(dl, S.DeadLetter) and dl.error_code == S.ErrorCode.MISSING_EGOMOTION
        assert dl.original_cut and dl.original_headers[-1][0] == S.TRUNCATION_HEADER
        assert dict(dl.original_headers)["x-trace"] == b"h" * 1024
        assert dl.original_value == items[0][2] and not dl.original_value_truncated      # the value is whole
        (dl,) = out.by_id["big-key-bad"]
        assert dl.error_code == S.ErrorCode.MISSING_EGOMOTION and dl.original_key == b"k" * KEPT_KEY_BYTES
        assert dl.original_cut and dl.original_headers[-1] == (S.TRUNCATION_HEADER, f"key={BIG}".encode())
        for ident in ("big-header-bad", "big-key-bad"):
            v, h = S.encode_dead_letter(out.by_id[ident][0])
            assert record_size(out.keys[ident][0], v, h) <= BROKER_DEFAULT_MESSAGE_BYTES

        (res,) = out.by_id["big-header-ok"]
        assert isinstance(res, S.InferResult) and (res.lineage.attempt, res.lineage.replay_of) == (1, None)
        (dl,) = out.by_id["big-result"]
        assert isinstance(dl, S.DeadLetter) and (dl.error_code, dl.error_field) == (S.ErrorCode.OVERSIZE, "$")
        assert "results topic" in dl.error_message and dl.original_value_truncated

        (res,) = out.by_id["replayed-ok"]
        assert isinstance(res, S.InferResult)
        assert (res.lineage.attempt, res.lineage.replay_of) == (3, f"{dl_t}:0:5")
        (dl,) = out.by_id["replayed-bad"]
        assert isinstance(dl, S.DeadLetter) and (dl.attempt, dl.replay_of) == (3, f"{dl_t}:0:5")
        assert not dl.original_cut                      # a small replayed request stays replayable
        assert isinstance(out.by_id["after"][0], S.InferResult)
    finally:
        code = await asyncio.to_thread(w.stop, 90)
    assert code == 0
