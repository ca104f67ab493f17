"""When to speculate: per step of the DFlash2 loop, verify 3 or 7 drafts, or take a plain decode
step (the baseline's), whichever is expected to commit the most tokens per second.

Step costs come from warm-up (`calibrate`, worker/dflash/loop.py): per rows bucket the seconds of
a whole loop step for each choice (draft pass, forward, sampling, acceptance and commit: on a small
model the host work around the forward is most of a step). Acceptance
comes from the running rows: each row keeps decayed counts of accepted drafts (successes) and of
first rejections (failures), started from its (task, K) group's acceptance of earlier batches, so a
row's estimate of the per-draft acceptance probability is
    a = (successes + ROW_PRIOR_WEIGHT * a_group) / (successes + failures + ROW_PRIOR_WEIGHT),
and a group's is the same ratio over its batches' counts (halved every batch) with one trial at
PRIOR_ACCEPTANCE.
With per-draft acceptance a, verifying n drafts commits 1 + a + a^2 + ... + a^n tokens per row
(the geometric model of the longest accepted prefix); the step runs the choice with the most
expected tokens per second over the generating rows, a decode step committing one per row.
Evidence decays (ROW_DECAY per step, GROUP_DECAY per batch), so a row that stopped drafting drifts
back to its group's acceptance and a group that stopped drafting back to PRIOR_ACCEPTANCE: each is
probed again when that would pay, at most once in a while. Outputs never depend on the choice: a verify step
commits only tokens the target itself samples, a decode step is the baseline's own step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VERIFY_TOKENS = (4, 8)        # tokens fed per verify step: the anchor token + 3 or 7 drafts
PRIOR_ACCEPTANCE = 0.8        # a group's acceptance before any batch measured it (one trial's weight):
                              # optimistic (mean acceptance length ~4), so new groups draft and learn
ROW_PRIOR_WEIGHT = 2.0        # the group's acceptance counts as this many draft trials in a row's estimate
ROW_DECAY = 0.97              # per step, of a row's evidence
GROUP_DECAY = 0.5             # per batch, of a group's evidence


@dataclass(frozen=True)
class StepCosts:
    """Seconds at one rows bucket (measured at warm-up)."""

    loop: dict[int, float]        # drafts n (0: a plain decode step) -> one whole loop step; what `choose` weighs
    decode: float                 # of which, for reports: the decode(1) forward, hidden states captured,
    verify: dict[int, float]      # tokens T -> the verify(T) forward,
    draft: float                  # one draft pass (block of 8, every row)


@dataclass
class RowAcceptance:
    """Per-row decayed counts of accepted drafts and first rejections (device tensors)."""

    prior: float
    successes: torch.Tensor       # (R,) float
    failures: torch.Tensor        # (R,) float
    observed: list[torch.Tensor] = field(default_factory=list)   # per verify step: (successes, failures) summed

    def estimate(self) -> torch.Tensor:
        """(R,) per-draft acceptance probability of each row."""
        return (self.successes + ROW_PRIOR_WEIGHT * self.prior) / (self.successes + self.failures + ROW_PRIOR_WEIGHT)

    def expected_tokens(self, generating: torch.Tensor, drafts: tuple[int, ...]) -> torch.Tensor:
        """-> (len(drafts),) expected tokens committed by one verify step of n drafts, summed
        over the generating rows (device tensor; the caller reads it with its per-step sync)."""
        a = self.estimate()
        n_max = max(drafts)
        powers = a[:, None] ** torch.arange(1, n_max + 1, device=a.device)        # (R, n_max)
        cum = 1.0 + powers.cumsum(1)                                             # (R, n_max)
        per_row = torch.stack([cum[:, n - 1] for n in drafts], 1)     # (R, len(drafts)); a list index would
                                                                        # be copied to the device, waiting for it
        return (per_row * generating[:, None]).sum(0)

    def observe(self, generating: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
        """One verify step of n drafts: rows still generating accepted `accepted` (R,) of them."""
        ok = generating.float()
        acc = accepted.float() * ok
        rejected = (accepted < n).float() * ok
        self.successes += acc
        self.failures += rejected
        self.observed.append(torch.stack([acc.sum(), rejected.sum()]))

    def decay(self) -> None:
        self.successes *= ROW_DECAY
        self.failures *= ROW_DECAY


class SpeculationPolicy:
    """Step costs per rows bucket and acceptance per (task, K) group; `choose` per step."""

    def __init__(self, verify_tokens: tuple[int, ...] = VERIFY_TOKENS):
        self.drafts = tuple(t - 1 for t in verify_tokens)
        self.costs: dict[int, StepCosts] = {}
        self.groups: dict[object, tuple[float, float]] = {}     # (task, K) -> decayed (successes, failures)

    @property
    def calibrated(self) -> bool:
        return bool(self.costs)

    def costs_for(self, rows: int) -> StepCosts | None:
        """The costs of the smallest calibrated bucket holding `rows` (the largest one past it)."""
        if not self.costs:
            return None
        fits = [b for b in self.costs if b >= rows]
        return self.costs[min(fits) if fits else max(self.costs)]

    def group_acceptance(self, group: object) -> float:
        s, f = self.groups.get(group, (0.0, 0.0))
        return (s + PRIOR_ACCEPTANCE) / (s + f + 1.0)

    def start(self, group: object, rows: int, device) -> RowAcceptance:
        zeros = torch.zeros(rows, device=device)
        return RowAcceptance(self.group_acceptance(group), zeros, zeros.clone())

    def choose(self, costs: StepCosts | None, generating_rows: float, expected: list[float]) -> int:
        """Drafts to verify this step (0: a plain decode step). Uncalibrated: always the most drafts."""
        if costs is None:
            return max(self.drafts)
        best, best_rate = 0, generating_rows / costs.loop[0]
        for n, tokens in zip(self.drafts, expected):
            rate = tokens / costs.loop[n]
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def first_choice(self, costs: StepCosts | None, group: object) -> int:
        """`choose` for a batch's first step, on the host before its head is read: every row starts
        at its group's acceptance (and the rows' count scales every choice's rate alike)."""
        row = RowAcceptance(self.group_acceptance(group), torch.zeros(1), torch.zeros(1))
        return self.choose(costs, 1.0, row.expected_tokens(torch.ones(1), self.drafts).tolist())

    def finish(self, group: object, acceptance: RowAcceptance) -> None:
        """Fold a batch's measured acceptance into its group's counts for the next batch."""
        s, f = self.groups.get(group, (0.0, 0.0))
        ds, df = torch.stack(acceptance.observed).sum(0).tolist() if acceptance.observed else (0.0, 0.0)
        self.groups[group] = (GROUP_DECAY * s + ds, GROUP_DECAY * f + df)
