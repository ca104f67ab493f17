"""A prefill pass's prompts reach the draft's context cache through the GPU path's fused kernels
(`DraftModel.write_context_fused`: projection, norm, q/k/v product, one kernel that norms, rotates
and writes), each prompt written once into its first sample's row and copied to the others: the
same K/V as the eager path (`project`, `context_kv`, scatter), rows outside the pass untouched.
Through Triton's interpreter on the CPU, in one subprocess (tests/worker/model/interpreted.py)."""

from __future__ import annotations

from tests.worker.model.interpreted import run_interpreted

_CASES = r"""
import json

import torch

from worker.dflash.draft import DraftModel
from worker.dflash.head import HeadConfig
from worker.dflash.proposer import Proposer

torch.manual_seed(5)
c = HeadConfig(block_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, target_layer_ids=(0, 1), mask_token_id=3, num_candidates=4,
               selector_dim=8, vocab_size=50)
draft = DraftModel(c).eval()
prop = Proposer(draft, torch.nn.Embedding(50, 64), torch.nn.Linear(64, 50, bias=False))
g, p, per, deltas = 3, 7, 2, [4, -1, 0]
hidden = {i: torch.randn(g, p, 64) for i in c.target_layer_ids}
caches, fused_calls = {}, []
real = draft.write_context_fused
draft.write_context_fused = lambda *a: fused_calls.append(1) or real(*a)
for fused in (True, False):
    prop.begin(9, 12, "cpu", torch.float32)
    if not fused:
        import worker.dflash.proposer as proposer_module      # the eager path (the interpreter counts as a GPU)
        proposer_module.fused_available = lambda x: False
    with torch.inference_mode():
        prop.write_prompts(slice(1, 1 + g * per), hidden, deltas, per)
    caches[fused] = [t.clone() for t in (*prop.k, *prop.v)]
err = max((a - b).abs().max().item() for a, b in zip(caches[True], caches[False]))
outside = all(not t[r].any() for t in caches[True] for r in (0, 7, 8))
siblings = all(torch.equal(t[1 + j * per], t[2 + j * per]) for t in caches[True] for j in range(g))
written = all(t[1 + j * per, :, :p].abs().sum() > 0 and not t[1 + j * per, :, p:].any() for t in caches[True] for j in range(g))
print(json.dumps(dict(err=err, outside=outside, siblings=siblings, written=written, fused_calls=len(fused_calls))))
"""


def test_fused_prompt_context_matches_the_eager_path():
    out = run_interpreted(_CASES)
    assert out["fused_calls"] == 1 and out["outside"] and out["siblings"] and out["written"]
    assert out["err"] < 1e-4
