"""The demo recipe's data choices (worker/demo/train.py, build.py): which target tokens carry the
extra loss weight, how often scenes with a lead vehicle are drawn, and the scene render size a
checkpoint records (its held-out bars and head data are rendered at it)."""

from __future__ import annotations

from worker.scenes import DEFAULT_IMAGE_SIZE

import io
import json
import re

import pytest
from PIL import Image

from worker.demo import build, train
from worker.scenes import generate_scene


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    from worker.demo_cache import demo_checkpoint

    return Tokenizer.from_file(str(demo_checkpoint() / "tokenizer.json"))


def _lead_scene():
    return next(sc for sc in (generate_scene(s) for s in range(100)) if sc.facts.lead_relation in ("slower", "faster"))


def test_lead_situation_words_and_gap_digits_weigh_apart(tok):
    sc = _lead_scene()
    text = train.target_text(sc, "trajectory")
    ids, w = train.token_weights(tok, text, "trajectory", (10.0, 15.0, 3.0))
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids == ids
    lead_lo = text.find(". ") + 2
    lead_hi = text.find(". ", lead_lo)
    situation = re.search(r"\b(slower|faster)\b", text[lead_lo:lead_hi])
    digits = re.search(r"\b\d+\b", text[lead_lo:lead_hi])
    assert situation and digits, text

    def weights_of(m):
        a, b = lead_lo + m.start(), lead_lo + m.end()
        return {float(w[j]) for j, (ta, tb) in enumerate(enc.offsets) if ta < b and tb > a}

    assert weights_of(situation) == {15.0}
    assert weights_of(digits) == {3.0}
    assert float(w.min()) == 1.0                        # words that follow from the facts weigh 1


def test_scenes_with_a_lead_vehicle_come_twice_per_epoch_when_asked():
    from types import SimpleNamespace

    examples = [SimpleNamespace(scene_index=i // 2, task=t) for i, t in enumerate(["trajectory", "vqa"] * 4)]
    has_lead = [True, False, True, False]
    c = train.TrainConfig(per_step=(("trajectory", 1), ("vqa", 1)), groups=(("trajectory",), ("vqa",)),
                          lead_repeats=2)
    s = train._Sampler(examples, c, seed=0, scene_has_lead=has_lead)
    assert sorted(s.by_task["trajectory"]) == [0, 0, 2, 4, 4, 6]      # scenes 0 and 2 twice
    assert sorted(s.by_task["vqa"]) == [1, 3, 5, 7]                   # other tasks once
    plain = train._Sampler(examples, train.TrainConfig(per_step=c.per_step, groups=c.groups), 0, has_lead)
    assert sorted(plain.by_task["trajectory"]) == [0, 2, 4, 6]


def test_a_checkpoint_is_measured_on_scenes_rendered_at_its_recorded_size(tmp_path, monkeypatch):
    assert build.RECIPES["gpu2"].image_size == (128, 128) and build.RECIPES["gpu"].image_size == (64, 64)
    assert build.RECIPES[build.SHIPPED_RECIPE].image_size == DEFAULT_IMAGE_SIZE      # producers send what it saw
    (tmp_path / "quality.json").write_text(json.dumps({"build": {"image_size": [128, 128],
                                                                 "heldout_scene_seeds": [50000, 50001]}}))
    assert build.scene_image_size(tmp_path) == (128, 128)
    seen = []
    monkeypatch.setattr(build.report, "measure_bars", lambda ckpt, head, scenes: seen.extend(scenes) or {})
    build.measure_heldout_bars(tmp_path, tmp_path, 2)
    assert [sc.scene_id for sc in seen] == [generate_scene(s).scene_id for s in (50000, 50001)]
    assert {Image.open(io.BytesIO(sc.images[0])).size for sc in seen} == {(128, 128)}


def test_a_bf16_recipe_ships_bf16_weights_that_the_fp32_runtime_reads(tmp_path):
    """A recipe with `ship_dtype="bfloat16"` (a larger model under the 40 MB budget; the 8-layer
    `gpu4` was built so, docs/demo-model.md): the written shards hold bf16, every config dtype
    says so, and the CPU's fp32 model reads them back as the trained weights rounded to bf16."""
    import torch

    from worker.demo.layout import DEFAULT_CORPUS, build_tokenizer, make_config, write_support_files
    from worker.model.checkpoint import load_model, save_checkpoint, scan_shards
    from worker.model.config import AlpamayoConfig
    from worker.model.modules import Alpamayo2

    assert build.RECIPES[build.SHIPPED_RECIPE].ship_dtype == "float32"
    tok = build_tokenizer([DEFAULT_CORPUS], vocab_size=400)
    config = make_config(tok)
    torch.manual_seed(0)
    model = Alpamayo2(AlpamayoConfig.from_dict(config))
    shipped = build.shipped_config(config, "bfloat16")
    save_checkpoint(model, shipped, tmp_path, dtype=torch.bfloat16)
    write_support_files(tmp_path, tok, shipped)
    saved = json.loads((tmp_path / "config.json").read_text())
    dtypes = []

    def collect(d):
        for k, v in d.items():
            if k == "dtype":
                dtypes.append(v)
            elif isinstance(v, dict):
                collect(v)
    collect(saved)
    assert dtypes and set(dtypes) == {"bfloat16"}
    assert {info.dtype for info in scan_shards(tmp_path, "t").values() if info.dtype.startswith(("F", "BF"))} == {"BF16"}
    loaded, _ = load_model(tmp_path, dtype=torch.float32)
    want = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, want[name].detach().to(torch.bfloat16).float()), name
