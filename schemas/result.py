"""The result message (``alpamayo.results``): the NIM response fields plus identity and lineage.

Arrays are plain nested lists of Python floats (msgpack float64 / JSON numbers); the worker
converts tensors with ``.tolist()`` (the codec's encoder also does that for objects that have a
``tolist`` method). No torch/numpy import here.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .request import SCHEMA_VERSION, Task

__all__ = [
    "SpeculativeDecoding",
    "StageTimings",
    "ResultMetrics",
    "MetaAction",
    "AutoLabel",
    "GroundingBox",
    "SampleOutput",
    "ModelIdentity",
    "Lineage",
    "Uncertainty",
    "InferResult",
]

_NonNegInt = Annotated[int, Meta(ge=0)]
_Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
_Metres = Annotated[float, Meta(ge=0.0)]


class SpeculativeDecoding(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """DFlash2 speculative-decoding statistics of one trajectory result (all K samples summed).

    Present only on dflash2 profiles with spec metrics ``summary``/``detailed`` and only for
    task ``trajectory``. ``per_step_*`` only with ``detailed``; None fields are omitted on the wire.
    """

    num_spec_tokens: Annotated[int, Meta(ge=0, description="Draft tokens proposed per verify step (7).")]
    num_spec_steps: Annotated[int, Meta(ge=0, description="Verify steps, summed over samples.")]
    num_draft_tokens: Annotated[int, Meta(ge=0, description="Draft tokens proposed, summed over samples.")]
    num_accepted_draft_tokens: Annotated[
        int, Meta(ge=0, description="Draft tokens accepted, summed over samples.")
    ]
    draft_acceptance_rate: Annotated[
        float, Meta(description="num_accepted_draft_tokens / num_draft_tokens (0 when none drafted).")
    ]
    mean_acceptance_length: Annotated[
        float, Meta(description="1 + num_accepted_draft_tokens / num_spec_steps.")
    ]
    acceptance_histogram: Annotated[
        list[_NonNegInt],
        Meta(description="Bin i = verify steps that accepted i drafts (i = 0..num_spec_tokens)."),
    ]
    per_step_accepted: Annotated[
        list[_NonNegInt] | None,
        Meta(description="detailed only: accepted drafts per step, samples concatenated in order."),
    ] = None
    per_step_drafted: Annotated[
        list[_NonNegInt] | None,
        Meta(description="detailed only: drafted tokens per step, samples concatenated in order."),
    ] = None
    num_baseline_steps: Annotated[
        int, Meta(ge=0, description="Decode steps without drafts (the adaptive policy chose the baseline's "
                                    "step), summed over samples.")
    ] = 0
    speculated_step_fraction: Annotated[
        float | None, Meta(description="num_spec_steps / (num_spec_steps + num_baseline_steps).")
    ] = None
    mean_verify_tokens: Annotated[
        float | None, Meta(description="Tokens fed per verify step: 1 + num_draft_tokens / num_spec_steps "
                                       "(8 when every step verified 7 drafts).")
    ] = None


class StageTimings(msgspec.Struct, kw_only=True, frozen=True):
    """Wall-clock milliseconds per stage (0 where a stage does not apply to the task)."""

    queue_ms: Annotated[float, Meta(description="From Kafka record time (or submitted_at) to engine start.")] = 0.0
    image_prep_ms: Annotated[float, Meta(description="Claim-check fetch, decode and resize of the images.")] = 0.0
    prefill_ms: Annotated[float, Meta(description="VLM prefill of the shared prompt.")] = 0.0
    decode_ms: Annotated[float, Meta(description="Autoregressive reasoning decode (incl. drafting).")] = 0.0
    diffusion_ms: Annotated[float, Meta(description="Action-expert flow matching (trajectory tasks).")] = 0.0
    total_ms: Annotated[float, Meta(description="From Kafka record time to result encoded.")] = 0.0


class ResultMetrics(msgspec.Struct, kw_only=True, frozen=True):
    """Per-request metrics, as the NIM's ``metrics`` object."""

    reasoning_texts: Annotated[list[str], Meta(description="Reasoning (chain of causation) text per sample.")]
    generated_tokens: Annotated[list[_NonNegInt], Meta(description="Generated tokens per sample.")]
    timings: Annotated[StageTimings, Meta(description="Stage latencies of this request.")]
    speculative_decoding: Annotated[
        SpeculativeDecoding | None,
        Meta(description="DFlash2 statistics; trajectory results on dflash2 profiles only."),
    ] = None


class MetaAction(msgspec.Struct, kw_only=True, frozen=True):
    """meta_action output: the ``Longitudinal:``/``Lateral:``/``Lane:`` lines (None where absent)."""

    longitudinal: Annotated[str | None, Meta(description="e.g. 'Decelerate'.")] = None
    lateral: Annotated[str | None, Meta(description="e.g. 'Keep lane'.")] = None
    lane: Annotated[str | None, Meta(description="Lane decision, if the model wrote one.")] = None


class AutoLabel(msgspec.Struct, kw_only=True, frozen=True):
    """auto_labeling output: the model's JSON object (keys the model left out are None)."""

    critical_components_analysis: Annotated[str | None, Meta(description="Critical scene components.")] = None
    ego_vehicle_motion_analysis: Annotated[str | None, Meta(description="Ego motion description.")] = None
    trajectory_analysis: Annotated[str | None, Meta(description="Trajectory description.")] = None
    chain_of_causation: Annotated[str | None, Meta(description="Causal explanation.")] = None


class GroundingBox(msgspec.Struct, kw_only=True, frozen=True):
    """One grounding detection."""

    bbox_2d: Annotated[list[float], Meta(description="[x1, y1, x2, y2] as the model wrote them.")]
    label: Annotated[str | None, Meta(description="Object label, if any.")] = None


class SampleOutput(msgspec.Struct, kw_only=True, frozen=True):
    """Decoded text output of one sample (one per K)."""

    text: Annotated[str, Meta(description="Full generated text of the sample (special tokens removed).")]
    cot: Annotated[str | None, Meta(description="Reasoning / chain-of-thought part, if any.")] = None
    meta_action: Annotated[MetaAction | None, Meta(description="Parsed meta action (meta_action task).")] = None
    auto_label: Annotated[AutoLabel | None, Meta(description="Parsed labels (auto_labeling task).")] = None
    boxes: Annotated[list[GroundingBox] | None, Meta(description="Parsed boxes (grounding task).")] = None


class ModelIdentity(msgspec.Struct, kw_only=True, frozen=True):
    """What produced the result (as ``/v1/models`` data[0])."""

    id: Annotated[str, Meta(description="Model id, e.g. nvidia/alpamayo-2-super.")]
    profile: Annotated[str, Meta(description="bf16 | fp8 | bf16-dflash2 | fp8-dflash2.")]
    precision: Annotated[str, Meta(description="bf16 | fp8.")]
    checkpoint_hash: Annotated[str, Meta(description="Hash of the served checkpoint's config/index.")]
    speculative_decoding: Annotated[str | None, Meta(description="'dflash2' or None.")] = None
    speculative_model: Annotated[str | None, Meta(description="Path of the active draft head, or None.")] = None


class Lineage(msgspec.Struct, kw_only=True, frozen=True):
    """Where the request came from and who served it."""

    topic: Annotated[str, Meta(description="Request topic.")]
    partition: Annotated[int, Meta(ge=0, description="Request partition.")]
    offset: Annotated[int, Meta(ge=0, description="Request offset.")]
    worker_id: Annotated[str, Meta(description="Worker instance that produced the result.")]
    attempt: Annotated[int, Meta(ge=1, description="1 for the first delivery; replays count up.")] = 1
    replay_of: Annotated[
        str | None, Meta(description="'topic:partition:offset' of the dead letter replayed, if any.")
    ] = None


class Uncertainty(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """How much the K samples of one result disagree (results with K >= 2 only; formula and
    components: worker/uncertainty.py). Components the task does not produce are omitted."""

    uncertainty: Annotated[_Fraction, Meta(description=(
        "0 = the samples agree, towards 1 = they disagree (the components combined; docs/contract.md)."))]
    trajectory_spread_m: Annotated[_Metres | None, Meta(description=(
        "Mean over sample pairs of their ADE (x/y, 64 waypoints), metres; trajectory results."))] = None
    endpoint_spread_m: Annotated[_Metres | None, Meta(description=(
        "Mean over sample pairs of the distance of their 6.4 s endpoints (x/y), metres; trajectory results."))] = None
    lateral_spread_m: Annotated[_Metres | None, Meta(description=(
        "Mean over sample pairs and waypoints of their sideways (y, ego frame at t0) distance, metres; "
        "trajectory results."))] = None
    meta_action_agreement: Annotated[_Fraction | None, Meta(description=(
        "Mean over longitudinal/lateral/lane of the share of sample pairs with the same value; meta_action."))] = None
    auto_label_agreement: Annotated[_Fraction | None, Meta(description=(
        "Mean over the four auto-label fields of the sample pairs' word-set Jaccard similarity; auto_labeling."))] = None
    checker_disagreement_m: Annotated[_Metres | None, Meta(description=(
        "Mean over the samples of their ADE (x/y) to the trajectory of the checkpoint's independent checker, "
        "beyond the checker's own held-out ADE (0 when within it), metres; trajectory results of a checkpoint "
        "with a checker."))] = None


class InferResult(msgspec.Struct, kw_only=True, frozen=True):
    """One result, keyed by ``request_id`` on the results topic."""

    schema_version: Annotated[int, Meta(description="Contract version of this message.")] = SCHEMA_VERSION
    request_id: Annotated[str, Meta(description="The request's id.")]
    run_id: Annotated[str | None, Meta(description="The request's run_id.")] = None
    task: Annotated[Task, Meta(description="The request's task.")]
    labels: Annotated[dict[str, str], Meta(description="The request's labels, unchanged.")] = {}
    submitted_at: Annotated[float | None, Meta(description="The request's submitted_at (unix seconds), unchanged.")] = None
    num_samples: Annotated[int, Meta(ge=0, description="K (number of samples produced).")]
    pred_trajectories: Annotated[
        list[list[list[float]]] | None,
        Meta(description="K x 64 x [x, y, z] metres, ego frame at t0 (trajectory-producing tasks)."),
    ] = None
    pred_rotations: Annotated[
        list[list[list[list[float]]]] | None,
        Meta(description="K x 64 row-major 3x3 rotation matrices (with pred_trajectories)."),
    ] = None
    answer: Annotated[str | None, Meta(description="Sample 0's answer text (vqa).")] = None
    outputs: Annotated[list[SampleOutput], Meta(description="Per-sample text outputs (K entries).")] = []
    metrics: Annotated[ResultMetrics, Meta(description="Reasoning texts, token counts, timings, spec stats.")]
    warnings: Annotated[list[str], Meta(description="Non-fatal input caveats (ignored fields, ...).")] = []
    model: Annotated[ModelIdentity, Meta(description="Model/profile that produced the result.")]
    lineage: Annotated[Lineage | None, Meta(description="Source coordinates and worker.")] = None
    completed_at: Annotated[float, Meta(description="Unix seconds when the result was produced.")]
    uncertainty: Annotated[
        Uncertainty | None,
        Meta(description="Disagreement of the K samples; null for K = 1 and for vqa/grounding results."),
    ] = None
