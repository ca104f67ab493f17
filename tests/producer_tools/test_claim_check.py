"""producer_tools.claim_check: images moved to a content-addressed store only as far as the size
threshold needs, resolved back with their hashes checked."""

import hashlib
from pathlib import Path

import pytest

import schemas as S
from producer_tools import claim_check as CC
from producer_tools import publish as P
from producer_tools.common import ToolError
from worker.scenes.request import scene_item


def test_claim_check_below_threshold_stays_inline(scene, tmp_path):
    req = P.run_request(scene_item(scene), "trajectory", 1, "r")
    value, headers, sent, moved = CC.encode_with_claim_check(req, 1 << 20, CC.ObjectStore(tmp_path))
    assert moved == 0 and sent is req and not any(tmp_path.rglob("*.png"))


def test_claim_check_threshold_and_sha(scene, tmp_path):
    req = P.run_request(scene_item(scene), "auto_labeling", 1, "r")
    full = len(S.encode_request(req)[0])
    threshold = full - sum(map(len, req.images)) // 3                  # about a third of the images must move
    store = CC.ObjectStore(f"file://{tmp_path}/store")
    value, headers, sent, moved = CC.encode_with_claim_check(req, threshold, store)
    size = len(value) + len(S.request_key(req)) + sum(len(k) + len(v) for k, v in headers)
    assert size <= threshold < full
    refs = [im for im in sent.images if isinstance(im, S.ImageRef)]
    assert len(refs) == moved > 0 and len(refs) < len(sent.images)        # only as many as needed
    for i, im in enumerate(sent.images):
        if isinstance(im, S.ImageRef):
            data = Path(im.uri[len("file://"):]).read_bytes()
            assert data == req.images[i] and im.size == len(data)
            assert im.sha256 == hashlib.sha256(data).hexdigest() and im.content_type == "image/png"
            assert im.uri.startswith(f"file://{tmp_path}/store/sha256/{im.sha256[:2]}/")
        else:
            assert im == req.images[i]
    decoded = S.decode_request(value, headers)
    assert CC.resolve_images(decoded) == list(req.images)
    # content addressed and idempotent: a second pass writes nothing new
    files = sorted(p.name for p in tmp_path.rglob("*.png"))
    CC.encode_with_claim_check(req, threshold, store)
    assert sorted(p.name for p in tmp_path.rglob("*.png")) == files
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_claim_check_needs_a_store_and_detects_tampering(scene, tmp_path):
    req = P.run_request(scene_item(scene), "trajectory", 1, "r")
    with pytest.raises(ToolError, match="object-store"):
        CC.encode_with_claim_check(req, 1000, None)
    _, _, sent, _ = CC.encode_with_claim_check(req, 10_000, CC.ObjectStore(tmp_path))
    ref = next(im for im in sent.images if isinstance(im, S.ImageRef))
    Path(ref.uri[len("file://"):]).write_bytes(b"\x89PNG tampered")
    with pytest.raises(S.ContractError) as ei:
        CC.resolve_images(sent)
    assert ei.value.code == S.ErrorCode.CLAIM_CHECK_FAILED
    with pytest.raises(ToolError, match="still above"):
        CC.encode_with_claim_check(req, 100, CC.ObjectStore(tmp_path))
