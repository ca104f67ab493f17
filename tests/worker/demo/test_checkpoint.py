"""The embedded demo checkpoint (worker/demo): shipped in the repository (trained on a GPU by the
recipe), loaded through the loader real checkpoints use, quality recorded and checked; the
recipe builder's cache reuse; the training data pipeline deterministic."""

from __future__ import annotations

from worker.scenes import DEFAULT_IMAGE_SIZE

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from worker.demo import build
from worker.demo.report import LIGHT_BAR, MIN_ADE_BAR, format_table, lead_situation_named, light_state_named

from tests import REPO_ROOT


@pytest.fixture(scope="module")
def ckpt() -> Path:
    """The shipped demo checkpoint (verified against its manifest; nothing is trained)."""
    from worker.demo_cache import demo_checkpoint

    return demo_checkpoint()


@pytest.fixture(scope="module")
def quality(ckpt) -> dict:
    return json.loads((ckpt / "quality.json").read_text())


@pytest.fixture(scope="module")
def runtime(ckpt):
    import torch

    from worker.model.runtime import AlpamayoRuntime

    return AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)


# ---------------------------------------------------------------- layout and loader

def test_shipped_layout(ckpt):
    from worker.demo_cache import shipped_dir

    assert ckpt == shipped_dir() / "checkpoint"
    assert build.is_complete(ckpt)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "preprocessor_config.json", "model.safetensors.index.json", "quality.json", "bev.png",
                 build.COMPLETE_MARKER):
        assert (ckpt / name).is_file(), name
    assert list(ckpt.glob("*.safetensors"))


def test_loads_through_the_real_loader(ckpt, quality):
    import torch

    from worker.model.checkpoint import load_model, validate_layout

    cfg, tensors = validate_layout(ckpt)
    assert any(k.startswith("vlm.model.visual.blocks.") for k in tensors)
    assert "expert.action_out_proj.weight" in tensors
    model, cfg2 = load_model(ckpt, device="cpu", dtype=torch.float32)
    assert cfg2.num_layers == quality["build"]["dims"]["layers"]
    assert sum(p.numel() for p in model.parameters()) == quality["build"]["parameters"]
    # the fitted action normalisation is what the runtime decodes with
    norm = quality["build"]["action_normalisation"]
    assert cfg2.action_space.accel_std == pytest.approx(norm["accel_std"])
    assert cfg2.action_space.curvature_std == pytest.approx(norm["curvature_std"])
    assert cfg2.min_pixels == cfg2.max_pixels == quality["build"]["model_pixels"]


# ---------------------------------------------------------------- recorded quality

def test_recorded_light_state_bar(quality):
    m = quality["metrics"]
    print("\n" + format_table(quality))
    assert m["scenes"] >= 40 and m["k"] == 3
    assert m["light_acc"] >= LIGHT_BAR, f"light state named in {m['light_acc']:.1%} of held-out samples"


def test_recorded_trajectory_bar(quality):
    m = quality["metrics"]
    assert np.isfinite(m["min_ade_m"]) and np.isfinite(m["min_fde_m"])
    assert m["min_fde_m"] >= m["min_ade_m"] * 0.5
    # Regression guard at the level reached (1.86 m on the GPU build); the bar
    # (MIN_ADE_BAR = 1.5 m) is not met yet and stays open in the issue tracker.
    assert m["min_ade_m"] <= 2.2, f"minADE@3 {m['min_ade_m']:.2f} m regressed (bar {MIN_ADE_BAR} m)"


def test_the_shipped_weights_are_the_shipped_recipe_run_to_its_end(quality):
    """The shipped files are what `demo-checkpoint --recipe gpu2 --device cuda` makes: every step
    of the recipe ran (no budget cut it short), on a GPU, from seed 0, at its image size."""
    b = quality["build"]
    recipe = build.RECIPES[build.SHIPPED_RECIPE]
    assert b["demo_version"] == build.DEMO_VERSION and b["seed"] == 0 and b["recipe"] == build.SHIPPED_RECIPE
    assert tuple(b["image_size"]) == recipe.image_size
    assert b["device"].startswith("cuda") and b["build_wall_s"] > 0
    assert b["train"]["steps"] == recipe.train["steps"]
    assert b["expert_refinement"]["steps"] == recipe.refine["steps"]
    assert [b["train_scene_seeds"][0], b["train_scene_seeds"][-1]] == \
        [build.train_seeds(0, recipe)[0], build.train_seeds(0, recipe)[-1]]
    assert b["heldout_scene_seeds"] == build.heldout_seeds(0, recipe) and len(b["heldout_scene_seeds"]) >= 64


def test_the_shipped_head_is_the_gpu_head_recipe_run_to_its_end(ckpt):
    """The shipped head is what `python -m worker.dflash.train --recipe gpu --device cuda` makes
    for the shipped checkpoint: every step of the recipe ran (its time budget did not cut it)."""
    import json

    from worker.demo_cache import demo_head
    from worker.dflash.train import HEAD_RECIPES

    meta = json.loads((demo_head(ckpt) / "alpamayo_dflash_metadata.json").read_text())
    training, recipe = meta["training"], HEAD_RECIPES["gpu"]
    assert training["recipe"] == "gpu" and training["device"].startswith("cuda") and training["seed"] == 0
    assert training["steps"] == recipe["steps"]
    assert training["sequences"] == recipe["train_scenes"] * 3 // 2     # half greedy K=1, half K=2 at T=0.6


# ---------------------------------------------------------------- the real inference path

def test_heldout_scene_reasoning_names_the_light(quality, runtime):
    from worker.scenes import generate_scene
    from worker.scenes.request import runtime_request

    seed = next(s for s in quality["build"]["heldout_scene_seeds"]
                if generate_scene(s).facts.traffic_light != "none")
    scene = generate_scene(seed)
    [res] = runtime.run([runtime_request(scene, "trajectory", num_samples=1, temperature=0.0)])
    assert res.error is None
    assert light_state_named(res.texts[0]) == scene.facts.traffic_light, res.texts[0]
    assert res.trajectories.shape == (1, 64, 3) and np.isfinite(res.trajectories).all()


def test_report_parsers_read_generator_text():
    from worker.scenes import generate_scene

    for seed in range(30):
        s = generate_scene(seed)
        assert light_state_named(s.text.reasoning) == s.facts.traffic_light
        assert lead_situation_named(s.text.reasoning) == s.facts.lead_relation
    assert light_state_named("gibberish") is None and lead_situation_named("") is None


# ---------------------------------------------------------------- cache reuse

def test_verifying_the_shipped_files_is_fast(ckpt):
    from worker import demo_cache

    demo_cache._verified.clear()
    t0 = time.perf_counter()
    assert demo_cache.demo_checkpoint() == ckpt
    assert time.perf_counter() - t0 < 2.0


def test_cli_prints_the_shipped_checkpoint_without_torch(ckpt, tmp_path):
    """A fresh process: the shipped checkpoint needs neither torch nor a build, and prints the table."""
    code = ("import sys, time; t=time.perf_counter(); from worker.demo.build import main; rc=main(['--quiet']); "
            "print('TORCH', 'torch' in sys.modules); print('SECONDS', time.perf_counter()-t); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert str(ckpt) in out.stdout and "light state named" in out.stdout
    assert "TORCH False" in out.stdout
    assert wall < 5.0, f"CLI on the shipped checkpoint took {wall:.1f}s"


def test_cli_json_prints_the_shipped_bars(ckpt):
    """`demo-checkpoint --json`: one JSON object with every bar key (measured on >= 64 held-out
    scenes when shipped) and whether each is met."""
    out = subprocess.run([sys.executable, "-m", "worker.cli", "demo-checkpoint", "--json"], cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.strip().splitlines()
    bars = json.loads(line)
    from worker.demo.report import BARS

    assert set(BARS) <= set(bars) and bars["scenes"] >= 64
    assert set(bars["met"]) == {k for k, (op, _) in BARS.items() if op}
    assert bars["met"]["light_named"] == (bars["light_named"] >= 0.95)


def test_incomplete_directory_is_not_reused(tmp_path, monkeypatch):
    d = build.checkpoint_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    assert not build.is_complete(d)
    calls = []

    def fake_build(out: Path, seed: int, progress: bool, *recipe_device_workers_budget) -> bool:
        calls.append(out)
        out.mkdir(parents=True)
        (out / build.COMPLETE_MARKER).write_text("")
        return True

    monkeypatch.setattr(build, "_build", fake_build)
    got = build.build_demo_checkpoint(tmp_path, progress=False)
    assert got == d and calls and build.is_complete(d) and not (d / "config.json").exists()
    assert build.build_demo_checkpoint(tmp_path, progress=False) == d and len(calls) == 1


# ---------------------------------------------------------------- determinism of the data pipeline

def test_training_data_pipeline_is_deterministic(ckpt, runtime, quality):
    """Same seeds -> same scenes -> same tokenizer (as the checkpoint's) -> same token sequences."""
    import torch

    from worker.demo import train
    from worker.demo.layout import build_tokenizer
    from worker.scenes import generate_scene
    from worker.scenes.request import runtime_request

    seeds = build.train_seeds(0)[:200]
    scenes = [generate_scene(s, DEFAULT_IMAGE_SIZE) for s in seeds]
    tok = build_tokenizer(build.tokenizer_corpus(scenes), 600)
    again = build_tokenizer(build.tokenizer_corpus([generate_scene(s, DEFAULT_IMAGE_SIZE) for s in seeds]), 600)
    assert json.loads(tok.to_str()) == json.loads(again.to_str())

    few = scenes[:2]
    a = train.build_examples(runtime, few, key_weights=(10.0, 3.0, 3.0))
    b = train.build_examples(runtime, [generate_scene(s, DEFAULT_IMAGE_SIZE) for s in seeds[:2]],
                             key_weights=(10.0, 3.0, 3.0))
    assert [e.task for e in a] == list(train.TASKS) * 2
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.positions, y.positions)
        assert torch.equal(x.weights, y.weights) and x.prompt_len == y.prompt_len
        assert np.array_equal(x.frames, y.frames)
        if x.task == "trajectory":
            assert torch.equal(x.action, y.action) and x.offset == y.offset
            assert x.input_ids[x.offset - 1] == runtime.ids.traj_future_start
    # the prompt part is exactly what inference builds
    traj = a[0]
    p = runtime._prepare(runtime_request(few[0], "trajectory"))
    assert torch.equal(traj.input_ids[:traj.prompt_len], p.input_ids)
    assert runtime.tok.decode(traj.target_ids.tolist(), skip_special_tokens=False) == \
        train.target_text(few[0], "trajectory")


def untrained_model(ckpt, seed: int = 0):
    """(model, runtime): a freshly initialised model of `ckpt`'s config (torch seed `seed`) and
    the CPU fp32 runtime over it, as the build makes them before training."""
    import torch

    from worker.model.config import AlpamayoConfig
    from worker.model.inputs import ImageProcessing
    from worker.model.modules import Alpamayo2
    from worker.model.runtime import AlpamayoRuntime
    from worker.model.tokenizer import load_tokenizer

    cfg = AlpamayoConfig.from_dir(ckpt)
    tok, ids = load_tokenizer(ckpt, cfg)
    torch.manual_seed(seed)
    model = Alpamayo2(cfg)
    return model, AlpamayoRuntime(model, cfg, tok, ids, ImageProcessing.from_dir(ckpt, cfg.min_pixels, cfg.max_pixels),
                                  torch.device("cpu"), torch.float32)


def test_a_training_step_moves_every_weight_of_a_model_the_runtime_was_built_over(ckpt):
    """The build makes the runtime (prompts, image processing) before it trains; building the
    runtime fuses q/k/v and gate/up into views, which once left those weights frozen (254 k of
    2.1 M parameters never trained)."""
    import torch

    from worker.demo import train
    from worker.scenes import generate_scene

    model, runtime = untrained_model(ckpt)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert not frozen, frozen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    examples = train.build_examples(runtime, [generate_scene(s, DEFAULT_IMAGE_SIZE) for s in build.train_seeds(0)[:2]],
                                    tasks=("trajectory",))
    train.train(model, runtime, examples, train.TrainConfig(steps=1, warmup=1, per_step=(("trajectory", 2),)))
    unchanged = [n for n, p in model.named_parameters() if p.ndim >= 2 and torch.equal(p, before[n])]
    assert not [n for n in unchanged if "language_model.layers" in n or "expert" in n], unchanged


_EXPERT_STEP = """
import sys, torch
from worker.demo import build, train
from worker.model.fused_ops import available
from worker.model.runtime import AlpamayoRuntime
from worker.scenes import DEFAULT_IMAGE_SIZE, generate_scene
rt = AlpamayoRuntime.load(sys.argv[1], device="cpu", dtype=torch.float32)
assert available(torch.zeros(1))                      # the fused kernels run here (interpreter)
rt.model.requires_grad_(True)
ex = train.build_examples(rt, [generate_scene(s, DEFAULT_IMAGE_SIZE) for s in build.train_seeds(0)[:1]],
                          tasks=("trajectory",))
layer0 = lambda: {n: p for n, p in rt.model.expert.named_parameters() if "layers.0." in n and p.ndim == 2}
before = {n: p.detach().clone() for n, p in layer0().items()}
train.refine_expert(rt.model, rt, train.trajectory_contexts(rt.model, rt, ex), train.RefineConfig(steps=1, warmup=1,
                    scenes_per_step=1, repeats=1))
still = [n for n, p in layer0().items() if torch.equal(p, before[n])]
print("unchanged:", still)
sys.exit(1 if still else 0)
"""


def test_expert_layers_train_where_the_fused_kernels_run(ckpt, tmp_path):
    """On a GPU (here: Triton's interpreter) the expert's forward runs fused kernels without a
    backward; training must run the reference ops or the expert's layers never learn (the first
    GPU build's flow loss stayed at 2.0)."""
    script = tmp_path / "expert_step.py"
    script.write_text(_EXPERT_STEP)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script), str(ckpt)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_fast_vision_paths_give_the_vision_tower_the_same_output(ckpt, runtime):
    """The fast vision paths (batched attention, linear patch embedding, rotary ids of
    one image tiled over equal grids) are exact, and transformers' per-image loop runs once."""
    import torch
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    from worker.model.fast_vision import fast_vision_paths
    from worker.scenes import generate_scene
    from worker.scenes.request import runtime_frames

    frames = runtime_frames(generate_scene(7, DEFAULT_IMAGE_SIZE))[0]
    pixels, grid = runtime.image_proc(torch.from_numpy(np.asarray(frames)))
    visual = runtime.model.vlm.model.visual
    calls = []
    original = modeling_qwen3_vl.get_vision_position_ids

    def counting(grid_thw, *args, **kwargs):
        calls.append(len(grid_thw))
        return original(grid_thw, *args, **kwargs)

    modeling_qwen3_vl.get_vision_position_ids = counting
    try:
        with torch.no_grad():
            slow = visual(pixels, grid_thw=grid).pooler_output
            assert calls == [len(grid)]
            with fast_vision_paths(runtime.model):
                fast = visual(pixels, grid_thw=grid).pooler_output
    finally:
        modeling_qwen3_vl.get_vision_position_ids = original
    assert calls == [len(grid), 1]                       # the fast path computed one image's ids
    assert len(grid) > 1 and torch.allclose(fast, slow, atol=1e-5, rtol=1e-5)


def test_fast_vision_paths_nested_keep_the_outer_paths_on_inner_exit(runtime):
    """A check inside training (perception's held-out accuracy within `train.train`) enters the
    paths again: leaving the inner context keeps the outer one's forwards (it once dropped them, and
    training went on 4x slower on the library's paths); leaving the outer restores the library's."""
    from worker.model.fast_vision import fast_vision_paths

    visual = runtime.model.vlm.model.visual
    patched = [visual.patch_embed] + [b.attn for b in visual.blocks]
    assert not any("forward" in m.__dict__ for m in patched)
    with fast_vision_paths(runtime.model):
        outer = [m.__dict__["forward"] for m in patched]
        with fast_vision_paths(runtime.model):
            pass
        assert [m.__dict__.get("forward") for m in patched] == outer
    assert not any("forward" in m.__dict__ for m in patched)


def test_the_prefill_given_its_prompt_on_the_host_reads_nothing_back_from_the_device(runtime):
    """The runtime's GPU prefill passes the image grid on the host and the prompt to the fast vision
    paths: the vision tower's grid-derived tensors are computed on the host once per grid (a second
    scene of that grid calls none of transformers' grid functions, which read a device grid with
    `.tolist()`), the library's placeholder check (a device count, formatted) is not run (the host
    counts), and the deepstack sums go by index, not boolean mask. Same outputs as without them;
    a prompt whose image tokens do not match the images is still refused."""
    import contextlib

    import torch
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    from worker.dflash.train import demo_requests
    from worker.model.fast_vision import fast_vision_paths

    prepared = runtime.prepare(demo_requests(range(91_000_000, 91_000_002))).ok
    vlm = runtime.model.vlm.model
    checked = []
    library_mask = type(vlm).get_placeholder_mask

    def recording(self, input_ids, inputs_embeds, image_features=None, video_features=None):
        checked.append(image_features is not None)
        return library_mask(self, input_ids, inputs_embeds, image_features, video_features)

    def forward(p, host: bool):
        pixels = runtime.image_proc(torch.from_numpy(np.asarray(p.req.frames)))[0]
        with fast_vision_paths(runtime.model, prompt_ids=p.input_ids) if host else contextlib.nullcontext():
            return vlm(input_ids=p.input_ids[None], pixel_values=pixels, image_grid_thw=p.grid,
                       position_ids=p.positions[:, None]).last_hidden_state

    vlm.visual.__dict__.pop("_grid_memo", None)
    type(vlm).get_placeholder_mask = recording
    try:
        with torch.no_grad():
            want = [forward(p, host=False) for p in prepared]
            assert checked == [True, True]
            first = forward(prepared[0], host=True)
            grid_functions = {n: getattr(modeling_qwen3_vl, n) for n in fast_vision_paths.GRID_FUNCTIONS}

            def refuse(*a, **k):
                raise AssertionError("a grid function ran for a grid already seen")
            for n in grid_functions:
                setattr(modeling_qwen3_vl, n, refuse)
            try:
                second = forward(prepared[1], host=True)
            finally:
                for n, fn in grid_functions.items():
                    setattr(modeling_qwen3_vl, n, fn)
            assert checked == [True, True, False, False]
            short = prepared[1].input_ids.clone()
            short[(short == vlm.config.image_token_id).nonzero()[0]] = 0
            with pytest.raises(ValueError, match="tokens: "):
                with fast_vision_paths(runtime.model, prompt_ids=short):
                    vlm(input_ids=short[None], pixel_values=runtime.image_proc(
                        torch.from_numpy(np.asarray(prepared[1].req.frames)))[0], image_grid_thw=prepared[1].grid,
                        position_ids=prepared[1].positions[:, None])
    finally:
        type(vlm).get_placeholder_mask = library_mask
    assert prepared[0].grid.tolist() == prepared[1].grid.tolist()
    for got, ref in zip((first, second), want):
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
