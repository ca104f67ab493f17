"""The worker's engine: resolves the checkpoint and the DFlash2 head from Settings, checks them
before loading weights, loads and warms the runtime, runs batches (on the caller's thread; the
service gives it a thread of its own), and turns runtime results into wire results.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path

import torch

from schemas import (AutoLabel, GroundingBox, InferRequest, InferResult, Lineage, MetaAction, ModelIdentity,
                     ResultMetrics, SampleOutput, SpeculativeDecoding, StageTimings, Uncertainty)
from worker.config import Settings
from worker.demo_cache import demo_checkpoint, demo_head
from worker.dflash.draft import MASK_TOKEN, DraftModel
from worker.dflash.head import check_head, head_config_for
from worker.dflash.loop import DFlash2Speculator
from worker.dflash.metrics import speculative_block
from worker.model.checkpoint import check_checkpoint
from worker.model import memory_plan
from worker.model.memory_plan import MemoryPlan
from worker.model.runtime import AlpamayoRuntime, PreparedBatch, SceneRequest, SceneResult
from worker.model.tokenizer import load_tokenizer
from worker.uncertainty import uncertainty_block

log = logging.getLogger("alpamayo.engine")
MODEL_ID = "nvidia/alpamayo-2-super"
DEFAULT_ROW_CAPACITY = 8192      # cache columns per row without NIM_ALPAMAYO_MAX_MODEL_LEN


def resolve_checkpoint(settings: Settings) -> Path:
    """NIM_FT_CHECKPOINT, or the shipped demo checkpoint (verified against its manifest)."""
    if settings.ft_checkpoint is not None:
        return settings.ft_checkpoint
    return demo_checkpoint()


def resolve_head(settings: Settings, checkpoint: Path) -> Path | None:
    """The custom head (NIM_ALPAMAYO_SPECULATIVE_MODEL) or the packaged one on dflash2 profiles
    (none with ALPAMAYO_LOAD_FORMAT=dummy: a random head then, `random_head_factory`)."""
    if not settings.speculative:
        return None
    if settings.speculative_model is not None:
        return settings.speculative_model
    if settings.load_format == "dummy":
        return None
    return demo_head(checkpoint, settings.cache)


def random_head_factory(checkpoint: Path):
    """ALPAMAYO_LOAD_FORMAT=dummy on a dflash2 profile: an untrained DFlash2 head of the right
    shape for the runtime's model (its cost is real, its proposals random)."""
    def make(model, cfg, device, dtype):
        tok, _ = load_tokenizer(checkpoint, cfg)
        config = head_config_for(cfg, mask_token_id=tok.token_to_id(MASK_TOKEN))
        with torch.device(device):
            draft = DraftModel(config).to(dtype).eval().requires_grad_(False)
        return DFlash2Speculator(draft, model)
    return make


def checkpoint_hash(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = path / name
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_seed(request_id: str) -> int:
    """Requests without a seed get one derived from their id: a replay reproduces its result."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:7], "big")


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.runtime = None
        self.checkpoint: Path | None = None
        self.head: Path | None = None
        self.identity: ModelIdentity | None = None
        self.plan: MemoryPlan | None = None

    def prepare(self) -> None:
        """Resolve and check checkpoint and head without loading weights (raises CheckpointError)."""
        self.checkpoint = resolve_checkpoint(self.settings)
        s = self.settings
        cfg, _, _ = check_checkpoint(self.checkpoint, s.precision, s.load_format)
        self.head = resolve_head(self.settings, self.checkpoint)
        if self.head is not None:
            check_head(self.head, cfg)

    def load(self, warmup: bool = True) -> None:
        if self.checkpoint is None:
            self.prepare()
        t0 = time.perf_counter()
        factory = DFlash2Speculator.factory(str(self.head)) if self.head is not None else \
            random_head_factory(self.checkpoint) if self.settings.speculative else None
        self.runtime = AlpamayoRuntime.load(self.checkpoint, device=self.settings.device,
                                            precision=self.settings.precision, speculator_factory=factory,
                                            max_model_len=self.settings.max_model_len,
                                            load_format=self.settings.load_format)
        self.identity = ModelIdentity(
            id=MODEL_ID, profile=self.settings.profile, precision=self.settings.precision,
            checkpoint_hash=checkpoint_hash(self.checkpoint),
            speculative_decoding="dflash2" if self.settings.speculative else None,
            speculative_model=str(self.head) if self.head is not None else None)
        self.plan = self.plan_memory()             # MemoryPlanError (a refusal) when one scene does not fit
        log.info("%s", self.plan.describe())
        if self.runtime.device.type == "cuda":      # CUDA graphs over one persistent cache, captured at warm-up
            self.runtime.enable_graphs(max_rows=self.plan.max_rows, capacity=self.plan.capacity)
        log.info("loaded %s (%s) on %s in %.1fs", self.checkpoint, self.settings.profile, self.runtime.device,
                 time.perf_counter() - t0)
        if warmup:
            self.warm()

    def warm(self) -> None:
        """One synthetic scene per K through the runtime (`AlpamayoRuntime.warmup`), with pinned host
        buffers kept for the scenes of two batches: the one running and the next, whose frames the
        worker stages meanwhile. A batch counts at most the scenes the memory plan's cache rows run
        at once: a larger ALPAMAYO_MAX_BATCH_SIZE (its batches run in chunks) pins the rest on first
        use, as before, rather than all of it at start-up (256 full-HD scenes a batch would be
        128 GB)."""
        t0 = time.perf_counter()
        per_batch = self.settings.max_batch_size
        if self.plan is not None:
            per_batch = min(per_batch, self.plan.max_rows)
        self.runtime.warmup(list(self.settings.k_values), staged_scenes=2 * per_batch)
        log.info("warmed K=%s in %.1fs", list(self.settings.k_values), time.perf_counter() - t0)

    def plan_memory(self) -> MemoryPlan:
        """The persistent cache's rows from ALPAMAYO_GPU_MEMORY_FRACTION, the weights now resident
        and the bytes of one cache column (worker/model/memory_plan.py)."""
        rt, s = self.runtime, self.settings
        total = weights = 0
        if rt.device.type == "cuda":
            total = torch.cuda.mem_get_info(rt.device)[1]
            weights = torch.cuda.memory_allocated(rt.device)
        return memory_plan.plan(rt.device.type, total, s.gpu_memory_fraction, weights, rt.kv_bytes_per_column(),
                                s.max_model_len or DEFAULT_ROW_CAPACITY,
                                rows_wanted=s.max_batch_size * max(s.k_values), rows_needed=max(s.k_values),
                                prefill_bytes_per_column=rt.kv_bytes_per_column(with_draft=False))

    def shrink_frame(self, frame):
        """A decoded frame reduced to what the model will read (ImageProcessing.shrink), on CPU
        runtimes, which resize on the CPU anyway (earlier is no dearer, and a queued full-HD frame
        shrinks from 6 MB to kilobytes). CUDA runtimes keep the uint8 frame: the GPU resizes it in
        microseconds where an intake thread would spend ~45 ms per 1920x1080 frame; host memory
        is then bounded by ALPAMAYO_MAX_INFLIGHT jobs."""
        if self.runtime is None or self.runtime.device.type != "cpu":
            return frame
        return self.runtime.image_proc.shrink(frame)

    def prepare_batch(self, batch: list[SceneRequest]) -> PreparedBatch:
        """The batch's host work (prompts, staged frames), on any thread: the worker prepares the
        next batch while `infer` runs the current one."""
        return self.runtime.prepare(batch)

    def infer(self, batch: list[SceneRequest] | PreparedBatch) -> list[SceneResult]:
        return self.runtime.run(batch)

    def models_payload(self) -> dict:
        s = self.settings
        return {"object": "list", "data": [{
            "id": MODEL_ID, "object": "model", "profile": s.profile, "precision": s.precision,
            "speculative_decoding": "dflash2" if s.speculative else None,
            "speculative_model": str(self.head) if self.head is not None else None,
            "k_values": list(s.k_values), "checkpoint": str(self.checkpoint),
            "checkpoint_hash": self.identity.checkpoint_hash if self.identity else None,
            "max_inflight": s.max_inflight, "max_request_bytes": s.max_request_bytes,
            "max_model_len": s.max_model_len,
            "action_expert_max_batch_size": self.plan.max_rows if self.plan else s.max_batch_size * max(s.k_values),
            "kv_cache_tokens": self.plan.kv_cache_tokens if self.plan else None,
            "max_rows": self.plan.max_rows if self.plan else None,
            "memory_plan": self.plan.as_dict() if self.plan else None,
            "default_seed": "sha256(request_id)",
        }]}

    def to_result(self, req: InferRequest, res: SceneResult, lineage: Lineage | None, queue_ms: float,
                  total_ms: float, warnings: list[str] = ()) -> InferResult:
        """Wire result of one request. Raises ValueError on non-finite model output."""
        spec = None
        if res.speculative is not None and self.settings.spec_metrics != "none":
            spec = SpeculativeDecoding(**speculative_block(res.speculative, self.settings.spec_metrics == "detailed"))
        trajectories = rotations = None
        if res.trajectories is not None:
            if not (bool((abs(res.trajectories) < 1e6).all()) and bool((abs(res.rotations) <= 1.0001).all())):
                raise ValueError("the model produced a non-finite trajectory")
            trajectories = res.trajectories.tolist()
            rotations = res.rotations.tolist()
        outputs = []
        for o in res.outputs:
            mf = o.meta_action_fields
            outputs.append(SampleOutput(
                text=o.text, cot=o.cot,
                meta_action=MetaAction(**mf) if mf else None,
                auto_label=AutoLabel(**o.auto_label) if o.auto_label else None,
                boxes=[GroundingBox(bbox_2d=[float(v) for v in b["bbox_2d"]], label=b.get("label"))
                       for b in o.boxes] if o.boxes is not None else None))
        t = res.timings_ms
        timings = StageTimings(queue_ms=queue_ms, image_prep_ms=t.get("image_prep", 0.0),
                               prefill_ms=t.get("prefill", 0.0), decode_ms=t.get("decode", 0.0),
                               diffusion_ms=t.get("diffusion", 0.0), total_ms=total_ms)
        reasoning = [o.cot if o.cot is not None else o.text for o in res.outputs]
        if any(not math.isfinite(v) for v in (queue_ms, total_ms)):
            raise ValueError("non-finite timing")
        block = uncertainty_block(res.trajectories, [o.meta_action_fields for o in res.outputs],
                                  [o.auto_label for o in res.outputs], res.checker_disagreement_m)
        return InferResult(
            request_id=req.request_id, run_id=req.run_id, task=req.task, labels=dict(req.labels),
            submitted_at=req.submitted_at,
            num_samples=len(res.outputs), pred_trajectories=trajectories, pred_rotations=rotations,
            answer=res.outputs[0].answer if res.outputs and req.task in ("vqa", "grounding") else None,
            outputs=outputs,
            metrics=ResultMetrics(reasoning_texts=reasoning, generated_tokens=list(res.generated_tokens),
                                  timings=timings, speculative_decoding=spec),
            warnings=list(warnings) + list(res.warnings) + [o.warning for o in res.outputs if o.warning],
            model=self.identity, lineage=lineage, completed_at=time.time(),
            uncertainty=Uncertainty(**block) if block is not None else None)
