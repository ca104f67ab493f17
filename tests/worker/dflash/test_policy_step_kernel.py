"""The DFlash2 loop's per-step bookkeeping (`RowAcceptance.step`: a verify step's acceptance
observed, the rows' evidence decayed, the head the policy reads) is one kernel on the GPU path
instead of ~30 torch ops: the same head, rows generating and decayed counts as the torch form,
through Triton's interpreter on the CPU (tests/worker/model/interpreted.py)."""

from __future__ import annotations

from tests.worker.model.interpreted import run_interpreted

_CASES = r"""
import json

import torch

import worker.dflash.policy as policy
from worker.dflash.policy import RowAcceptance
from worker.model.fused_ops import reference_only

launched = []
kernel = policy._fused_step
policy._fused_step = lambda *a: launched.append(1) or kernel(*a)

gen = torch.Generator().manual_seed(3)
worst = {"head": 0.0, "counts": 0.0}
same_generating = True
for rows, last_n in [(1, None), (5, 7), (16, 3), (16, 0), (37, 7)]:
    done = torch.rand(rows, generator=gen) < 0.3
    finishing = (torch.rand(rows, generator=gen) < 0.2) & ~done
    s0, f0 = torch.rand(rows, generator=gen) * 5, torch.rand(rows, generator=gen) * 3
    before = torch.rand(rows, generator=gen) < 0.8
    accepted = torch.randint(0, 8, (rows,), generator=gen)
    last = None if last_n is None else (before, accepted, last_n)
    out = {}
    for fused in (True, False):
        acc = RowAcceptance(0.7, s0.clone(), f0.clone())
        if fused:
            head, generating = acc.step(done, finishing, (3, 7), last)
        else:
            with reference_only():
                head, generating = acc.step(done, finishing, (3, 7), last)
        out[fused] = (head, generating, acc.successes, acc.failures)
    (h1, g1, s1, f1), (h2, g2, s2, f2) = out[True], out[False]
    worst["head"] = max(worst["head"], ((h1 - h2).abs() / h2.abs().clamp(min=1)).max().item())
    worst["counts"] = max(worst["counts"], (s1 - s2).abs().max().item(), (f1 - f2).abs().max().item())
    same_generating &= torch.equal(g1, g2) and g1.dtype == torch.bool and h1.shape == h2.shape == (6,)
all_done = RowAcceptance(0.7, torch.zeros(3), torch.zeros(3)).step(torch.ones(3, dtype=torch.bool),
                                                                  torch.zeros(3, dtype=torch.bool), (3, 7))[0]
print(json.dumps(dict(worst=worst, same_generating=bool(same_generating), all_done=all_done.tolist(), launched=len(launched))))
"""


def test_the_step_kernel_gives_the_torch_forms_head_and_counts():
    out = run_interpreted(_CASES)
    assert out["launched"] == 6 and out["same_generating"]
    assert out["worst"]["head"] < 1e-5 and out["worst"]["counts"] < 1e-5, out["worst"]
    assert out["all_done"][:2] == [1.0, 0.0]
