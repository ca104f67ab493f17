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

from worker.model.fused_ops import available

try:                                   # Triton ships with CUDA builds of torch; CPU installs may lack it
    import triton
    import triton.language as tl
except ImportError:                    # pragma: no cover - exercised only on Triton-less installs
    triton = None

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
    observed: list[tuple[float, float]] = field(default_factory=list)   # per verify step: accepted, rejected rows

    def estimate(self) -> torch.Tensor:
        """(R,) per-draft acceptance probability of each row."""
        return (self.successes + ROW_PRIOR_WEIGHT * self.prior) / (self.successes + self.failures + ROW_PRIOR_WEIGHT)

    def expected_tokens(self, generating: torch.Tensor, drafts: tuple[int, ...]) -> torch.Tensor:
        """-> (len(drafts),) expected tokens committed by one verify step of n drafts, summed
        over the generating rows."""
        a = self.estimate()
        n_max = max(drafts)
        powers = a[:, None] ** torch.arange(1, n_max + 1, device=a.device)        # (R, n_max)
        cum = 1.0 + powers.cumsum(1)                                             # (R, n_max)
        per_row = torch.stack([cum[:, n - 1] for n in drafts], 1)     # (R, len(drafts)); a list index would
                                                                        # be copied to the device, waiting for it
        return (per_row * generating[:, None]).sum(0)

    def step(self, done: torch.Tensor, finishing: torch.Tensor, drafts: tuple[int, ...],
             last: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A loop step's bookkeeping on the device. last = (generating (R,) bool, accepted (R,) long,
        drafts n) of the step just run, None before the first: a verify step's acceptance is
        observed (n > 0), then every row's evidence decays. -> (head (4 + len(drafts),) float =
        [all rows done, rows generating, expected tokens of a verify step per draft count, the
        step's accepted drafts, its first rejections] (the host reads it with its per-step sync and
        hands the last two to `record`), rows generating now (R,) bool). One kernel where the
        fused kernels run (two draft counts): its ~30 torch ops were ~0.5 ms of host time a step
        on the H200 (demo checkpoint, batch 16), more than the verify step itself."""
        if available(done) and len(drafts) == 2:
            return _fused_step(self, done, finishing, drafts, last)
        generating = ~done & ~finishing
        observed = torch.zeros(2, device=done.device)
        if last is not None:
            before, accepted, n = last
            if n:
                ok = before.float()
                acc = accepted.float() * ok
                rejected = (accepted < n).float() * ok
                self.successes += acc
                self.failures += rejected
                observed = torch.stack([acc.sum(), rejected.sum()])
            self.successes *= ROW_DECAY
            self.failures *= ROW_DECAY
        head = torch.cat([done.all()[None].float(), generating.sum()[None].float(),
                          self.expected_tokens(generating, drafts), observed])
        return head, generating

    def record(self, head: list[float], n: int) -> None:
        """The host's copy of a verify step's head: its observed acceptance, for `finish`."""
        if n:
            self.observed.append((head[-2], head[-1]))


def _fused_step(acc: RowAcceptance, done, finishing, drafts, last):
    rows = done.shape[0]
    head = torch.empty(6, device=done.device)
    generating = torch.empty_like(done)
    before, accepted, n = last if last is not None else (done, acc.successes, 0)    # unread: OBSERVE off
    _policy_step_kernel[(1,)](done.view(torch.uint8), finishing.view(torch.uint8), before.view(torch.uint8), accepted,
                acc.successes, acc.failures, head, generating.view(torch.uint8), rows, n, acc.prior, ROW_DECAY,
                ROW_PRIOR_WEIGHT, OBSERVE=bool(n), DECAY=last is not None, N_A=drafts[0], N_B=drafts[1],
                BLOCK=max(16, triton.next_power_of_2(rows)))
    return head, generating


if triton is not None:
    @triton.jit
    def _policy_step_kernel(DONE, FINISHING, BEFORE, ACCEPTED, SUCC, FAIL, HEAD, GENERATING, rows, n, prior, decay, prior_weight,
              OBSERVE: tl.constexpr, DECAY: tl.constexpr, N_A: tl.constexpr, N_B: tl.constexpr, BLOCK: tl.constexpr):
        """`RowAcceptance.step` in one program over the rows."""
        r = tl.arange(0, BLOCK)
        live = r < rows
        done = tl.load(DONE + r, mask=live, other=1) != 0
        generating = (done == 0) & (tl.load(FINISHING + r, mask=live, other=1) == 0) & live
        s = tl.load(SUCC + r, mask=live, other=0.0)
        f = tl.load(FAIL + r, mask=live, other=0.0)
        acc = tl.zeros([BLOCK], tl.float32)
        rejected = tl.zeros([BLOCK], tl.float32)
        if OBSERVE:
            ok = (tl.load(BEFORE + r, mask=live, other=0) != 0) & live
            a = tl.load(ACCEPTED + r, mask=live, other=0)
            acc = tl.where(ok, a.to(tl.float32), 0.0)
            rejected = tl.where(ok & (a < n), 1.0, 0.0)
            s = s + acc
            f = f + rejected
        if DECAY:
            s = s * decay
            f = f * decay
            tl.store(SUCC + r, s, mask=live)
            tl.store(FAIL + r, f, mask=live)
        p = (s + prior_weight * prior) / (s + f + prior_weight)
        term = tl.full([BLOCK], 1.0, tl.float32)
        total = term
        e_a = term
        for i in tl.static_range(1, N_B + 1):
            term = term * p
            total = total + term
            if i == N_A:
                e_a = total
        g = tl.where(generating, 1.0, 0.0)
        tl.store(HEAD, tl.min(tl.where(live & (done == 0), 0.0, 1.0), 0))
        tl.store(HEAD + 1, tl.sum(g, 0))
        tl.store(HEAD + 2, tl.sum(e_a * g, 0))
        tl.store(HEAD + 3, tl.sum(total * g, 0))
        tl.store(HEAD + 4, tl.sum(acc, 0))
        tl.store(HEAD + 5, tl.sum(rejected, 0))
        tl.store(GENERATING + r, generating.to(tl.uint8), mask=live)


class SpeculationPolicy:
    """Step costs per rows bucket and acceptance per (task, K) group; `choose` per step."""

    def __init__(self, verify_tokens: tuple[int, ...] = VERIFY_TOKENS):
        self.drafts = tuple(t - 1 for t in verify_tokens)
        self.costs: dict[int, StepCosts] = {}
        self.groups: dict[object, tuple[float, float]] = {}     # (task, K) -> decayed (successes, failures)

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
        ds, df = (sum(x) for x in zip(*acceptance.observed)) if acceptance.observed else (0.0, 0.0)
        self.groups[group] = (GROUP_DECAY * s + ds, GROUP_DECAY * f + df)
