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
    baseline_steps: int = 0       # decode steps without drafts (the policy chose the baseline's step)


@dataclass
class SpecStats:
    """Speculative-decoding counters of one request (all its samples summed)."""

    num_spec_tokens: int
    per_step_accepted: list[int]
    per_step_drafted: list[int]
    baseline_steps: int = 0

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
        return cls(num_spec_tokens, [a for r in rows for a in r.accepted], [d for r in rows for d in r.drafted],
                   sum(r.baseline_steps for r in rows))


def row_stats(generating: list[torch.Tensor], accepted: list[torch.Tensor], rows: int,
              num_spec_tokens: int, drafted: list[int] | None = None) -> list[RowStats]:
    """Per loop step, generating (R,) bool, accepted drafts (R,) long and drafts verified (0: a
    plain decode step; default num_spec_tokens every step) -> one RowStats per row, counting only
    the steps where the row was still generating."""
    if not generating:
        return [RowStats([], []) for _ in range(rows)]
    drafted = [num_spec_tokens] * len(generating) if drafted is None else drafted
    gen = torch.stack(generating).cpu()            # (steps, R)
    acc = torch.stack(accepted).cpu()
    spec = torch.tensor([d > 0 for d in drafted])
    n = torch.tensor(drafted)
    out = []
    for r in range(rows):
        verify = gen[:, r] & spec
        out.append(RowStats(acc[verify, r].tolist(), n[verify].tolist(), int((gen[:, r] & ~spec).sum())))
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
    block["num_baseline_steps"] = stats.baseline_steps
    total = steps + stats.baseline_steps
    block["speculated_step_fraction"] = steps / total if total else 0.0
    block["mean_verify_tokens"] = 1.0 + drafted / steps if steps else 1.0
    if detailed:
        block["per_step_accepted"] = list(stats.per_step_accepted)
        block["per_step_drafted"] = list(stats.per_step_drafted)
    return block
