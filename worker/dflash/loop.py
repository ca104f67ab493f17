"""The DFlash2 decoding loop over the shared DecodeBatch (worker/model/generate.py).

Each step, for every row at once:
  1. draft:  block = [next_token, MASK x 7] -> Proposer -> 7 proposals d1..d7
  2. verify: one target forward over [next_token, d1..d7] at positions p..p+7 (K/V written)
  3. sample the target at positions p+1..p+8 with the baseline's position-keyed noise
     (worker/model/sampling.py) and accept the longest prefix where d_i equals the target's
     token; the target's token at the first mismatch (or after d7) is the bonus token
  4. commit (truncated at a terminal token or max_new exactly as the baseline would stop),
     roll back by setting each row's length (ragged across the batch), append the committed
     positions' target hidden states to the draft context.
Greedy rows take argmax at each position, so acceptance is exact match; sampled rows accept
the proposal exactly when the target's own sample equals it. Either way every committed token is
the token the baseline would have produced at that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.dflash.draft import DraftModel
from worker.dflash.head import HeadConfig, check_head
from worker.dflash.proposer import Proposer
from worker.model.decoder import TextDecoder
from worker.model.generate import DecodeBatch
from worker.model.runtime import SpecStats
from worker.model.sampling import sample


@dataclass
class RowStats:
    accepted: list[int]
    drafted: list[int]


class DFlash2Speculator:
    """Plugged into AlpamayoRuntime: trajectory requests decode through `decode`."""

    def __init__(self, draft: DraftModel, base_model, head_path: str | None = None):
        self.draft = draft
        self.config: HeadConfig = draft.config
        self.proposer = Proposer(draft, base_model.language_model.embed_tokens, base_model.lm_head)
        self.target_layer_ids = tuple(self.config.target_layer_ids)
        self.block_size = self.config.block_size
        self.num_spec_tokens = self.config.num_spec_tokens
        self.head_path = head_path
        self.dtype = next(base_model.parameters()).dtype

    @classmethod
    def factory(cls, head_path: str):
        """-> callable(model, cfg, device, dtype) for AlpamayoRuntime.load."""
        def make(model, cfg, device, dtype):
            head_cfg = check_head(head_path, cfg)
            draft = DraftModel.from_dir(head_path, head_cfg, device, dtype)
            return cls(draft, model, head_path)
        return make

    # ---------------------------------------------------------------- runtime hooks
    def begin(self, rows: int, capacity: int, persistent: bool = False, graphs=None) -> None:
        dev = self.draft.fc.weight.device
        self.proposer.graphs = graphs
        self.proposer.begin(rows, capacity, dev, self.dtype, persistent=persistent)

    def load_context(self, rows: slice, hidden: dict[int, torch.Tensor], rope_delta: int) -> None:
        dev = self.draft.fc.weight.device
        self.proposer.write_context(hidden, torch.zeros(1, dtype=torch.long, device=dev),
                                    torch.tensor([rope_delta], device=dev), fork=rows)

    def merge_stats(self, rows: list[RowStats]) -> SpecStats:
        """K samples of one request: steps concatenated in sample order."""
        acc = [a for r in rows for a in r.accepted]
        dr = [d for r in rows for d in r.drafted]
        return SpecStats(self.num_spec_tokens, acc, dr)

    # ---------------------------------------------------------------- the loop
    @torch.inference_mode()
    def decode(self, decoder: TextDecoder, batch: DecodeBatch) -> tuple[DecodeBatch, list[RowStats]]:
        n_spec = self.num_spec_tokens
        dev = batch.lengths.device
        ar = torch.arange(n_spec + 1, device=dev)
        fresh_log, acc_log = [], []
        while not bool(batch.done.all()):
            active = ~batch.done
            fresh = active & ~batch.finishing
            proposals = self.proposer.propose(batch)
            block = torch.cat([batch.next_token[:, None], proposals], dim=1)               # (B, 8)
            out = decoder.step(block, batch.lengths, batch.rope_delta, batch.cache,
                               context_len=int(batch.lengths.max()) + n_spec + 1, capture=self.target_layer_ids)
            batch.steps += 1
            self.proposer.write_context(out.hidden, batch.lengths, batch.rope_delta)
            tokens = sample(batch.mask_logits(out.logits), batch.params, batch.lengths[:, None] + 1 + ar)  # (B, 8)
            n = (proposals == tokens[:, :n_spec]).long().cumprod(1).sum(1)               # accepted drafts
            commit = torch.where(ar < n[:, None], torch.cat([proposals, proposals[:, -1:]], 1), tokens)
            is_term = torch.isin(commit, batch.terminal) & (ar <= n[:, None])
            m_term = torch.where(is_term.any(1), is_term.long().argmax(1) + 1, n_spec + 1)
            m = torch.minimum(torch.minimum(n + 1, m_term), batch.max_new - batch.n_generated)
            m = torch.where(fresh, m.clamp(min=1), torch.zeros_like(m))
            # record committed tokens
            for i in range(n_spec + 1):
                take = fresh & (i < m)
                idx = (batch.n_generated + i).clamp(max=batch.generated.shape[1] - 1)[:, None]
                cur = batch.generated.gather(1, idx)[:, 0]
                batch.generated.scatter_(1, idx, torch.where(take, commit[:, i], cur)[:, None])
            batch.n_generated += m
            # lengths, next token, finishing/done
            flushed = active & batch.finishing                  # fed their last token this step
            in_cache = fresh & (m <= n)                         # ended on an accepted draft (in cache)
            bonus = fresh & ~in_cache
            batch.lengths += torch.where(flushed, 1, 0) + torch.where(in_cache, 1 + m, 0) \
                + torch.where(bonus, 1 + n, 0)
            batch.done |= flushed | in_cache
            last = commit.gather(1, (m - 1).clamp(min=0)[:, None])[:, 0]
            batch.next_token = torch.where(bonus, last, batch.next_token)
            ends = bonus & (torch.isin(last, batch.terminal) | (batch.n_generated >= batch.max_new))
            batch.finishing |= ends
            fresh_log.append(fresh)
            acc_log.append(torch.minimum(n, m))
        if not fresh_log:
            return batch, [RowStats([], []) for _ in range(batch.rows)]
        fresh_all = torch.stack(fresh_log).cpu()        # (steps, B)
        acc_all = torch.stack(acc_log).cpu()
        stats = []
        for r in range(batch.rows):
            sel = fresh_all[:, r]
            accepted = acc_all[sel, r].tolist()
            stats.append(RowStats(accepted, [n_spec] * len(accepted)))
        return batch, stats

