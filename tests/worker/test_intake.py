"""Intake: every validation failure becomes a dead letter with its code and field path; claim
checks are confined to the configured roots; valid records become jobs with the runtime's request."""

import dataclasses
import hashlib
import io
import os

import msgspec
import numpy as np
import pytest
from PIL import Image

import schemas as S
from worker.claim_check import ClaimCheckFetcher
from worker.config import load_settings
from worker.engine import default_seed
from worker.intake import Intake, Job, RawRecord
from worker.output_limits import BROKER_DEFAULT_MESSAGE_BYTES, fit_dead_letter

CAMS = [S.CAMERAS[i].name for i in S.DEFAULT_CAMERA_ORDER]


def png(w=16, h=8, value=0):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def ego(n=16):
    return S.Egomotion(ego_history_xyz=[[float(i - n), 0.0, 0.0] for i in range(n)],
                       ego_history_rot=[[[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]] * n)


def future():
    return S.FutureEgomotion(ego_future_xyz=[[0.1 * i, 0.0, 0.0] for i in range(1, 65)],
                             ego_future_quat=[[2.0, 0.0, 0.0, 0.0]] * 64)


def req_dict(**over):
    d = dict(request_id="r-1", run_id="run-1", task="trajectory",
             images=[png(value=i) for i in range(24)], egomotion=ego(), num_traj_samples=1, temperature=0.0)
    d.update(over)
    return d


def encode(d, fmt="msgpack"):
    return (msgspec.json.encode(d) if fmt == "json" else msgspec.msgpack.encode(d))


@pytest.fixture
def roots(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    return root


@pytest.fixture
def intake(roots):
    s = load_settings({"NIM_ALPAMAYO_TRAJ_SAMPLES": "1,2", "ALPAMAYO_CLAIM_CHECK_ROOTS": f"file://{roots}/",
                       "ALPAMAYO_WORKER_ID": "w-test"})
    s = dataclasses.replace(s, max_request_bytes=4 << 20)
    return Intake(s, default_seed)


def run(intake, value, headers=(), offset=7):
    return intake.process(RawRecord("alpamayo.requests", 2, offset, value, b"key-1", tuple(headers), 1_700_000_000_000))


def dead(intake, value, code, field, headers=(), request_id="r-1"):
    out = run(intake, value, headers)
    assert isinstance(out, S.DeadLetter), f"expected a dead letter {code}, got a job"
    assert (out.error_code.value, out.error_field) == (code, field), out.error_message
    assert out.request_id == request_id       # keyed by request_id whenever it could be read
    if request_id is not None:
        assert S.dead_letter_key(out) == request_id.encode()
    assert out.source == S.SourceCoordinates(topic="alpamayo.requests", partition=2, offset=7)
    assert out.worker_id == "w-test" and out.original_key == b"key-1"
    if out.original_value_truncated:
        assert out.original_size == len(value) and value.startswith(out.original_value)
    else:
        assert out.original_value == (value or b"")
    assert "\n" not in out.error_message
    return out


# ---------------------------------------------------------------- decode-stage codes

@pytest.mark.parametrize("value", [None, b"", b"\xc1", b'{"request_id": "x", ', b"\x92\x01\x02"])
def test_undecodable_or_not_an_object(intake, value):
    out = run(intake, value)
    assert out.error_code in (S.ErrorCode.UNDECODABLE_BYTES, S.ErrorCode.WRONG_TYPE)
    assert out.error_field == "$"
    assert S.dead_letter_key(out) == b"alpamayo.requests:2:7"     # no request_id: keyed by coordinates


def test_unsupported_content_type(intake):
    dead(intake, encode(req_dict()), "unsupported_content_type", "$", [("content-type", b"text/plain")],
         request_id=None)
    dead(intake, encode(req_dict()), "unsupported_content_type", "$",
         [("content-type", b"text/plain"), ("request-id", b"r-1")])      # the header names it


def test_unsupported_schema_version(intake):
    out = dead(intake, encode(req_dict(schema_version=99)), "unsupported_schema_version", "$.schema_version")
    assert out.request_id == "r-1" and out.run_id == "run-1"


def test_oversize(intake):
    value = encode(req_dict(nav_text="x" * 4000))
    value += b" " * (intake.settings.max_request_bytes + 1 - len(value))
    dead(intake, value, "oversize", "$", request_id=None)         # too big to read the id from the body
    out = dead(intake, value, "oversize", "$", [("request-id", b"r-1")])
    assert out.original_value == value and not out.original_cut      # whole: cut when published, to the limit
    fitted, encoded, _ = fit_dead_letter(out, BROKER_DEFAULT_MESSAGE_BYTES)
    assert fitted.original_value_truncated and len(encoded) < BROKER_DEFAULT_MESSAGE_BYTES   # fits the topic


@pytest.mark.parametrize("over,code,field", [
    ({"request_id": None}, "wrong_type", "$.request_id"),
    ({"temperature": "hot"}, "wrong_type", "$.temperature"),
    ({"temperature": 3.0}, "out_of_range", "$.temperature"),
    ({"task": "drive"}, "unknown_task", "$.task"),
    ({"num_traj_samples": 3, "temperature": 0.6}, "k_not_served", "$.num_traj_samples"),
    ({"num_traj_samples": 2, "temperature": 0.0}, "k_requires_temperature", "$.temperature"),
    ({"images": [png() for _ in range(23)]}, "image_count_mismatch", "$.images"),
    ({"egomotion": None}, "missing_egomotion", "$.egomotion"),
    ({"task": "meta_action", "egomotion": None}, "missing_egomotion", "$.egomotion"),
    ({"task": "auto_labeling"}, "missing_future_egomotion", "$.future_egomotion"),
    ({"egomotion": ego(15)}, "bad_egomotion", "$.egomotion.ego_history_xyz"),
    ({"task": "vqa", "images": [png() for _ in range(24)]}, "missing_field", "$.question"),
])
def test_field_codes(intake, over, code, field):
    d = req_dict(**over)
    if d["request_id"] is None:
        d.pop("request_id")
        out = run(intake, encode(d))
        assert (out.error_code.value, out.error_field) == ("missing_field", "$.request_id")
        return
    dead(intake, encode(d), code, field)


def test_bad_inline_image_names_its_index(intake):
    images = [png(value=i) for i in range(24)]
    images[5] = b"GIF89a not accepted"
    dead(intake, encode(req_dict(images=images)), "bad_image", "$.images[5]")


def test_image_size_mismatch_names_its_index(intake):
    images = [png() for _ in range(24)]
    images[7] = png(32, 8)
    dead(intake, encode(req_dict(images=images)), "image_size_mismatch", "$.images[7]")


def test_corrupt_image_body_is_caught_at_pixel_decode(intake):
    images = [png(value=i) for i in range(24)]
    good = images[3]
    images[3] = good[:40] + b"\x00" * (len(good) - 40)       # header intact, IDAT garbage
    dead(intake, encode(req_dict(images=images)), "bad_image", "$.images[3]")


def test_images_decode_in_the_decoder_processes_and_the_first_bad_one_in_order_is_reported(intake):
    """The pixels are decoded outside the worker's interpreter (worker/frames.py), into the frames
    array the job holds; of two corrupt images the earlier one is named."""
    from worker.frames import DECODER

    job = run(intake, encode(req_dict()))
    assert isinstance(job, Job) and [int(f[0, 0, 0]) for f in job.scene.frames] == list(range(24))
    pids = DECODER.pids()
    assert pids and os.getpid() not in pids
    images = [png(value=i) for i in range(24)]
    for i in (20, 4):                                          # both corrupt: the earlier one is named
        images[i] = images[i][:40] + b"\x00" * (len(images[i]) - 40)
    dead(intake, encode(req_dict(images=images)), "bad_image", "$.images[4]")


def test_decoder_processes_run_at_a_lower_priority_than_the_worker(intake):
    """Decoding the backlog must not take the cores the running batch needs: every decoder
    process is DECODER_NICENESS nicer than the worker."""
    from worker.frames import DECODER, DECODER_NICENESS

    run(intake, encode(req_dict()))                            # the pool is up
    own = os.getpriority(os.PRIO_PROCESS, 0)
    pids = DECODER.pids()
    assert pids and {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {min(own + DECODER_NICENESS, 19)}


def test_a_decoder_process_that_dies_fails_its_request_only_and_the_pool_restarts(intake):
    import signal

    from worker.frames import DECODER, SHM_DIR

    run(intake, encode(req_dict()))                            # the pool is up
    for pid in DECODER.pids():
        os.kill(pid, signal.SIGKILL)                           # as a codec crash on a crafted image would
    out = run(intake, encode(req_dict()))
    if not isinstance(out, Job):                               # the request that met the dead pool
        assert (out.error_code.value, out.error_field) == ("bad_image", "$.images"), out
        assert "decoder process died" in out.error_message
    job = run(intake, encode(req_dict()))                      # served again by a new pool
    assert isinstance(job, Job) and int(job.scene.frames[5][0, 0, 0]) == 5
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"alpamayo-frames-{os.getpid()}-")]


def test_the_decoder_removes_scratch_files_a_killed_worker_left(tmp_path, monkeypatch):
    """A worker killed while decoding leaves its scratch file behind; the next worker's start
    removes the files of processes that no longer run (also a reused pid: another start time)
    once ORPHAN_AFTER_S old, and keeps those of workers running beside it."""
    import subprocess
    import sys

    import worker.frames as frames

    monkeypatch.setattr(frames, "SHM_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    own = frames.process_tag(os.getpid())
    names = {"dead": f"{frames.SCRATCH_PREFIX}{int(dead.stdout)}.1-aa", "reused": f"{frames.SCRATCH_PREFIX}{os.getpid()}.1-bb",
             "live": f"{frames.SCRATCH_PREFIX}{own}-cc", "other": "someone-elses",
             "dead, fresh": f"{frames.SCRATCH_PREFIX}{int(dead.stdout)}.1-dd"}
    old = os.stat(tmp_path).st_mtime - frames.ORPHAN_AFTER_S - 5
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        if key != "dead, fresh":
            os.utime(tmp_path / name, (old, old))
    assert own and frames.remove_orphan_scratch() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], names["other"], names["dead, fresh"]])


def test_too_many_pixels_is_oversize_before_decoding(roots):
    s = load_settings({"ALPAMAYO_WORKER_ID": "w-test"})
    small = Intake(s, default_seed, max_image_pixels=100)
    out = small.process(RawRecord("alpamayo.requests", 2, 7, encode(req_dict())))
    assert (out.error_code.value, out.error_field) == ("oversize", "$.images[0]")


# ---------------------------------------------------------------- claim checks

def ref_for(path, data, uri=None, **over):
    d = dict(uri=uri or f"file://{path}", sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    d.update(over)
    return d


def with_ref(ref, index=4):
    images = [png(value=i) for i in range(24)]
    images[index] = ref
    return encode(req_dict(images=images))


def test_claim_check_fetches_verifies_and_decodes(intake, roots):
    data = png(value=200)
    (roots / "img.png").write_bytes(data)
    job = run(intake, with_ref(ref_for(roots / "img.png", data)))
    assert isinstance(job, Job)
    assert int(job.scene.frames[4].mean()) == 200


@pytest.mark.parametrize("make_uri,reason", [
    (lambda root: f"file://{root}/../secret.png", "traversal"),
    (lambda root: f"file://{root}/sub/%2e%2e/%2e%2e/secret.png", "traversal"),     # percent-encoded
    (lambda root: f"file://{root.parent}/secret.png", "outside the allowed"),
    (lambda root: f"file://{root}/link.png", "outside the allowed"),                # symlink out of the root
    (lambda root: f"file://evil.example.com{root}/img.png", "not local"),
    (lambda root: f"s3://bucket{root}/img.png", "not supported"),
    (lambda root: f"file://{root}/missing.png", "No such file"),
    (lambda root: f"file://{root}/sub", "not a regular file"),
], ids=["dotdot", "encoded-dotdot", "outside", "symlink", "remote-host", "s3", "missing", "directory"])
def test_claim_check_refusals(intake, roots, make_uri, reason):
    data = png(value=9)
    (roots.parent / "secret.png").write_bytes(data)
    (roots / "img.png").write_bytes(data)
    (roots / "sub").mkdir()
    os.symlink(roots.parent / "secret.png", roots / "link.png")
    out = dead(intake, with_ref(ref_for(None, data, uri=make_uri(roots))), "claim_check_failed", "$.images[4]")
    assert reason in out.error_message


def test_claim_check_size_and_digest_are_verified(intake, roots):
    data = png(value=1)
    (roots / "a.png").write_bytes(data)
    dead(intake, with_ref(ref_for(roots / "a.png", data, size=len(data) - 1)), "claim_check_failed", "$.images[4]")
    dead(intake, with_ref(ref_for(roots / "a.png", data, sha256="0" * 64)), "claim_check_failed", "$.images[4]")


def test_claim_check_without_configured_roots_is_refused(roots):
    data = png()
    (roots / "a.png").write_bytes(data)
    plain = Intake(load_settings({"ALPAMAYO_WORKER_ID": "w-test"}), default_seed)
    out = plain.process(RawRecord("alpamayo.requests", 2, 7, with_ref(ref_for(roots / "a.png", data))))
    assert (out.error_code.value, out.error_field) == ("claim_check_failed", "$.images[4]")
    assert "ALPAMAYO_CLAIM_CHECK_ROOTS" in out.error_message


def test_fetcher_extensible_by_scheme(roots):
    data = png(value=3)
    f = ClaimCheckFetcher([str(roots)])
    f.register("mem", lambda uri, limit: data[:limit])
    ref = S.ImageRef(uri="mem://x", sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    assert f.fetch(ref) == data


# ---------------------------------------------------------------- valid jobs

def test_valid_job_carries_the_runtime_request(intake):
    value = encode(req_dict(num_traj_samples=2, temperature=0.7, nav_text="turn left", unknown_x=1), "json")
    job = run(intake, value, [("content-type", b"application/json")])
    assert isinstance(job, Job)
    sc = job.scene
    assert (sc.task, sc.num_samples, sc.temperature, sc.nav_text) == ("trajectory", 2, 0.7, "turn left")
    assert sc.frames.shape == (24, 8, 16, 3) and sc.frames.dtype == np.uint8
    assert sc.camera_ids == tuple(S.DEFAULT_CAMERA_ORDER)
    assert sc.seed == default_seed("r-1")            # no seed in the request: derived from the id
    assert sc.max_tokens is None and sc.ego_history_rot.shape == (16, 3, 3)
    assert job.group == ("trajectory", 2) and job.tp == ("alpamayo.requests", 2) and job.offset == 7
    assert any("unknown_x" in w for w in job.warnings)
    assert job.origin_at == pytest.approx(1_700_000_000.0)


def test_explicit_seed_quaternions_and_camera_reordering(intake):
    order = list(reversed(CAMS))
    images = [png(value=10 * c + f) for c in range(6) for f in range(4)]   # camera c frame f
    fut = future()
    value = encode(req_dict(task="auto_labeling", images=images, camera_order=order, seed=42,
                            future_egomotion=fut, max_tokens=5))
    job = run(intake, value)
    assert isinstance(job, Job)
    sc = job.scene
    assert sc.seed == 42 and sc.max_tokens == 5
    assert sc.camera_ids == tuple(sorted(S.CAMERA_IDS_BY_NAME[n] for n in order))
    # the request's last camera block (front_tele, id 6, value 50..53) is now the last block again,
    # and its first block (id 6) moved: ascending ids means request camera 5 (cross_left, id 0) first
    assert [int(sc.frames[i, 0, 0, 0]) for i in range(4)] == [50, 51, 52, 53]
    assert [int(sc.frames[20 + i, 0, 0, 0]) for i in range(4)] == [0, 1, 2, 3]
    assert np.allclose(sc.ego_future_rot, [[1.0, 0, 0, 0]] * 64)     # normalised quaternions


def test_late_failure_dead_letter_keeps_the_original_record(intake):
    value = encode(req_dict())
    job = run(intake, value)
    dl = job.dead_letter(S.ContractError("inference_failed", "$", "out of GPU memory"), "w-test")
    assert (dl.error_code, dl.request_id, dl.run_id) == (S.ErrorCode.INFERENCE_FAILED, "r-1", "run-1")
    assert dl.original_value == value and dl.source.offset == 7
    assert S.dead_letter_key(dl) == b"r-1"


def test_frames_go_through_the_temporary_directory_where_dev_shm_has_no_room(intake, monkeypatch, tmp_path):
    """Docker's default /dev/shm is 64 MB (a full-HD scene is 149 MB): the decoder's scratch file
    then lives in the temporary directory; either way none is left behind."""
    import tempfile

    import worker.frames as frames

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(frames, "SHM_DIR", str(tmp_path / "no-such-shm"))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    job = run(intake, encode(req_dict()))
    assert isinstance(job, Job) and [int(f[0, 0, 0]) for f in job.scene.frames] == list(range(24))
    assert frames._scratch_dir(1) == str(scratch) and list(scratch.iterdir()) == []


@pytest.mark.parametrize("kind", ["none", "keeps", "shrinks"])
def test_decoded_frames_are_read_into_one_array_unless_they_shrink(kind):
    """The decoder's frames read back from its scratch file: a shrink that keeps the first frame
    as is (a CUDA runtime's) is asked once and the rest go straight into one array (no 6 MB
    frame each, stacked at the end, as before: asked 24 times); one that shrinks is asked for
    every frame, each shrunk as it is read."""
    import worker.frames as frames

    n, h, w = 24, 6, 10
    data = np.arange(n * h * w * 3, dtype=np.uint64).astype(np.uint8).reshape(n, h, w, 3)
    asked = []

    def keeps(frame):
        asked.append(frame.shape)
        return frame

    def shrinks(frame):
        asked.append(frame.shape)
        return frame[::2, ::2].astype(np.float32)

    shrink = {"none": None, "keeps": keeps, "shrinks": shrinks}[kind]
    out = frames._read_frames(io.BytesIO(data.tobytes()), n, h, w, shrink)
    if kind == "shrinks":
        assert len(asked) == n and out.shape == (n, h // 2, w // 2, 3) and out.dtype == np.float32
        assert np.array_equal(out, data[:, ::2, ::2].astype(np.float32))
    else:
        assert len(asked) == (1 if kind == "keeps" else 0)
        assert out.shape == (n, h, w, 3) and out.dtype == np.uint8 and np.array_equal(out, data)
        assert np.array_equal(frames._read_frames(io.BytesIO(data[:1].tobytes()), 1, h, w, shrink), data[:1])
    with pytest.raises(frames.FrameError, match="cut short"):
        frames._read_frames(io.BytesIO(data.tobytes()[:-1]), n, h, w, shrink)
