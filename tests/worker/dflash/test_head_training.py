"""DFlash2 head training: one step's sequences run in a single padded forward, with the same loss
as one sequence at a time (CPU, fp32, tiny random checkpoint)."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worker.dflash.draft import MASK_TOKEN, DraftModel
from worker.dflash.head import head_config_for
from worker.dflash.train import GAMMA, Sequence, _batch_loss, collect_sequences, init_from_base
from worker.model.runtime import AlpamayoRuntime

from tests.worker.model.test_runtime import scene


@pytest.fixture(scope="module")
def setup(tiny):
    rt = AlpamayoRuntime.load(tiny[0], device="cpu", dtype=torch.float32)
    rt.trajectory_max_new = 12
    # 512 candidates: the tiny random model's targets then fall among them often enough that the
    # selector's loss terms are part of the comparison
    cfg = dataclasses.replace(head_config_for(rt.cfg, mask_token_id=rt.tok.token_to_id(MASK_TOKEN)),
                              num_candidates=512)
    full = collect_sequences(rt, [scene(300 + i, k=1, temperature=0.8) for i in range(4)], cfg.target_layer_ids)
    # generations of different lengths (cut after 12, 9, 6, 4 tokens), so the batch is padded
    seqs = [Sequence({i: h[:s.start + n] for i, h in s.hidden.items()}, s.tokens[:s.start + n], s.rope_delta, s.start)
            for s, n in zip(full, (12, 9, 6, 4))]
    torch.manual_seed(0)
    draft = DraftModel(cfg).float()
    init_from_base(draft, rt.model)
    with torch.no_grad():                      # a selector with weights, so its loss term is not trivial
        draft.selector.q_proj.weight.normal_(std=0.05)
    return rt, draft, seqs


def _looped_loss(draft, embed, lm_head, seqs, anchors_per_seq, rng):
    """The loss as it was computed before batching: one sequence at a time (the reference)."""
    c = draft.config
    n = c.block_size
    weights = torch.tensor([math.exp(-k / GAMMA) for k in range(n - 1)])
    losses = []
    for s in seqs:
        L = len(s.tokens)
        a = torch.tensor(rng.integers(s.start, L - 1, size=min(anchors_per_seq, L - s.start - 1)))
        feats = draft.project({i: h[None] for i, h in s.hidden.items()})
        ctx = draft.context_kv(feats, torch.arange(L)[None] + s.rope_delta)
        m = len(a)
        ctx = [(k.expand(m, -1, -1, -1), v.expand(m, -1, -1, -1)) for k, v in ctx]
        visible = torch.arange(L)[None, :] < a[:, None]
        block = torch.full((m, n), c.mask_token_id, dtype=torch.long)
        block[:, 0] = s.tokens[a]
        h = draft.block_hidden(embed(block).float(), a[:, None] + torch.arange(n) + s.rope_delta, ctx, visible)
        tgt_idx = a[:, None] + 1 + torch.arange(n - 1)
        valid = tgt_idx < L
        tgt = s.tokens[tgt_idx.clamp(max=L - 1)]
        logits = lm_head(h[:, 1:]).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view(m, -1)
        w = weights[None, :] * valid
        losses.append((ce * w).sum() / w.sum())
        cand_logits, cand = logits.detach().topk(c.num_candidates, dim=-1)
        prev = torch.cat([block[:, :1], tgt[:, :-1]], dim=1)
        scores = draft.selector.scores(h[:, 1:], embed(prev).float(), embed(cand).float(), cand_logits)
        hit = cand == tgt[..., None]
        ok = hit.any(-1) & valid
        if ok.any():
            losses.append(0.5 * F.cross_entropy(scores[ok], hit[ok].float().argmax(-1)))
    return torch.stack(losses).mean(), len(losses) - len(seqs)


def test_padded_batch_loss_equals_the_loss_of_one_sequence_at_a_time(setup):
    rt, draft, seqs = setup
    embed, lm_head = rt.model.language_model.embed_tokens, rt.model.lm_head
    assert len({len(s.tokens) for s in seqs}) > 1, "the sequences must differ in length (padding is tested)"
    batched = _batch_loss(draft, embed, lm_head, seqs, 5, np.random.default_rng(3))
    one_by_one, selector_terms = _looped_loss(draft, embed, lm_head, seqs, 5, np.random.default_rng(3))
    assert selector_terms >= 1                     # the selector part is compared too
    assert torch.allclose(batched, one_by_one, rtol=1e-5, atol=1e-6), (float(batched), float(one_by_one))
    batched.backward()
    assert float(draft.selector.q_proj.weight.grad.abs().sum()) > 0 and float(draft.fc.weight.grad.abs().sum()) > 0
