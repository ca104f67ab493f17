"""Loading paths besides the bf16 shards: ModelOpt FP8 exports, ALPAMAYO_LOAD_FORMAT=dummy, and
the meta-device build (CPU, tiny checkpoints of the real layout)."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.config import ConfigError, load_settings
from worker.demo.layout import write_random_checkpoint
from worker.model.checkpoint import CheckpointError, load_model
from worker.model.fp8 import E4M3_MAX, Fp8Linear
from worker.model.modelopt import is_fp8_weight
from worker.model.runtime import AlpamayoRuntime, SceneRequest

SUPPORT = ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", max_shard_bytes=300_000)


def scene(i=0):
    rng = np.random.default_rng(i)
    xyz = np.zeros((16, 3), np.float32)
    xyz[:, 0] = np.linspace(-10, 0, 16)
    return SceneRequest(request_id=f"s{i}", task="trajectory", frames=rng.integers(0, 255, (24, 64, 64, 3), np.uint8),
                        camera_ids=(0, 1, 2, 3, 5, 6), ego_history_xyz=xyz,
                        ego_history_rot=np.tile(np.eye(3, dtype=np.float32), (16, 1, 1)), temperature=0.0)


def modelopt_export(ckpt, out, per_tensor_every: int = 0):
    """A ModelOpt-style FP8 directory from a checkpoint: the linear weights the fp8 profiles
    quantise (`is_fp8_weight`: decoder layers, the vision tower's blocks and mergers) in
    float8_e4m3fn with `weight_scale` (per channel, or per tensor for every n-th layer with
    per_tensor_every=n) and `input_scale`, the rest as it was, and hf_quant_config.json."""
    model, _ = load_model(ckpt, device="cpu", dtype=torch.float32)
    state = dict(model.state_dict())
    quantised = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                 and is_fp8_weight(n + ".weight", m.weight.shape)]
    for i, name in enumerate(quantised):
        w = state[name + ".weight"].float()
        per_tensor = per_tensor_every and i % per_tensor_every == 0
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
        scale = (amax / E4M3_MAX).clamp(min=1e-12)
        state[name + ".weight"] = (w / (scale if per_tensor else scale[:, None])).to(torch.float8_e4m3fn)
        state[name + ".weight_scale"] = scale.reshape(()) if per_tensor else scale
        state[name + ".input_scale"] = torch.tensor(0.05)
    out.mkdir(parents=True)
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for shard, keys in (("model-00001-of-00002.safetensors", names[:half]),
                        ("model-00002-of-00002.safetensors", names[half:])):
        save_file({k: state[k].contiguous() for k in keys}, str(out / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in SUPPORT:
        shutil.copy(ckpt / f, out / f)
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.31.0"},
         "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    return out, quantised


@pytest.fixture(scope="module")
def fp8_dir(ckpt, tmp_path_factory):
    return modelopt_export(ckpt, tmp_path_factory.mktemp("fp8") / "ckpt", per_tensor_every=3)


def test_modelopt_fp8_export_loads_into_fp8_layers_and_serves(ckpt, fp8_dir):
    d, quantised = fp8_dir
    rt = AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32, precision="fp8")
    modules = dict(rt.model.named_modules())
    disk = {**load_file(str(d / "model-00001-of-00002.safetensors")),
            **load_file(str(d / "model-00002-of-00002.safetensors"))}
    for name in quantised:
        m = modules[name]
        assert isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(m.weight.view(torch.uint8), disk[name + ".weight"].view(torch.uint8))   # bytes as written
        assert torch.equal(m.weight_scale, disk[name + ".weight_scale"].float().expand(m.out_features))
        assert float(m.input_scale) == pytest.approx(0.05)
        if name + ".bias" in disk:                             # the vision tower's layers have one
            assert torch.equal(m.bias, disk[name + ".bias"])
    assert any(n.startswith("vlm.model.visual.blocks.") for n in quantised)
    assert any(n.startswith("vlm.model.visual.merger.") for n in quantised)
    out = rt.run([scene(1)])[0]
    assert out.error is None and out.trajectories.shape == (1, 64, 3) and np.isfinite(out.trajectories).all()
    # the export's logits stay with the bf16 checkpoint's (e4m3 rounding only)
    ref = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    p = ref._prepare(scene(2))
    a, b = ref._prefill([p], ())[0][0], rt._prefill([p], ())[0][0]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() > 0.995


def test_per_channel_export_equals_load_time_quantisation(ckpt, tmp_path):
    """Per-channel scales as Fp8Linear computes them: the pre-quantised directory and the bf16
    checkpoint quantised at load give the same model (the load-time fallback stays exact)."""
    d, _ = modelopt_export(ckpt, tmp_path / "pc")
    loaded, _ = load_model(d, device="cpu", dtype=torch.float32, precision="fp8")
    quantised_at_load, _ = load_model(ckpt, device="cpu", dtype=torch.float32, precision="fp8")
    a, b = loaded.state_dict(), quantised_at_load.state_dict()
    assert set(a) - {k for k in a if k.endswith("input_scale")} == set(b)
    for k, v in b.items():
        if v.dtype == torch.float8_e4m3fn:
            assert torch.equal(a[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert torch.allclose(a[k], v.to(a[k].dtype), rtol=1e-6, atol=0), k


def _edit(d, tmp_path, drop=None, replace=None):
    out = tmp_path / "edited"
    shutil.copytree(d, out)
    for shard in out.glob("*.safetensors"):
        part = load_file(str(shard))
        if drop in part or (replace and replace[0] in part):
            part.pop(drop, None)
            if replace:
                part[replace[0]] = replace[1]
            save_file(part, str(shard))
            idx = json.loads((out / "model.safetensors.index.json").read_text())
            idx["weight_map"].pop(drop, None)
            (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    return out


def test_mismatched_fp8_checkpoints_are_refused_in_one_line(fp8_dir, tmp_path):
    d, quantised = fp8_dir
    name = quantised[1]
    cases = [
        (d, "bf16", "ModelOpt FP8 export.*set NIM_MODEL_PROFILE=fp8"),
        (_edit(d, tmp_path / "a", drop=name + ".weight_scale"), "fp8", f"{name}.weight_scale is missing"),
        (_edit(d, tmp_path / "b", replace=(name + ".weight_scale", torch.ones(3))), "fp8",
         f"{name}.weight_scale has shape \\[3\\]"),
    ]
    no_decl = tmp_path / "c"
    shutil.copytree(d, no_decl)
    (no_decl / "hf_quant_config.json").unlink()
    cases.append((no_decl, "fp8", "neither hf_quant_config.json nor config.json quantization_config"))
    nvfp4 = tmp_path / "e"
    shutil.copytree(d, nvfp4)
    (nvfp4 / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    cases.append((nvfp4, "fp8", "quant_algo='NVFP4' is not served"))
    for path, precision, message in cases:
        with pytest.raises(CheckpointError, match=message) as e:
            load_model(path, device="cpu", dtype=torch.float32, precision=precision)
        assert "\n" not in str(e.value)


def test_config_quantization_config_declares_modelopt(fp8_dir, tmp_path):
    d, _ = fp8_dir
    out = tmp_path / "q"
    shutil.copytree(d, out)
    (out / "hf_quant_config.json").unlink()
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (out / "config.json").write_text(json.dumps(config))
    model, _ = load_model(out, device="cpu", dtype=torch.float32, precision="fp8")
    assert isinstance(model.language_model.layers[0].mlp.down_proj, Fp8Linear)


def test_dummy_load_format_needs_only_the_config_files(ckpt, tmp_path):
    d = tmp_path / "config-only"
    d.mkdir()
    for f in SUPPORT:
        shutil.copy(ckpt / f, d / f)
    real, _ = load_model(ckpt, device="cpu", dtype=torch.float32)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(d, device="cpu", dtype=torch.float32)
    dummy, _ = load_model(d, device="cpu", dtype=torch.bfloat16, load_format="dummy")
    a, b = real.state_dict(), dummy.state_dict()
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in b.items()}
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v).all() for v in b.values())
    assert b["vlm.lm_head.weight"].std() > 0
    rt = AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32, precision="fp8", load_format="dummy")
    rt.trajectory_max_new = 4
    assert rt.run([scene(3)])[0].error is None


def test_load_format_setting():
    assert load_settings({}).load_format == "auto"
    assert load_settings({"ALPAMAYO_LOAD_FORMAT": "dummy"}).load_format == "dummy"
    with pytest.raises(ConfigError, match="ALPAMAYO_LOAD_FORMAT='pt' is not valid: use one of auto, dummy") as e:
        load_settings({"ALPAMAYO_LOAD_FORMAT": "pt"})
    assert "\n" not in str(e.value)


def test_meta_device_build_matches_a_constructed_model(ckpt):
    """Built on the meta device and filled from the shards: the same weights and computed buffers
    (rotary and Fourier frequencies) as a model constructed normally and given the state dict."""
    from worker.model.config import AlpamayoConfig
    from worker.model.modules import Alpamayo2

    loaded, cfg = load_model(ckpt, device="cpu", dtype=torch.float32)
    ref = Alpamayo2(AlpamayoConfig.from_dir(ckpt)).eval()
    ref.load_state_dict(loaded.state_dict())
    buffers = dict(loaded.named_buffers())
    for name, value in ref.named_buffers():
        assert torch.equal(buffers[name], value), name
    assert len(buffers) == len(dict(ref.named_buffers()))


def test_engine_serves_a_config_only_directory_with_dummy_weights_and_a_random_head(ckpt, tmp_path):
    from worker.engine import Engine

    d = tmp_path / "config-only"
    d.mkdir()
    for f in SUPPORT:
        shutil.copy(ckpt / f, d / f)
    engine = Engine(load_settings({"NIM_FT_CHECKPOINT": str(d), "ALPAMAYO_DEVICE": "cpu",
                                   "NIM_MODEL_PROFILE": "bf16-dflash2", "ALPAMAYO_LOAD_FORMAT": "dummy",
                                   "ALPAMAYO_MAX_REASONING_TOKENS": "4"}))
    engine.load(warmup=False)
    engine.runtime.trajectory_max_new = 4
    out = engine.infer([scene(5)])[0]
    assert out.error is None and out.speculative is not None
    assert engine.models_payload()["data"][0]["speculative_decoding"] == "dflash2"


def test_each_next_shard_is_read_ahead_while_one_is_copied(ckpt, monkeypatch):
    import os

    advised = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append(os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[1])
        return real(fd, offset, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", record)
    load_model(ckpt, device="cpu", dtype=torch.float32)
    assert advised == sorted(p.name for p in ckpt.glob("*.safetensors"))[1:]


_RSS_PROBE = r"""
import resource, sys, time
from pathlib import Path
import torch
from safetensors.torch import save_file
from worker.model.checkpoint import Staging, copy_shard, read_safetensors_header

d = Path(sys.argv[1])
src = {"a": torch.ones(48 << 20, dtype=torch.bfloat16), "b": torch.full((16 << 20,), 2.0)}   # 96 MB + 64 MB
save_file(src, str(d / "s.safetensors"))
del src
params = {"a": torch.zeros(48 << 20, dtype=torch.bfloat16), "b": torch.zeros(16 << 20, dtype=torch.bfloat16)}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tensors = read_safetensors_header(d / "s.safetensors", "probe")
copy_shard(d / "s.safetensors", tensors, params, Staging(torch.device("cpu")))
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
assert bool((params["a"] == 1).all()) and bool((params["b"] == 2).all())
print(grew)
"""


def test_reading_a_shard_holds_no_copy_of_it_in_host_memory(tmp_path):
    """A 160 MB shard read into preallocated parameters (one of the file's dtype, one converted
    from fp32) grows the process's peak resident memory by at most one 64 MiB staging buffer and
    slack, not by the shard (safetensors' load_file maps it and materialises every tensor)."""
    import subprocess
    import sys

    from tests import REPO_ROOT

    p = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path)], capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout) <= 64 + 24, p.stdout


def test_the_fp8_profile_quantises_the_vision_towers_linears_too(ckpt):
    """A 24-image scene's vision tower multiplies about 17,600 patch rows on the 32B shape (24 ms
    of bf16 products in a 346 ms fp8 prefill on the H200): its blocks' and mergers' linears run
    in fp8 like the decoder layers'; the patch embedding and the position table stay."""
    model, _ = load_model(ckpt, device="cpu", dtype=torch.float32, precision="fp8")
    visual = model.vlm.model.visual
    block = visual.blocks[0]
    for m in (block.attn.qkv, block.attn.proj, block.mlp.linear_fc1, block.mlp.linear_fc2,
              visual.merger.linear_fc1, visual.merger.linear_fc2):
        assert isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn and m.bias is not None
    assert visual.patch_embed.proj.weight.dtype == torch.float32
    assert visual.pos_embed.weight.dtype == torch.float32
    assert not isinstance(model.vlm.lm_head, Fp8Linear)
