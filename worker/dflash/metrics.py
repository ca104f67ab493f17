"""Speculative-decoding metrics: the per-request block the seed defines.

For K > 1 the counters and histogram bins sum all samples and the rates come from those totals;
`detailed` adds the per-step arrays (steps concatenated in sample order).
"""

from __future__ import annotations

from worker.model.runtime import SpecStats


def speculative_block(stats: SpecStats, detailed: bool = False) -> dict:
    steps = stats.steps
    drafted = stats.drafted
    accepted = stats.accepted
    histogram = [0] * (stats.num_spec_tokens + 1)
    for a in stats.per_step_accepted:
        histogram[a] += 1
    block = {
        "num_spec_tokens": stats.num_spec_tokens,
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "acceptance_histogram": histogram,
    }
    if detailed:
        block["per_step_accepted"] = list(stats.per_step_accepted)
        block["per_step_drafted"] = list(stats.per_step_drafted)
    return block
