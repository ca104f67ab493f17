"""The model runtime the engine (worker/engine.py) drives: a batch of validated scenes (one task,
one K) in, per-scene results with per-stage timings out.

Per batch: image prep and prefill run a pass per run of scenes with one prompt length (at most
`memory_plan.PREFILL_TOKENS` prompt tokens a pass; the vision tower and the prompts' K/V are
computed once per scene through transformers' Qwen3-VL; on the GPU with the fused layers of
`layers.FusedStack.prefilling` and the batched vision attention of `fast_vision`); each prompt's cache is forked K
ways into the static cache; all rows then decode together (baseline, or DFlash2 for trajectory requests
on a dflash2 profile); trajectory rows end with the flow-matching expert over the cache up to
each row's own `<|traj_future_start|>`.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from schemas import TASKS_NEEDING_EGOMOTION
from worker.model import text_tasks
from worker.model.action_space import action_to_trajectory, estimate_initial_speed, quat_wxyz_to_matrix
from worker.model.checker import SceneChecker, checker_inputs, load_checker
from worker.model.checkpoint import load_model
from worker.model.config import AlpamayoConfig, TokenIds
from worker.model.decoder import TextDecoder
from worker.model.expert import ActionExpert
from worker.model.fast_vision import fast_vision_paths
from worker.model.fused_ops import available as fused_available
from worker.model.generate import Speculator, baseline_decode, start_batch
from worker.model.graphs import GraphCache, bucket
from worker.model.inputs import ImageProcessing, PromptBuilder, PromptSpec, to_device, to_host
from worker.model.memory_plan import PREFILL_TOKENS, prefill_groups
from worker.model.sampling import SamplingParams, sample_key
from worker.model.staging import StagedFrames, reserve_pinned
from worker.model.tokenizer import generation_stop_ids, load_chat_template, load_tokenizer
from worker.model.trajectory_tokens import future_tokenizer_from_config, history_tokenizer_from_config
from worker.uncertainty import checker_disagreement

TRAJECTORY_MAX_NEW = 256
PREP_THREADS = min(8, os.cpu_count() or 1)     # frame pieces staged at once (worker/model/staging.py)
CALIBRATION_CONTEXT = 4400     # live positions per row when step costs are measured (a 24-image prompt)
CPU_CALIBRATION_CONTEXT = 256  # the same on the CPU reference path (the tests' small scenes)
DEFAULT_MAX_NEW = {"trajectory": TRAJECTORY_MAX_NEW, "meta_action": 512, "auto_labeling": 1024,
                   "vqa": 1024, "grounding": 1024}


@dataclass
class SceneRequest:
    """One validated scene job, decoded (no wire format here)."""

    request_id: str
    task: str
    frames: np.ndarray                          # (N_cam * N_frames, H, W, 3) uint8, camera-major
    camera_ids: tuple[int, ...]
    num_frames: int = 4
    ego_history_xyz: np.ndarray | None = None   # (16, 3)
    ego_history_rot: np.ndarray | None = None   # (16, 3, 3)
    ego_future_xyz: np.ndarray | None = None    # (64, 3)
    ego_future_rot: np.ndarray | None = None    # (64, 3, 3)
    num_samples: int = 1
    temperature: float = 0.6
    top_p: float = 0.98
    top_k: int | None = None
    seed: int = 0
    max_tokens: int | None = None
    nav_text: str | None = None
    question: str | None = None


@dataclass
class SceneResult:
    request_id: str
    task: str
    texts: list[str] = field(default_factory=list)
    outputs: list[text_tasks.TaskOutput] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)   # generated ids per sample
    trajectories: np.ndarray | None = None      # (K, 64, 3) float32
    checker_trajectory: np.ndarray | None = None  # (64, 2) float32: the independent checker's (K >= 2)
    checker_ade_m: float = 0.0                  # the checker's own held-out ADE (its config)
    rotations: np.ndarray | None = None         # (K, 64, 3, 3) float32
    timings_ms: dict[str, float] = field(default_factory=dict)
    speculative: Any = None                     # the speculator's merge_stats (worker/dflash/metrics.SpecStats)
    warnings: list[str] = field(default_factory=list)
    error: tuple[str, str] | None = None        # (error code, message) when this scene failed

    @property
    def checker_disagreement_m(self) -> float | None:
        """The samples' disagreement with the checker (`worker.uncertainty.checker_disagreement`),
        or None without a checker trajectory."""
        if self.checker_trajectory is None or self.trajectories is None:
            return None
        return checker_disagreement(self.checker_trajectory, self.trajectories, self.checker_ade_m)


WARMUP_FRAME_HW_CUDA = (1080, 1920)      # the fleet cameras' frames (full HD), as the 32B bench sends


def warmup_frame_hw(device: torch.device) -> tuple[int, int]:
    """Frame size of the warm-up scenes: full HD on CUDA, 64x64 elsewhere (the CPU serves the
    small demo model, whose warm-up must stay cheap)."""
    return WARMUP_FRAME_HW_CUDA if device.type == "cuda" else (64, 64)


class InferenceError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Prepared:
    req: SceneRequest
    input_ids: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    grid: torch.Tensor
    hist_xyz: torch.Tensor | None
    hist_rot: torch.Tensor | None
    image_prep_ms: float                          # host work: prompt, frames staging
    staged: StagedFrames                          # the frames on their way to the device
    pixel_values: torch.Tensor | None = None      # set by AlpamayoRuntime._pixel_values


@dataclass
class PreparedBatch:
    """`AlpamayoRuntime.prepare`'s product, what `run` takes: the requests in order, their results
    (errors filled for scenes that cannot run), the scenes that run and their reasoning limits."""
    requests: list[SceneRequest]
    results: dict[str, SceneResult]
    ok: list[_Prepared]
    max_new: list[int]


class _Marks:
    """Stage boundaries without a host sync between stages: CUDA events on the GPU (read once,
    after the batch), wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1000.0 for a, b in zip(self.marks, self.marks[1:])]


class AlpamayoRuntime:
    def __init__(self, model, cfg: AlpamayoConfig, tokenizer, token_ids: TokenIds, image_proc: ImageProcessing,
                 device: torch.device, dtype: torch.dtype, speculator: Speculator | None = None,
                 max_model_len: int | None = None):
        self.model = model
        self.cfg = cfg
        self.tok = tokenizer
        self.ids = token_ids
        self.image_proc = image_proc
        self.device = device
        self.dtype = dtype
        self.speculator = speculator
        self.checker: SceneChecker | None = None   # the checkpoint's independent checker (worker.model.checker)
        self._prep_pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="image-prep")
        self.stop_ids: tuple[int, ...] = ()      # generation_config.json eos ids (text tasks)
        self.max_model_len = max_model_len
        self.share_prefill = True
        self.graphs = GraphCache(enabled=False)
        self.max_rows, self.capacity = 0, 0
        self.trajectory_max_new = TRAJECTORY_MAX_NEW   # reasoning cap (the release's 256)
        self.decoder = TextDecoder(model.language_model, model.lm_head)
        self.expert = ActionExpert(model.expert, cfg.action_space.n_waypoints)
        self.history_tok = history_tokenizer_from_config(cfg.raw)
        self.future_tok = future_tokenizer_from_config(cfg.raw)
        self.prompts = PromptBuilder(tokenizer, token_ids, cfg.tokens_per_history_traj, cfg.tokens_per_future_traj,
                                     cfg.include_camera_ids, cfg.frame_label)
        vocab = int(cfg.text["vocab_size"])
        lo, hi = token_ids.traj_token_range
        banned = torch.zeros(vocab, dtype=torch.bool)
        banned[lo:hi] = True
        banned[tokenizer.get_vocab_size():] = True      # padding rows of the embedding table
        self._banned_text = banned.to(device)
        traj = banned.clone()
        traj[[token_ids.im_end, token_ids.endoftext]] = True
        self._banned_traj = traj.to(device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, checkpoint: str | Path, device: str | torch.device | None = None, precision: str = "bf16",
             dtype: torch.dtype | None = None,
             speculator_factory: Callable[[Any, AlpamayoConfig, torch.device, torch.dtype], Speculator] | None = None,
             max_model_len: int | None = None, load_format: str = "auto"):
        """Load a checkpoint directory. precision bf16|fp8; dtype overrides the compute dtype
        (fp32 for exactness tests; CPU defaults to fp32); load_format auto|dummy (ALPAMAYO_LOAD_FORMAT)."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, cfg = load_model(checkpoint, device=device, dtype=dtype, precision=precision, load_format=load_format)
        tok, ids = load_tokenizer(checkpoint, cfg)
        image_proc = ImageProcessing.from_dir(Path(checkpoint), cfg.min_pixels, cfg.max_pixels)
        speculator = speculator_factory(model, cfg, device, dtype) if speculator_factory else None
        rt = cls(model, cfg, tok, ids, image_proc, device, dtype, speculator, max_model_len)
        rt.stop_ids = generation_stop_ids(checkpoint, int(cfg.text["vocab_size"]))
        rt.prompts.chat_template = load_chat_template(checkpoint)
        rt.prompts.check_template(f"checkpoint {checkpoint}")
        rt.checker = load_checker(checkpoint)
        return rt

    # ------------------------------------------------------------------ per-scene preparation
    def _prepare(self, req: SceneRequest, pool: ThreadPoolExecutor | None = None) -> _Prepared:
        """A scene's prompt, positions and egomotion; its frames' host work (`StagedFrames`) runs in
        `pool` when given, started before the prompt work (collected by `_pixel_values` just before
        the scene's prefill, so later scenes' frames are staged while earlier scenes prefill), else
        here, pixel values included."""
        t0 = time.perf_counter()
        grid = self.image_proc.grid(req.frames)
        if req.task in TASKS_NEEDING_EGOMOTION and (req.ego_history_xyz is None or req.ego_history_rot is None):
            raise InferenceError("missing_egomotion", f"task {req.task} needs egomotion history")
        if req.task == "auto_labeling" and (req.ego_future_xyz is None or req.ego_future_rot is None):
            raise InferenceError("missing_future_egomotion", "auto_labeling needs the future egomotion")
        staged = StagedFrames(req.frames, self.image_proc, self.device, self.dtype, pool)
        hist_xyz = hist_rot = None
        history_ids = future_ids = None
        if req.task in TASKS_NEEDING_EGOMOTION:
            hist_xyz = torch.as_tensor(req.ego_history_xyz, dtype=torch.float32)[None]
            hist_rot = torch.as_tensor(req.ego_history_rot, dtype=torch.float32)
            if hist_rot.shape[-1] == 4:
                hist_rot = quat_wxyz_to_matrix(hist_rot)
            hist_rot = hist_rot[None]
            history_ids = self.history_tok.encode(hist_xyz)[0]
        if req.task == "auto_labeling":
            fut_xyz = torch.as_tensor(req.ego_future_xyz, dtype=torch.float32)[None]
            fut_rot = torch.as_tensor(req.ego_future_rot, dtype=torch.float32)
            if fut_rot.shape[-1] == 4:
                fut_rot = quat_wxyz_to_matrix(fut_rot)
            future_ids = self.future_tok.encode(hist_xyz, hist_rot, fut_xyz, fut_rot[None])[0]
        tokens_per_image = int(grid[0, 1] * grid[0, 2]) // self.image_proc.merge_size ** 2
        spec = PromptSpec(req.task, tuple(req.camera_ids), req.num_frames, tokens_per_image, req.nav_text, req.question)
        input_ids = self.prompts.encode(spec, history_ids, future_ids)
        positions, delta = self.prompts.positions(spec, grid, self.image_proc.merge_size)
        p = _Prepared(req, input_ids, positions, delta, grid, hist_xyz, hist_rot, (time.perf_counter() - t0) * 1000.0,
                      staged)
        if pool is None:
            self._pixel_values(p)
        return p

    def _pixel_values(self, p: _Prepared) -> torch.Tensor:
        """The scene's pixel values on the device (CUDA: copied and preprocessed there, no sync)."""
        if p.pixel_values is None:
            p.pixel_values, host_ms = p.staged.pixel_values()
            p.image_prep_ms += host_ms
        return p.pixel_values

    @torch.inference_mode()
    def _prefill(self, ps: list[_Prepared], capture: tuple[int, ...]):
        """One pass over the prompts of `ps` (G scenes of one prompt length P, pixel values on the
        device) -> (last-position logits (G, V) fp32, per-layer K/V list of (G, Hkv, P, D) pairs,
        {layer: hidden (G, P, H)})."""
        captured: dict[int, torch.Tensor] = {}
        hooks = [self.model.language_model.layers[i].register_forward_hook(
            lambda _m, _i, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in capture]
        one = len(ps) == 1
        pixel_values = ps[0].pixel_values if one else torch.cat([p.pixel_values for p in ps])
        grid = ps[0].grid if one else torch.cat([p.grid for p in ps])
        input_ids = torch.stack([p.input_ids for p in ps])
        fused = fused_available(pixel_values)          # GPU: fused layers, batched vision attention
        try:
            with contextlib.ExitStack() as paths:
                if fused:                   # the grid stays on the host (fast_vision: no device reads)
                    paths.enter_context(fast_vision_paths(self.model, prompt_ids=input_ids.flatten(),
                                                          graphs=self.graphs))
                    fused_kv = paths.enter_context(self.decoder.stack.prefilling())
                out = self.model.vlm.model(
                    input_ids=to_device(input_ids, self.device), pixel_values=pixel_values,
                    image_grid_thw=grid if fused else grid.to(self.device),
                    position_ids=to_device(torch.stack([p.positions for p in ps], 1), self.device),
                    use_cache=not fused)
        finally:
            for hk in hooks:
                hk.remove()
        if fused:
            layer_kv = fused_kv
        else:
            cache = out["cache"] if "cache" in out.keys() else out["past_key_values"]   # renamed in transformers 5.2x
            layer_kv = [(layer.keys, layer.values) for layer in cache.layers]
        logits = self.model.lm_head(out.last_hidden_state[:, -1]).float()
        return logits, layer_kv, captured

    # ------------------------------------------------------------------ the batch
    def prepare(self, batch: list[SceneRequest]) -> PreparedBatch:
        """A batch's host work before the GPU (one task, one K): each scene's prompt and positions,
        its frames staged in the image-prep pool, the reasoning limit; scenes that cannot run get
        their error here. Thread-safe against a running `run`: the worker prepares the next batch
        while the engine thread runs the current one."""
        if not batch:
            return PreparedBatch([], {}, [], [])
        task = batch[0].task
        k = batch[0].num_samples
        if any(r.task != task or r.num_samples != k for r in batch):
            raise ValueError("a batch must hold one task and one K")
        results = {r.request_id: SceneResult(r.request_id, task) for r in batch}
        ok: list[_Prepared] = []
        max_new: list[int] = []
        for req in batch:
            try:
                p = self._prepare(req, self._prep_pool)
            except InferenceError as e:
                results[req.request_id].error = (e.code, str(e))
                continue
            except ValueError as e:
                results[req.request_id].error = ("bad_image", str(e))
                continue
            limit = self.trajectory_max_new if task == "trajectory" else (req.max_tokens or DEFAULT_MAX_NEW[task])
            plen = len(p.input_ids)
            if self.max_model_len is not None:
                if plen + 1 > self.max_model_len:
                    results[req.request_id].error = (
                        "out_of_range", f"prompt is {plen} tokens, NIM_ALPAMAYO_MAX_MODEL_LEN is {self.max_model_len}")
                    continue
                limit = min(limit, self.max_model_len - plen)
            ok.append(p)
            max_new.append(limit)
        return PreparedBatch(list(batch), results, ok, max_new)

    def run(self, batch: list[SceneRequest] | PreparedBatch) -> list[SceneResult]:
        """Run one batch (one task, one K), prepared by `prepare` or not yet. Failures of one
        scene never fail the others."""
        b = batch if isinstance(batch, PreparedBatch) else self.prepare(batch)
        if not b.requests:
            return []
        task, k = b.requests[0].task, b.requests[0].num_samples
        ok, max_new, results = b.ok, b.max_new, b.results
        # the persistent cache holds max_rows rows (the memory plan): larger batches run in chunks
        per = max(1, self.max_rows // k) if self.max_rows else max(1, len(ok))
        for i in range(0, len(ok), per):
            chunk = ok[i:i + per]
            try:
                self._generate(task, k, chunk, max_new[i:i + per], results)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                for p in chunk:
                    results[p.req.request_id].error = ("inference_failed", "out of GPU memory for this batch")
        return [results[r.request_id] for r in b.requests]

    def kv_bytes_per_column(self, with_draft: bool = True) -> int:
        """Bytes of one cache column of one row: every target layer's K and V, plus (with_draft)
        the DFlash2 draft's context K/V on speculative profiles (the memory plan's unit)."""
        d = self.decoder
        size = torch.finfo(self.dtype).bits // 8
        n = 2 * d.num_layers * d.kv_heads * d.head_dim * size
        if with_draft and self.speculator is not None:
            c = self.speculator.config
            n += 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * size
        return n

    def _generate(self, task: str, k: int, ok: list[_Prepared], max_new: list[int],
                  results: dict[str, SceneResult]) -> None:
        dev = self.device
        speculate = self.speculator is not None and task == "trajectory"
        capture = tuple(self.speculator.target_layer_ids) if speculate else ()
        real = len(ok) * k
        plens = [len(p.input_ids) for p in ok]
        block = self.speculator.block_size if speculate else 1
        # + the expert's action columns after each row's reasoning (GPU path writes them there)
        tail = self.expert.num_waypoints if task == "trajectory" else 0
        need = max(pl + mn for pl, mn in zip(plens, max_new)) + max(block + 1, tail)
        cache, rows = self._cache_for(real, need)
        if speculate:
            persistent = cache is self.decoder.persistent
            self.speculator.begin(cache.rows if persistent else rows, cache.capacity, persistent=persistent,
                                  graphs=self.graphs)
        first_logits = torch.zeros(rows, self.model.lm_head.out_features, device=dev)
        marks = _Marks(dev)
        # scenes of one prompt length share a prefill pass (share_prefill=False: the reference of K
        # separate prefills per scene, one scene a pass)
        groups = prefill_groups(plens, PREFILL_TOKENS if self.share_prefill else 0)
        for g in groups:
            marks.mark()
            for p in ok[g]:
                self._pixel_values(p)
            marks.mark()
            per = k if self.share_prefill else 1            # rows a pass fills per scene
            for fork in range(k // per):
                logits, layer_kv, hidden = self._prefill(ok[g], capture)
                first = g.start * k + fork
                cache.load_prefix(layer_kv, slice(first, first + (g.stop - g.start) * per))
                first_logits[first:first + (g.stop - g.start) * per] = logits.repeat_interleave(per, 0)
                if speculate:
                    self.speculator.load_context(slice(first, first + (g.stop - g.start) * per), hidden,
                                                 [p.rope_delta for p in ok[g]], per)
                del layer_kv
        marks.mark()
        pad = rows - real

        def rep(xs, fill=0, dtype=torch.long):      # per scene -> per row (K each), padded rows last
            return to_device(torch.tensor([x for x in xs for _ in range(k)] + [fill] * pad, dtype=dtype), dev)

        temperatures = [p.req.temperature for p in ok]
        params = SamplingParams(
            key=to_device(torch.tensor([sample_key(p.req.seed, j) for p in ok for j in range(k)] + [0] * pad,
                                       dtype=torch.long), dev),
            temperature=rep(temperatures, 0.0, torch.float32),
            top_p=rep([p.req.top_p for p in ok], 1.0, torch.float32),
            top_k=rep([p.req.top_k or 0 for p in ok]),
            # from the host's values (padding rows are greedy), so that sampling never reads the
            # device's: that read waited for the whole prefill, then the device idled while the host
            # launched the loop's start (H200, 2026-12-03: 3.7 ms from prefill to the first verify step)
            all_greedy=bool((torch.tensor(temperatures, dtype=torch.float32) <= 0).all()),
        )
        ids = self.ids
        if task == "trajectory":
            banned, terminal = self._banned_traj, [ids.traj_future_start]
        elif task == "meta_action":
            banned, terminal = self._banned_text, [ids.traj_future_start, ids.im_end, ids.endoftext, *self.stop_ids]
        else:
            banned, terminal = self._banned_text, [ids.im_end, ids.endoftext, *self.stop_ids]
        # no host sync between the stages: the host queues each stage behind the last (its marks are
        # CUDA events, read at the end), so the device runs prefill, decode and expert back to back
        batch = start_batch(cache, rep(plens), first_logits, rep([p.rope_delta for p in ok]), params, banned,
                            to_device(torch.tensor(terminal), dev), rep(max_new, 1), real_rows=real)
        if speculate:
            batch, spec_stats = self.speculator.decode(self.decoder, batch, group=(task, k))
        else:
            batch = baseline_decode(self.decoder, batch)
        marks.mark()
        # the tokens go to the host (pinned, no sync) before the expert, whose diffusion then runs
        # on the device while the host decodes the texts and the rows' initial speeds
        (generated, n_gen), copied = to_host(batch.generated[:, :max(max_new)], batch.n_generated)
        trajectories = rotations = None
        if task == "trajectory":
            action = self.expert.sample(cache, batch.lengths, batch.rope_delta, params.key,
                                        self.cfg.diffusion.num_inference_steps,
                                        graphs=self.graphs if cache is self.decoder.persistent else None)[:real]
            marks.mark()
            hist_xyz = torch.cat([p.hist_xyz for p in ok]).repeat_interleave(k, 0)
            hist_rot = torch.cat([p.hist_rot for p in ok]).repeat_interleave(k, 0)
            v0 = estimate_initial_speed(hist_xyz, hist_rot, self.cfg.action_space)
        spec_rows = spec_stats() if speculate else None     # its host reads after the expert's launch
        if copied is not None:
            copied.synchronize()
        for s, p in enumerate(ok):
            res = results[p.req.request_id]
            for j in range(k):
                r = s * k + j
                toks = generated[r, :int(n_gen[r])].tolist()
                text = text_tasks.extract_text(self.tok.decode(toks, skip_special_tokens=False))
                res.texts.append(text)
                res.outputs.append(text_tasks.parse_task_output(task, text))
                res.generated_tokens.append(len(toks))
                res.token_ids.append(toks)
                if task == "trajectory" and ids.traj_future_start not in toks:
                    res.warnings.append(f"sample {j}: reasoning hit the {len(toks)}-token cap before "
                                        "<|traj_future_start|>; the expert used the last position")
        diffusion_ms = 0.0
        if task == "trajectory":
            action = action.cpu()
            t_tail = time.perf_counter()
            xyz, rot = action_to_trajectory(action, hist_xyz, hist_rot, self.cfg.action_space, v0=v0)
            trajectories, rotations = xyz.numpy(), rot.numpy()
            tail_ms = (time.perf_counter() - t_tail) * 1000.0
        spans = marks.intervals_ms()            # per prefill pass: device image prep, prefill; then decode (, expert)
        n = 2 * len(groups)
        shares = [[x / len(ok[g]) for x in spans[2 * i:2 * i + 2]] for i, g in enumerate(groups) for _ in ok[g]]
        device_prep_ms = [a if dev.type == "cuda" else 0.0 for a, _ in shares]     # CPU: staging is host work
        prefill_ms = [b for _, b in shares]                                         # a scene's share of its pass
        decode_ms = spans[n]
        if task == "trajectory":                # the expert on the device, then the host's last conversion
            diffusion_ms = spans[n + 1] + tail_ms
        for s, p in enumerate(ok):
            res = results[p.req.request_id]
            if trajectories is not None:
                res.trajectories = trajectories[s * k:(s + 1) * k]
                res.rotations = rotations[s * k:(s + 1) * k]
            if speculate:
                res.speculative = self.speculator.merge_stats(spec_rows[s * k:(s + 1) * k])
            res.timings_ms = {"image_prep": p.image_prep_ms + device_prep_ms[s], "prefill": prefill_ms[s],
                              "decode": decode_ms, "diffusion": diffusion_ms}
        if trajectories is not None and self.checker is not None and k >= 2:
            for p, traj in zip(ok, self._check([p.req for p in ok])):
                results[p.req.request_id].checker_trajectory = traj
                results[p.req.request_id].checker_ade_m = self.checker.cfg.heldout_ade_m

    @torch.inference_mode()
    def _check(self, reqs: list[SceneRequest]) -> list[np.ndarray | None]:
        """The checker's trajectory (64, 2) per scene, in one pass over the scenes that have its
        cameras (None for the others). On the host in fp32 (about 100 MFLOP a scene), independent
        of the device and precision."""
        inputs = [checker_inputs(self.checker.cfg, r.frames, r.camera_ids, r.num_frames, r.ego_history_xyz)
                  for r in reqs]
        have = [x for x in inputs if x is not None]
        if not have:
            return [None] * len(reqs)
        traj = iter(self.checker(torch.cat([x for x, _ in have]), torch.cat([h for _, h in have]))[0].numpy())
        return [None if x is None else next(traj) for x in inputs]

    def _cache_for(self, real_rows: int, need: int):
        """(cache, rows): the persistent cache (rows padded to a graph bucket) when CUDA graphs are
        on and the batch fits it; otherwise a fresh cache of exactly this batch."""
        if real_rows <= self.max_rows and need <= self.capacity:
            if self.decoder.persistent is None:
                self.decoder.persistent = self.decoder.new_cache(self.max_rows, self.capacity, self.dtype,
                                                                 self.device)
            return self.decoder.persistent, bucket(real_rows, self.max_rows)
        return self.decoder.new_cache(real_rows, need, self.dtype, self.device), real_rows

    def enable_graphs(self, max_rows: int, capacity: int) -> None:
        """One persistent cache of max_rows x capacity, rows padded to power-of-two buckets, and
        on CUDA a graph per (rows bucket, T) for decode/verify, the draft pass and the expert loop
        (captured at warm-up). On CPU the same path runs eagerly (that is what tests exercise)."""
        self.max_rows, self.capacity = max_rows, capacity
        self.graphs = GraphCache(enabled=self.device.type == "cuda")
        self.decoder.graphs = self.graphs
        self.decoder.persistent = None

    # ------------------------------------------------------------------ warm-up
    def calibrate_speculation(self, rows_buckets: list[int] | None = None) -> None:
        """Measure the speculator's step costs per rows bucket (its policy drafts only where that
        pays): over the persistent cache at every graph bucket up to max_rows when graphs are on
        (capturing the graphs later batches replay), else over a scratch cache."""
        if self.speculator is None:
            return
        block = self.speculator.block_size
        if self.max_rows:
            buckets = rows_buckets or self._rows_buckets()
            cache, _ = self._cache_for(1, 1)
        else:
            buckets = rows_buckets or [1, 2, 4, 8]
            cache = self.decoder.new_cache(max(buckets), CPU_CALIBRATION_CONTEXT + block, self.dtype, self.device)
        persistent = cache is self.decoder.persistent
        self.speculator.begin(cache.rows, cache.capacity, persistent=persistent, graphs=self.graphs)
        context = min(CALIBRATION_CONTEXT, cache.capacity - block)
        self.speculator.calibrate(self.decoder, cache, buckets, context, self._banned_traj)

    def _rows_buckets(self) -> list[int]:
        """Every rows bucket a batch can be padded to (powers of two, capped at max_rows)."""
        return sorted({bucket(1 << i, self.max_rows) for i in range(self.max_rows.bit_length())})

    def capture_expert(self) -> None:
        """With CUDA graphs on: the expert's flow-matching loop captured at every rows bucket now,
        over the persistent cache, rather than by the first batch of each size. On the H200 (32B
        shape, fp8) the first batch of 16 scenes after a one-scene warm-up spent 1.43 s in
        diffusion against 0.18 s for the next batch: it captured the loop, compiling on the way
        the fp8 kernels that 16 rows take (more than `fp8.WEIGHT_ONLY_MAX_ROWS` expert rows)."""
        if not (self.max_rows and self.graphs.enabled):
            return
        cache, _ = self._cache_for(1, 1)
        for rows in self._rows_buckets():
            zero = torch.zeros(rows, dtype=torch.long, device=self.device)     # offsets 1, keys 0
            self.expert.sample(cache, zero + 1, zero, zero, self.cfg.diffusion.num_inference_steps,
                               graphs=self.graphs)

    def warmup(self, k_values: list[int], image_size: tuple[int, int] | None = None, staged_scenes: int = 1) -> None:
        """Run one synthetic trajectory scene per K (untimed), so the first real request is not
        slower; on CUDA also measure the speculator's step costs (`calibrate_speculation`), capture
        the expert loop at every rows bucket (`capture_expert`) and keep pinned host buffers for
        `staged_scenes` scenes of the warm-up's frames (`staging.reserve_pinned`).
        Frames of `image_size`, by default `warmup_frame_hw`: on CUDA full-HD frames, so the
        first real batch finds the prompt-size shapes compiled and tuned (Triton variants,
        cuBLAS and cuDNN plans: the first 24-image batch of a worker warmed at 64x64 took about
        15 s longer than the next ones on the H200)."""
        image_size = image_size or warmup_frame_hw(self.device)
        rng = np.random.default_rng(0)
        n = 6 * 4
        for k in k_values:
            xyz = np.zeros((16, 3), np.float32)
            xyz[:, 0] = np.linspace(-15, 0, 16)
            req = SceneRequest(
                request_id=f"warmup-k{k}", task="trajectory",
                frames=rng.integers(0, 255, (n, image_size[0], image_size[1], 3), dtype=np.uint8),
                camera_ids=(0, 1, 2, 3, 5, 6), ego_history_xyz=xyz,
                ego_history_rot=np.tile(np.eye(3, dtype=np.float32), (16, 1, 1)),
                num_samples=k, temperature=0.6 if k > 1 else 0.0, seed=0)
            self.run([req])
        if self.device.type == "cuda":
            self.calibrate_speculation()
            reserve_pinned(staged_scenes, (n, image_size[0], image_size[1], 3))
        self.capture_expert()

    @property
    def identity(self) -> dict[str, Any]:
        return {"config_sha256": self.cfg.sha256}
