"""Output size limits: dead letters cut to fit, results over the limit refused as ``oversize``,
replay lineage headers read by intake. The broker side: test_service_poison.py."""

import base64
import json

import msgspec
import pytest

import schemas as S
from producer_tools.dlq import _item_from_dl, replay_headers
from worker.config import load_settings
from worker.engine import default_seed
from worker.intake import Intake, Job, RawRecord, replay_lineage
from worker.output_limits import (KEPT_HEADER_BYTES, KEPT_KEY_BYTES, check_result_fits, fit_dead_letter,
                                  producer_max_request_size, record_size)
from worker.publisher import dead_letter_output, result_output
from worker.scenes.request import build_request

from tests.producer_tools.sink_harness import make_result

MiB = 1 << 20


def poison(value=b"v" * (900 << 10), key=b"k" * 5000, headers=(("x-trace", b"h" * 1_200_000), ("ok", b"1"))):
    return S.dead_letter_from_error(S.ContractError("missing_egomotion", "$.egomotion", "no ego"), value=value,
                                    key=key, headers=list(headers), topic="req", partition=0, offset=3,
                                    worker_id="w")


@pytest.mark.parametrize("limit", [MiB, 2 * MiB, 64 << 10, 4 << 10])
def test_a_dead_letter_over_the_limit_is_cut_to_fit_with_a_marker(limit):
    dl, value, headers = fit_dead_letter(poison(), limit)
    assert record_size(S.dead_letter_key(dl), value, headers) <= limit
    assert S.decode_dead_letter(value, headers) == dl
    assert dl.original_cut and dl.original_headers[-1][0] == S.TRUNCATION_HEADER
    assert dl.original_key is None or dl.original_key == b"k" * KEPT_KEY_BYTES
    assert all(len(v) <= KEPT_HEADER_BYTES for _, v in dl.original_headers)
    assert dl.original_size == 900 << 10 and dl.original_value == b"v" * len(dl.original_value)
    assert dl.original_value_truncated == (len(dl.original_value) < 900 << 10)
    assert _item_from_dl(dl, "dl:0:1", b"r").truncated                # dlq replay refuses it


@pytest.mark.parametrize("limit", [MiB, 64 << 10])
def test_a_json_dead_letter_is_cut_to_fit_and_read_by_a_plain_json_decoder(limit):
    """ALPAMAYO_RESULT_FORMAT=json: base64 makes the original bytes 4/3 larger; still within the limit."""
    dl, value, headers = fit_dead_letter(poison(), limit, S.CONTENT_TYPE_JSON)
    assert record_size(S.dead_letter_key(dl), value, headers) <= limit
    assert dict(headers)["content-type"] == b"application/json"
    doc = json.loads(value)
    assert doc["error_code"] == "missing_egomotion" and base64.b64decode(doc["original_value"]) == dl.original_value
    assert len(dl.original_value) > limit // 2 and S.decode_dead_letter(value, headers) == dl


def test_json_outputs_carry_their_content_type_and_parse_as_plain_json():
    res = make_result("r-json", "run-j")
    out = result_output(("req", 0), 5, 1, "res", res, MiB, S.CONTENT_TYPE_JSON)
    assert dict(out.headers)["content-type"] == b"application/json"
    doc = json.loads(out.value)
    assert (doc["request_id"], doc["run_id"], len(doc["pred_trajectories"][0])) == ("r-json", "run-j", 64)
    out = dead_letter_output(("req", 0), 6, 1, "dl", poison(value=b"v", key=b"k", headers=[]), MiB,
                             S.CONTENT_TYPE_JSON)
    assert dict(out.headers)["content-type"] == b"application/json" and json.loads(out.value)["original_value"] == "dg=="


def test_a_dead_letter_that_fits_is_unchanged_and_replayable():
    dl = poison()
    assert fit_dead_letter(dl, 4 * MiB)[0] == dl and not dl.original_cut
    small = poison(value=b"v", key=b"k", headers=[("a", b"b")])
    assert fit_dead_letter(small, 4 << 10)[0] == small and not _item_from_dl(small, "dl:0:1", b"r").truncated


def test_a_result_over_the_limit_is_an_oversize_contract_error():
    check_result_fits(b"r", b"x" * 1000, [], 2000)
    with pytest.raises(S.ContractError) as e:
        check_result_fits(b"r", b"x" * 2000, [], 2000)
    assert (e.value.code, e.value.field) == (S.ErrorCode.OVERSIZE, "$")
    assert producer_max_request_size({}) == MiB and producer_max_request_size({"max_request_size": 5}) == 5


@pytest.mark.parametrize("headers,expected", [
    ([], (1, None, 0)),
    ([("attempt", b"3"), ("replay-of", b"alpamayo.dead-letters:2:41")], (3, "alpamayo.dead-letters:2:41", 0)),
    ([("attempt", b"0"), ("replay-of", b"x" * 1_200_000)], (1, None, 2)),
    ([("attempt", b"99999999999"), ("replay-of", b"a b:1:2")], (1, None, 2)),
])
def test_replay_lineage_headers(headers, expected):
    attempt, replay_of, warnings = replay_lineage(headers)
    assert (attempt, replay_of, len(warnings)) == expected


def test_intake_carries_replay_lineage_into_the_result_lineage_and_the_dead_letter(scene):
    """``dlq replay`` writes attempt = the dead letter's attempt + 1: a second replay is attempt 3."""
    intake = Intake(load_settings({"ALPAMAYO_WORKER_ID": "w-lin"}), default_seed)
    req = build_request(scene, "trajectory", 1, request_id="r-lin")
    value, headers = S.encode_request(req)
    first = S.dead_letter_from_error(S.ContractError("inference_failed"), value=value, key=b"r-lin",
                                     headers=headers, topic="req", partition=1, offset=9, worker_id="w", attempt=2)
    item = _item_from_dl(first, "dl:0:7", b"r-lin")
    job = intake.process(RawRecord("req", 1, 12, value, b"r-lin", tuple(replay_headers(item))))
    assert isinstance(job, Job)
    lin = job.lineage("w-lin")
    assert (lin.topic, lin.partition, lin.offset, lin.attempt, lin.replay_of) == ("req", 1, 12, 3, "dl:0:7")
    dl = job.dead_letter(S.ContractError("inference_failed"), "w-lin")
    assert (dl.attempt, dl.replay_of) == (3, "dl:0:7")
    bad = msgspec.structs.replace(req, egomotion=None)
    dl = intake.process(RawRecord("req", 1, 13, S.encode_request(bad)[0], b"r-lin", tuple(replay_headers(item))))
    assert isinstance(dl, S.DeadLetter) and (dl.attempt, dl.replay_of) == (3, "dl:0:7")
