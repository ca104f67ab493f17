"""The GPU memory plan: how many cache rows fit beside the weights (vLLM's
`gpu_memory_utilization` convention, here `ALPAMAYO_GPU_MEMORY_FRACTION`).

    budget   = fraction x device memory
    KV bytes = budget - weights - reserve
    max_rows = min(rows wanted, KV bytes // (capacity x bytes per column))

The persistent cache is static: every row holds `capacity` columns (prompt + reasoning + verify
block + the expert's action columns) of every target layer, plus the DFlash2 draft's context
cache on dflash2 profiles. `reserve` covers what is not weights or cache: a prefill pass's own
cache (one scene's at full length, or PREFILL_TOKENS columns) and its activations, the vision tower, logits, CUDA graph pools.
A batch with more rows than `max_rows` runs in chunks of at most `max_rows` rows; a plan that
cannot hold one scene at the largest K is refused at startup.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import Refusal

GIB = 1 << 30
# Prompt tokens one prefill pass holds at most (scenes of one prompt length share a pass, as vLLM's
# max_num_batched_tokens batches prompts): the demo's 630-token prompts go 6 a pass, a 32B scene's
# 4,623 tokens alone. The reserve holds a prefill cache of this many columns or of a row's capacity
# (the larger: at 32B capacities, >= 4,992 columns, the reserve is what one scene's needed before).
PREFILL_TOKENS = 4096


class MemoryPlanError(Refusal):
    """The configured memory fraction cannot hold the weights and one scene's cache."""


@dataclass(frozen=True)
class MemoryPlan:
    device: str                 # "cuda" or "cpu"
    device_total: int           # bytes (0 on the CPU: no budget)
    fraction: float
    weights: int                # bytes of weights resident on the device
    reserve: int                # bytes kept free for activations and graph pools
    bytes_per_column: int       # KV bytes of one cache column of one row (all layers, target + draft)
    capacity: int               # columns per row
    max_rows: int               # rows the persistent cache holds

    @property
    def kv_cache_tokens(self) -> int:
        return self.max_rows * self.capacity

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache_tokens * self.bytes_per_column

    def describe(self) -> str:
        if not self.device_total:
            return (f"memory plan ({self.device}): no device budget; KV cache {self.max_rows} rows x "
                    f"{self.capacity} columns = {self.kv_bytes / GIB:.2f} GiB")
        return (f"memory plan ({self.device}): {self.fraction:.2f} x {self.device_total / GIB:.1f} GiB = "
                f"{self.fraction * self.device_total / GIB:.1f} GiB: weights {self.weights / GIB:.1f} GiB, "
                f"reserve {self.reserve / GIB:.1f} GiB, KV cache {self.kv_bytes / GIB:.1f} GiB = {self.max_rows} rows "
                f"x {self.capacity} columns ({self.kv_cache_tokens} tokens)")

    def as_dict(self) -> dict:
        return {"device": self.device, "gpu_memory_fraction": self.fraction, "device_total_bytes": self.device_total,
                "weight_bytes": self.weights, "reserve_bytes": self.reserve, "kv_cache_bytes": self.kv_bytes,
                "kv_cache_tokens": self.kv_cache_tokens, "max_rows": self.max_rows, "row_capacity": self.capacity}


def prefill_groups(lengths: list[int], budget: int) -> list[slice]:
    """The prefill passes of scenes with these prompt lengths, in order: runs of one length whose
    prompts hold at most `budget` tokens together (a scene alone where none joins it)."""
    groups, start = [], 0
    for s in range(1, len(lengths) + 1):
        if s == len(lengths) or lengths[s] != lengths[start] or (s + 1 - start) * lengths[start] > budget:
            groups.append(slice(start, s))
            start = s
    return groups


def reserve_bytes(device_total: int, prompt_cache_bytes: int) -> int:
    """Headroom besides weights and the persistent cache: 4 GiB or 4% of the device (the larger:
    activations, vision tower, logits, graph pools) plus one prefill pass's cache (transformers' own
    or the fused layers', copied into the persistent one)."""
    return max(4 * GIB, int(0.04 * device_total)) + prompt_cache_bytes


def plan(device: str, device_total: int, fraction: float, weights: int, bytes_per_column: int, capacity: int,
         rows_wanted: int, rows_needed: int, prefill_bytes_per_column: int | None = None) -> MemoryPlan:
    """The plan for a device with `device_total` bytes (0: no budget, e.g. the CPU).

    rows_wanted: max batch x largest K; rows_needed: the largest K (one scene). Raises
    MemoryPlanError, naming ALPAMAYO_GPU_MEMORY_FRACTION, when not even rows_needed fit.
    """
    if not device_total:
        return MemoryPlan(device, 0, fraction, weights, 0, bytes_per_column, capacity, rows_wanted)
    reserve = reserve_bytes(device_total, (prefill_bytes_per_column or bytes_per_column) * max(capacity, PREFILL_TOKENS))
    free = int(fraction * device_total) - weights - reserve
    fit = max(0, free // max(1, bytes_per_column * capacity))
    p = MemoryPlan(device, device_total, fraction, weights, reserve, bytes_per_column, capacity,
                   min(rows_wanted, fit))
    if fit < rows_needed:
        need = weights + reserve + rows_needed * bytes_per_column * capacity
        raise MemoryPlanError(
            f"ALPAMAYO_GPU_MEMORY_FRACTION={fraction:g} gives {fraction * device_total / GIB:.1f} GiB of "
            f"{device_total / GIB:.1f} GiB; weights {weights / GIB:.1f} GiB + reserve {reserve / GIB:.1f} GiB + "
            f"one K={rows_needed} scene's cache ({rows_needed} x {capacity} columns) need {need / GIB:.1f} GiB: "
            f"raise ALPAMAYO_GPU_MEMORY_FRACTION to at least {min(1.0, need / device_total):.2f}, or lower "
            f"NIM_ALPAMAYO_MAX_MODEL_LEN / NIM_ALPAMAYO_TRAJ_SAMPLES")
    return p


# What CUDA reports as the device's memory (nvidia-smi's MiB) for the GPUs the profiles promise.
GPUS = {"H100 80GB": 81559 << 20, "H200 141GB": 143771 << 20}


@dataclass(frozen=True)
class ModelBytes:
    """What one profile keeps on the device: weights (target + draft head) and the bytes of one
    cache column (target K/V of every layer, plus the draft's context K/V on dflash2 profiles)."""

    weights: int
    bytes_per_column: int
    prefill_bytes_per_column: int


def scenes_that_fit(device_total: int, fraction: float, model: ModelBytes, capacity: int, k: int) -> int:
    """Scenes of K samples the persistent cache holds at `capacity` columns per row (0: none)."""
    try:
        p = plan("cuda", device_total, fraction, model.weights, model.bytes_per_column, capacity,
                 rows_wanted=1 << 20, rows_needed=k, prefill_bytes_per_column=model.prefill_bytes_per_column)
    except MemoryPlanError:
        return 0
    return p.max_rows // k


def longest_rows_for(device_total: int, fraction: float, model: ModelBytes, scenes: int, k: int) -> int:
    """The largest capacity (columns per row) at which `scenes` scenes of K samples fit:
    fraction x total - weights - fixed reserve >= capacity x scenes x K x column + max(capacity,
    PREFILL_TOKENS) x prefill column."""
    fixed = reserve_bytes(device_total, 0)
    free = int(fraction * device_total) - model.weights - fixed
    longest = free // (scenes * k * model.bytes_per_column + model.prefill_bytes_per_column)
    if longest < PREFILL_TOKENS:        # the prefill pass's cache is PREFILL_TOKENS columns then
        longest = (free - PREFILL_TOKENS * model.prefill_bytes_per_column) // (scenes * k * model.bytes_per_column)
    return max(0, longest)
