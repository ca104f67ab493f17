"""The prompt from the checkpoint's chat template, and the tokenizer as transformers loads it."""

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from worker.demo.layout import write_random_checkpoint
from worker.model.config import AlpamayoConfig
from worker.model.inputs import PromptBuilder, PromptSpec
from worker.model.runtime import AlpamayoRuntime
from worker.model.tokenizer import load_chat_template, load_tokenizer

TASKS = ("trajectory", "meta_action", "auto_labeling", "vqa", "grounding")
CAMS = (0, 1, 2, 3, 5, 6)
TARGETS = ("The traffic light ahead is red, so the ego vehicle must stop before the stop line.<|im_end|>",
           "Longitudinal: Decelerate. Lateral: Go Straight.<|traj_future_start|>",
           '{"critical_components_analysis": "x", "bbox_2d": [1, 2, 3, 4]}  \n\n Café 0123456789 <|box_start|>')


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def spec(task, tokens_per_image=3):
    return PromptSpec(task, CAMS, 4, tokens_per_image, nav_text="Turn left in 30 m.",
                      question="Is the light red?" if task in ("vqa", "grounding") else None)


def builder(path, template=True):
    cfg = AlpamayoConfig.from_dir(path)
    tok, ids = load_tokenizer(path, cfg)
    return PromptBuilder(tok, ids, cfg.tokens_per_history_traj, cfg.tokens_per_future_traj, cfg.include_camera_ids,
                         cfg.frame_label, chat_template=load_chat_template(path) if template else None)


def test_built_in_rendering_is_the_qwen3_vl_chat_layout(ckpt):
    one = PromptSpec("vqa", (1,), 1, 2, question="Why?")
    assert builder(ckpt, template=False).render(one) == (
        "<|im_start|>system\nYou are a driving assistant that generates safe and accurate actions.<|im_end|>\n"
        "<|im_start|>user\nFront camera: frame 0 <|vision_start|><|image_pad|><|image_pad|><|vision_end|>Why?"
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("task", TASKS)
def test_demo_chat_template_gives_the_built_in_prompt_ids(ckpt, task):
    templated, built_in = builder(ckpt), builder(ckpt, template=False)
    assert templated.chat_template is not None and built_in.chat_template is None
    hist = torch.arange(45) + templated.ids.history_id0
    fut = torch.arange(128) + templated.ids.future_id0 if task == "auto_labeling" else None
    hist = hist if task in ("trajectory", "meta_action", "auto_labeling") else None
    assert templated.encode(spec(task), hist, fut).tolist() == built_in.encode(spec(task), hist, fut).tolist()


def test_checkpoint_chat_template_is_what_transformers_reads_and_renders(ckpt, tmp_path):
    hf = PreTrainedTokenizerFast.from_pretrained(str(ckpt), local_files_only=True)
    ours = load_chat_template(ckpt)
    assert ours.source == hf.chat_template
    b = builder(ckpt)
    messages = b.messages(spec("trajectory"))
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert b.render(spec("trajectory", 1)) == rendered
    # tokenizer_config.json's chat_template (no .jinja file) is read the same way
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["chat_template"] = (d / "chat_template.jinja").read_text().replace("'<|im_start|>' + message.role",
                                                                           "'<|im_start|>' + message.role|upper")
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    assert load_chat_template(d).source == PreTrainedTokenizerFast.from_pretrained(str(d)).chat_template


def test_runtime_prompt_follows_the_checkpoint_chat_template(ckpt, tmp_path):
    """A checkpoint whose template numbers its pictures (Qwen's add_vision_id layout) gets
    those words in every prompt; without a template the built-in layout is used."""
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").write_text(template.replace(
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}",
        "{{- 'Picture: <|vision_start|><|image_pad|><|vision_end|>' }}"))
    rt = AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32)
    text = rt.prompts.render(spec("trajectory", 2))
    assert text.count("Picture: <|vision_start|><|image_pad|><|image_pad|><|vision_end|>") == 24
    (d / "chat_template.jinja").unlink()
    plain = AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32)
    assert plain.prompts.chat_template is None and "Picture" not in plain.prompts.render(spec("trajectory", 2))


def _with_tokenizer_config(ckpt, out, tokenizer_class=None):
    """The checkpoint with a special token that only tokenizer_config.json's added_tokens_decoder
    declares (as released tokenizer configs declare theirs), or with another tokenizer class."""
    shutil.copytree(ckpt, out)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    n = PreTrainedTokenizerFast.from_pretrained(str(ckpt)).backend_tokenizer.get_vocab_size()
    if tokenizer_class:
        conf["tokenizer_class"] = tokenizer_class
    else:
        conf["added_tokens_decoder"] = {str(n): {"content": "<|box_start|>", "special": True, "lstrip": False,
                                                 "rstrip": False, "normalized": False, "single_word": False}}
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    return out


def test_token_ids_equal_transformers_tokenizer(ckpt, tmp_path):
    """Prompt and target texts tokenize to transformers' ids: the demo layout (generic fast
    tokenizer), a token declared only in tokenizer_config.json, and a Qwen2Tokenizer directory
    as transformers saves one (Qwen's pre-tokenizer in tokenizer.json, like the release's)."""
    declared = _with_tokenizer_config(ckpt, tmp_path / "declared")
    qwen = tmp_path / "qwen"
    AutoTokenizer.from_pretrained(str(_with_tokenizer_config(ckpt, tmp_path / "q0", "Qwen2TokenizerFast"))) \
        .save_pretrained(str(qwen))
    for f in ("config.json", "preprocessor_config.json"):
        shutil.copy(ckpt / f, qwen / f)
    for d in (ckpt, declared, qwen):
        ours = builder(d)
        reference = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        for text in [ours.render(spec(t)) for t in TASKS] + list(TARGETS):
            assert ours.tok.encode(text, add_special_tokens=False).ids == \
                reference(text, add_special_tokens=False).input_ids, (d.name, text[:60])


@pytest.mark.parametrize("template, message", [
    ("{{ messages[0].missing.attribute }}", "cannot render the trajectory prompt"),
    ("{% for m in messages %}{{ m.content if m.content is string }}{% endfor %}", "renders 0 image placeholders"),
])
def test_a_chat_template_that_cannot_render_the_prompt_is_refused_at_load(ckpt, tmp_path, template, message):
    from worker.model.checkpoint import CheckpointError

    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(CheckpointError, match=message) as e:
        AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32)
    assert "\n" not in str(e.value)


def test_a_prompt_is_tokenized_once_per_spec_and_each_scene_gets_its_own_trajectory_tokens(ckpt):
    """Scenes of one camera rig and task share the rendered prompt's ids (tokenizing held the
    interpreter lock beside the engine's launches); each still gets its own history tokens."""
    b = builder(ckpt)
    calls = []
    encode = b.tok.encode
    b.tok = type("Counting", (), {"encode": lambda self, *a, **k: calls.append(1) or encode(*a, **k)})()
    h1 = torch.arange(45) + b.ids.history_id0
    h2 = torch.arange(45).flip(0) + b.ids.history_id0
    one, two = b.encode(spec("trajectory"), h1, None), b.encode(spec("trajectory"), h2, None)
    assert len(calls) == 1
    fresh = builder(ckpt)
    assert one.tolist() == fresh.encode(spec("trajectory"), h1, None).tolist()
    assert two.tolist() == fresh.encode(spec("trajectory"), h2, None).tolist()
    assert (one != two).sum() == 44          # the history tokens alone (45 reversed: the middle one stays)
    b.encode(spec("vqa"), None, None)
    assert len(calls) == 2


def _mrope_per_token(ids: list[int], grid: list[tuple[int, int, int]], image_id: int, merge: int):
    """Qwen3-VL's positions one token at a time (the form `mrope_positions` replaced)."""
    pos = torch.zeros(3, len(ids), dtype=torch.long)
    cur = i = img = 0
    while i < len(ids):
        if ids[i] == image_id:
            h, w = grid[img][1] // merge, grid[img][2] // merge
            n = h * w
            pos[0, i:i + n] = cur
            pos[1, i:i + n] = cur + torch.arange(h).repeat_interleave(w)
            pos[2, i:i + n] = cur + torch.arange(w).repeat(h)
            cur, i, img = cur + max(h, w), i + n, img + 1
        else:
            pos[:, i] = cur
            cur, i = cur + 1, i + 1
    return pos, int(pos.max()) + 1 - len(ids)


@pytest.mark.parametrize("layout", ["text around", "adjacent images", "image first and last"])
def test_mrope_positions_are_qwen3_vls_per_token_positions(layout):
    from worker.model.inputs import mrope_positions

    image, merge = 9, 2
    grid = [(1, 4, 6), (1, 6, 4), (1, 2, 2)]               # 2x3, 3x2 and 1x1 merged patches
    blocks = [[image] * (g[1] * g[2] // merge ** 2) for g in grid]
    ids = {"text around": [1, 2] + blocks[0] + [3] + blocks[1] + [4, 5, 6] + blocks[2] + [7],
           "adjacent images": [1] + blocks[0] + blocks[1] + blocks[2] + [2, 3],
           "image first and last": blocks[0] + [1, 2] + blocks[1] + blocks[2]}[layout]
    got, delta = mrope_positions(torch.tensor(ids), torch.tensor(grid), image, merge)
    want, want_delta = _mrope_per_token(ids, grid, image, merge)
    assert torch.equal(got, want) and delta == want_delta


def test_a_scenes_positions_come_from_its_spec_and_grid_once(ckpt, monkeypatch):
    """A prompt's rotary positions depend on its image tokens' places and grids only, so scenes of
    one spec share them (computed once, not per scene: most of a scene's host work before its first
    kernel): they equal the positions of the scene's own ids, trajectory tokens in place."""
    import worker.model.inputs as inputs

    b = builder(ckpt)
    grid = torch.tensor([[1, 4, 6]] * 4)
    s = PromptSpec("trajectory", (0, 1), 2, 6)
    calls = []
    real = inputs.mrope_positions
    monkeypatch.setattr(inputs, "mrope_positions", lambda *a: (calls.append(1), real(*a))[1])
    history = [torch.arange(b.tokens_per_history) + b.ids.traj_token_range[0] + 7 * i for i in range(3)]
    for h in history:
        ids = b.encode(s, h, None)
        pos, delta = b.positions(s, grid, 2)
        want, want_delta = real(ids, grid, b.ids.image_pad, 2)
        assert torch.equal(pos, want) and delta == want_delta
    assert len(calls) == 1
    other = b.positions(s, torch.tensor([[1, 6, 4]] * 4), 2)
    assert len(calls) == 2 and not torch.equal(other[0], pos)
