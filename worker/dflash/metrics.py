"""Speculative-decoding metrics: per-row counters from the loop, per-request SpecStats, and the
per-request block the seed defines.

For K > 1 the counters and histogram bins sum all samples and the rates come from those totals;
`detailed` adds the per-step arrays (steps concatenated in sample order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowStats:
    """One row's (one sample's) verify steps: drafts accepted and drafted per step."""

    accepted: list[int]
    drafted: list[int]


@dataclass
class SpecStats:
    """Speculative-decoding counters of one request (all its samples summed)."""

    num_spec_tokens: int
    per_step_accepted: list[int]
    per_step_drafted: list[int]

    @property
    def steps(self) -> int:
        return len(self.per_step_accepted)

    @property
    def drafted(self) -> int:
        return sum(self.per_step_drafted)

    @property
    def accepted(self) -> int:
        return sum(self.per_step_accepted)

    @classmethod
    def merge(cls, num_spec_tokens: int, rows: list[RowStats]) -> "SpecStats":
        """The K samples of one request: steps concatenated in sample order."""
        return cls(num_spec_tokens, [a for r in rows for a in r.accepted], [d for r in rows for d in r.drafted])


def row_stats(generating: list[torch.Tensor], accepted: list[torch.Tensor], rows: int,
              num_spec_tokens: int) -> list[RowStats]:
    """Per verify step, generating (R,) bool and accepted drafts (R,) long -> one RowStats per row,
    counting only the steps where the row was still generating."""
    if not generating:
        return [RowStats([], []) for _ in range(rows)]
    gen = torch.stack(generating).cpu()            # (steps, R)
    acc = torch.stack(accepted).cpu()
    out = []
    for r in range(rows):
        steps = acc[gen[:, r], r].tolist()
        out.append(RowStats(steps, [num_spec_tokens] * len(steps)))
    return out


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
