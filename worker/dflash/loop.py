"""The DFlash2 speculator: propose -> verify -> accept -> commit over the shared DecodeBatch
(worker/model/generate.py), one step for every row at once:
  1. propose: block = [next_token, MASK x 7] -> Proposer (worker/dflash/proposer.py) -> 7 drafts d1..d7
  2. verify:  one target forward over [next_token, d1..d7] at positions p..p+7 (K/V written), and
     the target's tokens at positions p+1..p+8 with the baseline's position-keyed noise
     (worker/model/sampling.py); the committed positions' hidden states join the draft context
  3. accept:  the longest prefix of drafts equal to the target's tokens, plus the bonus token,
     truncated at a terminal token or max_new exactly as the baseline would stop (worker/dflash/accept.py)
  4. commit:  DecodeBatch.commit, the baseline's own commit: record the tokens and roll back by
     setting each row's length (ragged across the batch)
Greedy rows take argmax at each position, so acceptance is exact match; sampled rows accept
the proposal exactly when the target's own sample equals it. Either way every committed token is
the token the baseline would have produced at that position.
"""

from __future__ import annotations

import torch

from worker.dflash.accept import accepted_prefix, commit_counts
from worker.dflash.draft import DraftModel
from worker.dflash.head import HeadConfig, check_head
from worker.dflash.metrics import RowStats, SpecStats, row_stats
from worker.dflash.proposer import Proposer
from worker.model.decoder import TextDecoder
from worker.model.generate import DecodeBatch
from worker.model.sampling import sample


class DFlash2Speculator:
    """The Speculator (worker/model/generate.py) of AlpamayoRuntime: trajectory requests decode
    through `decode`."""

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
        return SpecStats.merge(self.num_spec_tokens, rows)

    # ---------------------------------------------------------------- the loop
    @torch.inference_mode()
    def decode(self, decoder: TextDecoder, batch: DecodeBatch) -> tuple[DecodeBatch, list[RowStats]]:
        n_spec = self.num_spec_tokens
        offsets = torch.arange(1, n_spec + 2, device=batch.lengths.device)     # sampled positions after lengths
        generating_log, accepted_log = [], []
        while not bool(batch.done.all()):
            generating = batch.generating
            proposals = self.proposer.propose(batch)                                        # (B, 7)
            block = torch.cat([batch.next_token[:, None], proposals], dim=1)               # (B, 8)
            out = decoder.step(block, batch.lengths, batch.rope_delta, batch.cache,
                               context_len=int(batch.lengths.max()) + n_spec + 1, capture=self.target_layer_ids)
            self.proposer.write_context(out.hidden, batch.lengths, batch.rope_delta)
            tokens = sample(batch.mask_logits(out.logits), batch.params, batch.lengths[:, None] + offsets)  # (B, 8)
            n = accepted_prefix(proposals, tokens)
            m = commit_counts(tokens, n, batch.terminal, batch.max_new - batch.n_generated)
            batch.commit(tokens, m, n)
            generating_log.append(generating)
            accepted_log.append(torch.minimum(n, m))
        return batch, row_stats(generating_log, accepted_log, batch.rows, n_spec)
