"""Model runtime on tiny random checkpoints of the real layout (CPU, fp32)."""

import json
import shutil
import threading

import numpy as np
import pytest
import torch

from worker.demo.layout import write_random_checkpoint
from worker.model.checkpoint import CheckpointError, load_model, validate_layout
from worker.model.runtime import AlpamayoRuntime, SceneRequest

from tests.worker.graph_replay import use_replaying_graphs

CAMS = (0, 1, 2, 3, 5, 6)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", max_shard_bytes=300_000)


@pytest.fixture(scope="module")
def rt(ckpt):
    torch.manual_seed(0)
    r = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    r.trajectory_max_new = 12
    return r


def scene(i=0, task="trajectory", k=1, temperature=0.0, seed=None, max_tokens=8, size=64):
    rng = np.random.default_rng(i)
    xyz = np.zeros((16, 3), np.float32)
    xyz[:, 0] = np.linspace(-1.5 * (5 + i), 0, 16)
    rot = np.tile(np.eye(3, dtype=np.float32), (16, 1, 1))
    fut = np.zeros((64, 3), np.float32)
    fut[:, 0] = np.arange(1, 65) * 0.1 * (5 + i)
    cams = (0, 1, 2, 3, 4, 5) if task == "vqa" else CAMS
    return SceneRequest(
        request_id=f"s{i}-{task}-{k}", task=task, frames=rng.integers(0, 255, (24, size, size, 3), dtype=np.uint8),
        camera_ids=cams, ego_history_xyz=xyz, ego_history_rot=rot, ego_future_xyz=fut,
        ego_future_rot=np.tile(np.eye(3, dtype=np.float32), (64, 1, 1)), num_samples=k,
        temperature=temperature, seed=seed if seed is not None else i, max_tokens=max_tokens,
        question="Is the light red?" if task in ("vqa", "grounding") else None)


class ExpertInputs:
    """Records what the action expert is given: the verified terminal positions and the K/V
    it may see (cache columns < offset)."""

    def __init__(self, rt):
        self.rt, self.seen = rt, []

    def __enter__(self):
        orig = self.rt.expert.sample

        def wrapped(cache, offset, rope_delta, keys, steps=10, **kw):
            self.seen.append((offset.clone(), [cache.k[:, r, :, :int(o)].clone() for r, o in enumerate(offset)]))
            return orig(cache, offset, rope_delta, keys, steps, **kw)
        self.rt.expert.sample = wrapped
        return self

    def __exit__(self, *exc):
        del self.rt.expert.sample


def assert_same_expert_inputs(a: ExpertInputs, b: ExpertInputs):
    for (oa, ka), (ob, kb) in zip(a.seen, b.seen, strict=True):
        assert torch.equal(oa, ob)                       # same verified terminal positions
        for x, y in zip(ka, kb):
            assert (x - y).abs().max() < 1e-5            # same K/V up to fp32 rounding


# ---------------------------------------------------------------- loader refusals

def copy_ckpt(ckpt, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    return d


def test_layout_ok(ckpt):
    cfg, tensors = validate_layout(ckpt)
    assert cfg.num_layers == 2
    assert any(k.startswith("vlm.model.visual.") for k in tensors)
    assert "vlm.lm_head.weight" in tensors and "expert.action_out_proj.bias" in tensors
    assert not any(k.startswith("expert.expert.embed_tokens") for k in tensors)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "preprocessor_config.json"])
def test_refuses_missing_file(ckpt, tmp_path, missing):
    d = copy_ckpt(ckpt, tmp_path)
    (d / missing).unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint {d}: missing {missing}"):
        validate_layout(d)


def test_refuses_truncated_shard(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"truncated shard {shard.name}: expected {size} bytes, found {size - 10}"):
        validate_layout(d)


def test_refuses_no_weights(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        validate_layout(d)


def test_refuses_shape_mismatch(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vlm_config"]["text_config"]["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp.*has shape \[.*\], config.json implies"):
        load_model(d)


def test_refuses_expert_layer_mismatch(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["expert_config"]["llm_config"]["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_hidden_layers=3 must equal"):
        validate_layout(d)


def test_refuses_index_mismatch(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["vlm.not_a_tensor"] = "model-00001-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="vlm.not_a_tensor"):
        validate_layout(d)


# ---------------------------------------------------------------- own decoder == transformers

def test_decoder_matches_transformers_forward(rt):
    req = scene(3)
    p = rt._prepare(req)
    logits, layer_kv, _ = rt._prefill([p], ())
    logits_last = logits[0]
    P = len(p.input_ids)
    cont = torch.tensor([15, 17, 40, 99, 120, 27, 33, 64, 80, 12])
    ids = torch.cat([p.input_ids, cont])
    pos = torch.cat([p.positions, (torch.arange(P, P + len(cont)) + p.rope_delta).expand(3, -1)], dim=1)
    with torch.no_grad():
        out = rt.model.vlm.model(input_ids=ids[None], pixel_values=p.pixel_values, image_grid_thw=p.grid,
                                 position_ids=pos[:, None], use_cache=False)
        ref = rt.model.lm_head(out.last_hidden_state[0]).float()
    assert torch.allclose(logits_last, ref[P - 1], atol=1e-4)
    # two rows: one decodes token by token, the other verifies blocks of 8 (ragged positions)
    cache = rt.decoder.new_cache(2, P + 32, torch.float32, "cpu")
    cache.load_prefix(layer_kv, slice(0, 2))
    delta = torch.tensor([p.rope_delta] * 2)
    for j in range(len(cont)):
        o = rt.decoder.forward(torch.tensor([[cont[j]], [cont[j]]]), torch.tensor([P + j, P + j]), delta, cache,
                               context_len=P + j + 1)
        assert (o.logits[0, 0] - ref[P + j]).abs().max() < 1e-4
    cache2 = rt.decoder.new_cache(2, P + 32, torch.float32, "cpu")
    cache2.load_prefix(layer_kv, slice(0, 2))
    # row 0 verifies cont[0:8] at P; row 1 first takes 2 tokens one by one, then verifies cont[2:10]
    for j in range(2):
        rt.decoder.forward(cont[j].view(1, 1).repeat(2, 1), torch.tensor([P + j] * 2), delta, cache2, P + j + 1)
    o = rt.decoder.forward(torch.stack([cont[0:8], cont[2:10]]), torch.tensor([P, P + 2]), delta, cache2, P + 10)
    assert (o.logits[0] - ref[P:P + 8]).abs().max() < 1e-4
    assert (o.logits[1] - ref[P + 2:P + 10]).abs().max() < 1e-4


# ---------------------------------------------------------------- generation properties

def test_shapes_and_timings(rt):
    (res,) = rt.run([scene(0, k=2, temperature=0.8)])
    assert res.error is None
    assert res.trajectories.shape == (2, 64, 3) and res.rotations.shape == (2, 64, 3, 3)
    assert np.isfinite(res.trajectories).all()
    assert np.allclose(np.linalg.det(res.rotations), 1.0, atol=1e-4)
    assert len(res.texts) == 2 and len(res.generated_tokens) == 2
    assert set(res.timings_ms) == {"image_prep", "prefill", "decode", "diffusion"}
    assert res.speculative is None


def test_determinism_under_seed(rt):
    a = rt.run([scene(1, k=2, temperature=0.9, seed=7)])[0]
    b = rt.run([scene(1, k=2, temperature=0.9, seed=7)])[0]
    assert a.texts == b.texts
    assert np.array_equal(a.trajectories, b.trajectories)


def test_samples_differ_at_temperature(rt):
    res = rt.run([scene(2, k=3, temperature=1.0, seed=3)])[0]
    assert len(set(res.texts)) > 1
    assert not np.allclose(res.trajectories[0], res.trajectories[1])


def test_greedy_k1_identical_across_seeds(rt):
    a = rt.run([scene(2, k=1, temperature=0.0, seed=1)])[0]
    b = rt.run([scene(2, k=1, temperature=0.0, seed=99)])[0]
    assert a.texts == b.texts


def test_sampling_knows_its_greedy_batches_from_the_host(rt, monkeypatch):
    """Whether every row of a batch is greedy comes from the requests, not from the device's
    temperatures (reading those waited for the whole prefill before the loop could be queued)."""
    from worker.model import runtime

    seen, start = [], runtime.start_batch
    monkeypatch.setattr(runtime, "start_batch", lambda *a, **kw: (seen.append(a[4].all_greedy), start(*a, **kw))[1])
    rt.run([scene(1), scene(2)])
    rt.run([scene(3), scene(4, temperature=0.7, seed=3)])
    assert seen == [True, False]


def test_shared_prefill_equals_separate_prefills(rt):
    shared = rt.run([scene(4, k=3, temperature=0.9, seed=5)])[0]
    rt.share_prefill = False
    try:
        separate = rt.run([scene(4, k=3, temperature=0.9, seed=5)])[0]
    finally:
        rt.share_prefill = True
    assert shared.texts == separate.texts
    assert np.allclose(shared.trajectories, separate.trajectories, atol=1e-5)


def test_batch_mates_do_not_change_results(rt):
    with ExpertInputs(rt) as ea:
        alone = rt.run([scene(5, k=2, temperature=0.9, seed=11)])[0]
    with ExpertInputs(rt) as eb:
        together = rt.run([scene(6, k=2, temperature=0.9, seed=2), scene(5, k=2, temperature=0.9, seed=11)])[1]
    assert alone.token_ids == together.token_ids
    # the expert sees the same terminal positions and K/V up to fp32 rounding (reduction order
    # differs with the batch's shapes; an untrained expert amplifies that, so compare its inputs)
    (oa, ka), (ob, kb) = ea.seen[0], eb.seen[0]
    assert torch.equal(oa, ob[2:]) and all((x - y).abs().max() < 1e-5 for x, y in zip(ka, kb[2:]))


@pytest.mark.parametrize("task", ["meta_action", "auto_labeling", "vqa", "grounding"])
def test_text_tasks_run(rt, task):
    res = rt.run([scene(0, task=task, max_tokens=6)])[0]
    assert res.error is None, res.error
    assert res.trajectories is None
    assert 1 <= res.generated_tokens[0] <= 6
    assert len(res.outputs) == 1


def test_bad_scene_does_not_fail_batch_mates(rt):
    bad = scene(7)
    bad.ego_history_xyz = None
    good = scene(8)
    out = rt.run([bad, good])
    assert out[0].error[0] == "missing_egomotion"
    assert out[1].error is None and out[1].trajectories.shape == (1, 64, 3)


def test_fp8_agrees_with_full_precision(ckpt):
    ref = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    q = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32, precision="fp8")
    p = ref._prepare(scene(9))
    a = ref._prefill([p], ())[0][0]
    b = q._prefill([p], ())[0][0]
    rel = ((a - b).norm() / a.norm()).item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    # e4m3 with per-channel scales: relative logit error a few percent on random weights
    assert rel < 0.08 and cos > 0.995, (rel, cos)


def test_persistent_cache_path_matches(ckpt):
    """The CUDA-graph path (persistent cache, rows padded to a bucket, attention over the whole
    capacity) runs eagerly on CPU and gives the same tokens as the per-batch cache."""
    plain = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    graphed = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    graphed.enable_graphs(max_rows=8, capacity=512)
    for r in (plain, graphed):
        r.trajectory_max_new = 10
    reqs = [scene(1, k=3, temperature=0.7, seed=4)]            # 3 rows -> bucket of 4 (one padded row)
    a, b = plain.run(reqs)[0], graphed.run(reqs)[0]
    assert a.token_ids == b.token_ids
    assert graphed.decoder.persistent is not None and graphed.decoder.persistent.rows == 8
    c = graphed.run([scene(2, k=1, temperature=0.0), scene(3, k=1, temperature=0.0)])
    d = plain.run([scene(2, k=1, temperature=0.0), scene(3, k=1, temperature=0.0)])
    assert [x.token_ids for x in c] == [x.token_ids for x in d]


def test_graphed_decoding_steps_give_the_plain_tokens(ckpt):
    """Over the persistent cache each decoding step (forward, sampling, commit) is one graph
    (generate.run_step); replayed here on the CPU over its captured buffers, two batches of
    different widths and sampling give the tokens and trajectories of the same path run plainly."""
    plain = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    graphed = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    plain.enable_graphs(max_rows=8, capacity=512)
    graphed.enable_graphs(max_rows=8, capacity=512)
    graphs = use_replaying_graphs(graphed)
    batches = ([scene(1, k=3, temperature=0.7, seed=4)], [scene(2, k=1), scene(3, k=1)], [scene(5, k=1), scene(6, k=1)])
    for reqs, max_new in zip(batches, (10, 10, 7)):
        for r in (plain, graphed):
            r.trajectory_max_new = max_new
        a, b = plain.run(reqs), graphed.run(reqs)
        assert [x.token_ids for x in a] == [x.token_ids for x in b]
        assert all(np.array_equal(x.trajectories, y.trajectories) for x, y in zip(a, b))
    # one graph each for greedy and sampled steps at 4 and 2 rows, whatever max_new
    steps = sorted(k[1:] for k in graphs._graphs if k[0] == "baseline")
    assert [(rows, greedy) for rows, *_, greedy in steps] == [(2, True), (4, False)], steps
    assert graphs.replays > 10


def test_frames_shrunk_at_intake_give_the_same_results(rt):
    """Large frames reduced by ImageProcessing.shrink (what intake keeps while a job is queued)
    run exactly like the full-size frames; frames already at the target size are kept as is."""
    big = scene(3, size=256, temperature=0.0)
    shrunk = SceneRequest(**{**vars(big), "request_id": "shrunk",
                             "frames": np.stack([rt.image_proc.shrink(f) for f in big.frames])})
    assert shrunk.frames.dtype == np.float32 and shrunk.frames.nbytes < big.frames.nbytes
    a, b = rt.run([big, shrunk])
    assert a.error is None and b.error is None
    assert a.texts == b.texts and np.array_equal(a.trajectories, b.trajectories)
    small = scene(4).frames[0]
    assert rt.image_proc.shrink(small).dtype == np.uint8 and np.array_equal(rt.image_proc.shrink(small), small)


def test_refuses_index_that_omits_a_tensor_a_shard_holds(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    name = sorted(idx["weight_map"])[5]
    del idx["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="does not list") as e:
        validate_layout(d)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_loading_never_initialises_weights_randomly(ckpt, monkeypatch):
    """The model is built without an initialisation pass (each checkpoint byte is written once):
    no random fill of any real (non-meta) tensor while loading."""
    fills = []
    for method in ("uniform_", "normal_", "trunc_normal_"):
        orig = getattr(torch.Tensor, method, None)
        if orig is None:
            continue

        def counting(self, *a, _orig=orig, **kw):
            if self.device.type != "meta" and self.numel() > 1:
                fills.append(tuple(self.shape))
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, method, counting)
    model, _ = load_model(ckpt, device="cpu", dtype=torch.float32)
    assert fills == [], f"{len(fills)} random fills, e.g. {fills[:3]}"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_generation_config_stop_ids_end_text_tasks(ckpt, tmp_path):
    """eos_token_id of generation_config.json ends text-task generation like the built-in stops."""
    d = copy_ckpt(ckpt, tmp_path)
    plain = AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32)
    req = scene(4, task="vqa", max_tokens=12)
    toks = plain.run([req])[0].token_ids[0]
    assert len(toks) > 2
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [toks[1]], "do_sample": False}))
    stopped = AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32)
    assert stopped.stop_ids == (toks[1],)
    assert stopped.run([req])[0].token_ids[0] == toks[:toks.index(toks[1]) + 1]


def test_generation_config_with_bad_ids_is_refused(ckpt, tmp_path):
    d = copy_ckpt(ckpt, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [10 ** 9]}))
    with pytest.raises(CheckpointError, match="generation_config.json eos_token_id"):
        AlpamayoRuntime.load(d, device="cpu", dtype=torch.float32)


def test_loading_logs_one_line_per_shard(ckpt, caplog):
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    with caplog.at_level("INFO", logger="alpamayo.model"):
        load_model(ckpt, device="cpu", dtype=torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded shard")]
    assert len(lines) == len(shards) > 1
    assert lines[-1].startswith(f"loaded shard {len(shards)}/{len(shards)} {shards[-1]}") and "GB/s" in lines[-1]


def test_frames_are_staged_on_the_prep_pool_with_the_same_pixels(rt, monkeypatch):
    from worker.model import staging

    req = scene(3)
    pooled = rt._prepare(req, rt._prep_pool)
    eager = rt._prepare(req)
    direct = rt.image_proc(torch.from_numpy(req.frames))[0]      # the preprocessing of every scene before
    assert torch.equal(rt._pixel_values(pooled), eager.pixel_values) and torch.equal(eager.pixel_values, direct)
    threads, preprocess = [], staging.StagedFrames._preprocess
    monkeypatch.setattr(staging.StagedFrames, "_preprocess",
                        lambda self, frames: (threads.append(threading.current_thread().name),
                                              preprocess(self, frames))[1])
    first = rt.run([scene(1), scene(2)])
    assert len(threads) == 2 and all(t.startswith("image-prep") for t in threads), threads
    monkeypatch.undo()
    again = rt.run([scene(1), scene(2)])
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(r.timings_ms["image_prep"] > 0 for r in first)


def test_frames_are_staged_before_the_prompt_work(rt, monkeypatch):
    """On the H200 a 24-frame scene's pinned copy took ~8 ms on one thread, started after the
    prompt's ~5 ms of host work: the scene's first kernel waited for both. The frames go to the
    pool before the prompt is encoded."""
    order = []

    class Pool:
        def submit(self, fn, frames, *span):
            order.append(("stage", len(frames)))
            return rt._prep_pool.submit(fn, frames, *span)
    encode = rt.prompts.encode
    monkeypatch.setattr(rt.prompts, "encode", lambda *a: (order.append(("prompt", 0)), encode(*a))[1])
    req = scene(3)
    p = rt._prepare(req, Pool())
    assert order == [("stage", 24), ("prompt", 0)]
    assert torch.equal(rt._pixel_values(p), rt.image_proc(torch.from_numpy(req.frames))[0])


def test_warmup_frames_are_full_hd_on_cuda_and_small_elsewhere(rt, monkeypatch):
    """On the GPU the warm-up scene has the fleet's full-HD frames (its first real 24-image batch
    otherwise compiled and tuned the prompt-size shapes: about 15 s on the H200); the CPU's stays
    64x64. The warm-up runs one scene per K with frames of that size."""
    from worker.model.runtime import warmup_frame_hw

    assert warmup_frame_hw(torch.device("cuda")) == (1080, 1920)
    assert warmup_frame_hw(torch.device("cpu")) == (64, 64)
    seen = []
    monkeypatch.setattr(rt, "run", lambda reqs: seen.extend((r.num_samples, r.frames.shape) for r in reqs))
    rt.warmup([1, 3])
    assert seen == [(1, (24, 64, 64, 3)), (3, (24, 64, 64, 3))]


def test_warmup_captures_the_expert_loop_at_every_rows_bucket_a_batch_can_take(rt, monkeypatch):
    """With graphs on, a batch after the warm-up finds its expert loop already captured: the
    warm-up covers every rows bucket up to max_rows (on the H200 the first batch of 16 scenes
    otherwise captured it on the clock, compiling the kernels its rows take: 1.43 s of
    diffusion against 0.18 s for the next batch)."""
    from worker.model.graphs import GraphCache

    class Recording(GraphCache):                     # graphs "on" on the CPU: each key recorded, run plainly
        def __init__(self):
            super().__init__(enabled=False)
            self.enabled, self.keys = True, []

        def run(self, key, fn, *inputs):
            self.keys.append(key)
            return fn(*inputs)

    rec = Recording()
    for obj, name, value in ((rt, "graphs", rec), (rt.decoder, "graphs", rec), (rt, "max_rows", 4),
                             (rt, "capacity", 1024), (rt.decoder, "persistent", None)):
        monkeypatch.setattr(obj, name, value)
    rt.warmup([1])
    warm = {key for key in rec.keys if key[0] == "expert"}
    assert {key[1] for key in warm} == {1, 2, 4}
    rec.keys.clear()
    rt.run([scene(1), scene(2), scene(3)])                  # 3 rows: padded to the bucket of 4
    used = {key for key in rec.keys if key[0] == "expert"}
    assert used and used <= warm, (used, warm)


def test_prefill_groups_are_runs_of_one_prompt_length_within_the_budget():
    from worker.model.memory_plan import PREFILL_TOKENS, prefill_groups

    assert prefill_groups([630] * 16, PREFILL_TOKENS) == [slice(0, 6), slice(6, 12), slice(12, 16)]   # the demo's
    assert prefill_groups([4623, 4623], PREFILL_TOKENS) == [slice(0, 1), slice(1, 2)]     # a 32B scene goes alone
    assert prefill_groups([5, 5, 7, 7, 5], 100) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert prefill_groups([5, 5], 0) == [slice(0, 1), slice(1, 2)]
    assert prefill_groups([], PREFILL_TOKENS) == []


def test_scenes_of_one_prompt_length_prefill_in_one_pass_with_the_same_results(rt, monkeypatch):
    from worker.model import runtime

    passes = []
    prefill = rt._prefill
    monkeypatch.setattr(rt, "_prefill", lambda ps, capture: (passes.append(len(ps)), prefill(ps, capture))[1])
    batch = [scene(20 + i, k=2, temperature=0.8, seed=i) for i in range(3)]
    together = rt.run(batch)
    assert passes == [3]
    monkeypatch.setattr(runtime, "PREFILL_TOKENS", 0)          # one scene a pass
    alone = rt.run(batch)
    assert passes == [3, 1, 1, 1]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and a.texts == b.texts
        assert np.allclose(a.trajectories, b.trajectories, atol=1e-4)
        assert a.timings_ms["prefill"] > 0
