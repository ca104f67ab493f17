"""Batched reasoning decode over the static cache: the state every decoding loop shares, and the
baseline loop (one token per step). DFlash2's loop (worker/dflash/loop.py) runs on the same state.

Row bookkeeping (R rows = scenes x samples):
  lengths[r]     tokens of row r whose K/V are in the cache (prompt + fed generated tokens)
  next_token[r]  the newest sampled token, not yet in the cache
  generated      (R, max_new) sampled tokens; n_generated[r] of them valid
A row *finishes* when it samples a terminal token or reaches its max_new; its last token is
then still fed once so that its K/V is in the cache (the expert attends up to and including
`<|traj_future_start|>`), after which the row is done and frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.model.decoder import StaticKVCache, TextDecoder
from worker.model.sampling import SamplingParams, sample


@dataclass
class DecodeBatch:
    cache: StaticKVCache
    lengths: torch.Tensor        # (R,) long
    next_token: torch.Tensor     # (R,) long
    rope_delta: torch.Tensor     # (R,) long
    params: SamplingParams
    banned: torch.Tensor         # (V,) bool: ids never sampled
    terminal: torch.Tensor       # (n,) long: ids that end a row's reasoning
    max_new: torch.Tensor        # (R,) long
    generated: torch.Tensor      # (R, max(max_new)) long
    n_generated: torch.Tensor    # (R,) long
    finishing: torch.Tensor      # (R,) bool: last token sampled, K/V not yet written
    done: torch.Tensor           # (R,) bool
    steps: int = 0               # forward passes run by the loop
    per_row_steps: torch.Tensor = field(default=None)  # (R,) verify/decode steps while active

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(self.banned, float("-inf"))

    def append(self, rows_mask: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record `tokens` (R,) as the next generated token of rows in rows_mask; mark finishing."""
        idx = self.n_generated.clamp(max=self.generated.shape[1] - 1)
        cur = self.generated.gather(1, idx[:, None])[:, 0]
        self.generated.scatter_(1, idx[:, None], torch.where(rows_mask, tokens, cur)[:, None])
        self.n_generated += rows_mask.long()
        self.next_token = torch.where(rows_mask, tokens, self.next_token)
        ends = rows_mask & (torch.isin(tokens, self.terminal) | (self.n_generated >= self.max_new))
        self.finishing |= ends


def start_batch(cache: StaticKVCache, prompt_lengths: torch.Tensor, first_logits: torch.Tensor,
                rope_delta: torch.Tensor, params: SamplingParams, banned: torch.Tensor,
                terminal: torch.Tensor, max_new: torch.Tensor, real_rows: int | None = None) -> DecodeBatch:
    """Sample each row's first token from its prefill logits (R, V) at position prompt_length.

    Rows from `real_rows` on are padding (to a CUDA-graph bucket): done from the start."""
    r = prompt_lengths.shape[0]
    dev = prompt_lengths.device
    first_logits = first_logits.masked_fill(banned, float("-inf"))
    first = sample(first_logits[:, None], params, prompt_lengths[:, None])[:, 0]
    batch = DecodeBatch(
        cache=cache, lengths=prompt_lengths.clone(), next_token=first, rope_delta=rope_delta,
        params=params, banned=banned, terminal=terminal, max_new=max_new,
        generated=torch.zeros(r, int(max_new.max()), dtype=torch.long, device=dev),
        n_generated=torch.zeros(r, dtype=torch.long, device=dev),
        finishing=torch.zeros(r, dtype=torch.bool, device=dev),
        done=torch.zeros(r, dtype=torch.bool, device=dev),
        per_row_steps=torch.zeros(r, dtype=torch.long, device=dev),
    )
    batch.append(torch.ones(r, dtype=torch.bool, device=dev), first)
    if real_rows is not None and real_rows < r:
        batch.done[real_rows:] = True
    return batch


@torch.inference_mode()
def baseline_decode(decoder: TextDecoder, batch: DecodeBatch) -> DecodeBatch:
    """One token per step until every row is done."""
    while not bool(batch.done.all()):
        active = ~batch.done
        out = decoder.step(batch.next_token[:, None], batch.lengths, batch.rope_delta, batch.cache,
                           context_len=int(batch.lengths.max()) + 1)
        batch.steps += 1
        batch.per_row_steps += active.long()
        batch.lengths += active.long()
        newly_done = active & batch.finishing
        batch.done |= newly_done
        grow = active & ~newly_done
        logits = batch.mask_logits(out.logits[:, 0])
        tokens = sample(logits[:, None], batch.params, batch.lengths[:, None])[:, 0]
        batch.append(grow, tokens)
    return batch
