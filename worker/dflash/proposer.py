"""Block drafting: [last committed token, MASK x 7] -> one draft forward -> selector -> 7 proposals.

The proposer keeps, per draft layer, a static cache of the context K/V (projected target hidden
states of every committed position), indexed by position like the target cache: row r's context
is positions [0, lengths[r]) of the target, so rollback needs nothing here either.
"""

from __future__ import annotations

import torch

from worker.dflash.draft import DraftModel
from worker.model.fp8 import Fp8Linear
from worker.model.fused_ops import available as fused_available
from worker.model.inputs import to_device


class Proposer:
    def __init__(self, draft: DraftModel, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module):
        self.draft = draft
        self.embed = embed_tokens
        self.lm_head = lm_head      # the target's
        self.head = lm_head         # what the draft's candidate logits go through (`use_fp8`)
        c = draft.config
        self.block_size = c.block_size
        self.mask_token_id = c.mask_token_id
        self.num_candidates = c.num_candidates
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.graphs = None          # GraphCache shared with the runtime (CUDA)
        self.persistent = False     # context caches kept across batches (graph replay needs fixed addresses)

    def use_fp8(self) -> None:
        """fp8 proposals, for the fp8 profiles (once; the bf16 weights go): the draft's products in
        e4m3 (`DraftModel.quantize_fp8`) and its candidate logits through an e4m3 copy of the LM
        head. Proposals only: the target verifies through its own bf16 head, so every output is
        unchanged. H200, 32B shape, batch 1: the draft pass read the bf16 head (1.56 GB) in 0.37 of
        its 0.98 ms; the draft's 0.62 B weights it quantises pay for most of the copy's 0.78 GB."""
        if self.head is not self.lm_head:
            return
        self.draft.quantize_fp8()
        self.head = Fp8Linear(self.lm_head)
        if self.graphs is not None:
            self.graphs.clear()          # draft passes captured over the bf16 weights

    def begin(self, rows: int, capacity: int, device, dtype, persistent: bool = False) -> None:
        c = self.draft.config
        shape = (rows, c.num_key_value_heads, capacity, c.head_dim)
        if persistent and self.persistent and self.k and tuple(self.k[0].shape) == shape:
            return
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        if persistent and self.graphs is not None:
            self.graphs.clear()          # addresses changed: recapture
        self.persistent = persistent

    def prepare(self, batch) -> None:
        """Host work before a batch's loop (its graphed steps replay without running Python):
        none here; the benchmarks' oracle (worker/dflash/oracle.py) loads its reference."""

    @torch.inference_mode()
    def write_context(self, hidden: dict[int, torch.Tensor], start: torch.Tensor, rope_delta: torch.Tensor,
                      rows: slice | None = None) -> None:
        """Project target hidden states {layer: (b, T, H)} and write their context K/V at positions
        start[i]..start[i]+T-1 of the i-th of `rows` (default: rows 0..b-1; a slice with a step
        takes every per-th row, as `write_prompts` does)."""
        b = start.shape[0]
        rows = rows or slice(0, b)
        caches = [(k[rows], v[rows]) for k, v in zip(self.k, self.v)]
        if fused_available(start):
            self.draft.write_context_fused(hidden, start, rope_delta, caches)
            return
        feats = self.draft.project(hidden)                                 # (b, T, H)
        t = feats.shape[1]
        pos = start[:, None] + torch.arange(t, device=feats.device)        # (b, T) cache indices
        kv = self.draft.context_kv(feats, pos + rope_delta[:, None])
        d = self.draft.config.head_dim
        for (k_cache, v_cache), (k, v) in zip(caches, kv):
            idx = pos[:, None, :, None].expand(b, k.shape[1], t, d)
            k_cache.scatter_(2, idx, k.to(k_cache.dtype))
            v_cache.scatter_(2, idx, v.to(v_cache.dtype))

    @torch.inference_mode()
    def write_prompts(self, rows: slice, hidden: dict[int, torch.Tensor], rope_deltas: list[int], per: int) -> None:
        """A prefill pass's G prompts {layer: (G, P, H)} as the context of `rows` (G x per rows:
        prompt j's at rows.start + j * per .. + per - 1, its samples alike) at positions 0..P-1,
        rotary positions + rope_deltas[j]: written once per prompt (one pass of launches for the
        G prompts: per prompt they cost a demo scene 0.8 ms of the H200 host's time), then copied
        to the prompt's other samples."""
        g, p = next(iter(hidden.values())).shape[:2]
        dev = self.k[0].device
        firsts = slice(rows.start, rows.stop, per)
        self.write_context(hidden, torch.zeros(g, dtype=torch.long, device=dev),
                           to_device(torch.tensor(rope_deltas, dtype=torch.long), dev), firsts)
        for sample in range(1, per):
            others = slice(rows.start + sample, rows.stop, per)
            for cache in (*self.k, *self.v):
                cache[others, :, :p] = cache[firsts, :, :p]

    @property
    def graphed(self) -> bool:
        """Whether draft passes replay CUDA graphs: graphs on, over the persistent context caches."""
        return self.persistent and self.graphs is not None

    def propose(self, batch) -> torch.Tensor:
        """DecodeBatch -> proposals (B, 7) for the positions after each row's next_token (the last
        committed token, not yet in the cache, at position lengths). A CUDA graph per rows bucket
        over the persistent context caches when graphs are on."""
        banned = batch.banned
        if self.graphed:
            cap = self.k[0].shape[2]
            return self.graphs.run(("draft", batch.rows, id(banned)),
                                   lambda t, n, d: self._propose(t, n, d, banned, cap),
                                   batch.next_token, batch.lengths, batch.rope_delta)
        return self._propose(batch.next_token, batch.lengths, batch.rope_delta, banned, int(batch.lengths.max()))

    @torch.inference_mode()
    def _propose(self, next_token: torch.Tensor, lengths: torch.Tensor, rope_delta: torch.Tensor,
                 banned: torch.Tensor, s: int) -> torch.Tensor:
        h, cand_logits, cand = self.candidates(next_token, lengths, rope_delta, banned, s)
        return self.select(h, next_token, cand_logits, cand)

    def candidates(self, next_token: torch.Tensor, lengths: torch.Tensor, rope_delta: torch.Tensor,
                   banned: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft pass over [next_token, MASK x 7] -> h (B, 8, H), the top-C candidates' logits
        (B, 7, C) and ids (B, 7, C) (s: context columns to attend, the persistent cache's capacity
        under graphs)."""
        b = next_token.shape[0]
        dev = next_token.device
        n = self.block_size
        block = torch.full((b, n), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = next_token
        emb = self.embed(block).to(self.k[0].dtype)
        if fused_available(emb):
            h = self.draft.block_hidden_fused(emb, lengths, rope_delta, list(zip(self.k, self.v)))
        else:
            positions = lengths[:, None] + torch.arange(n, device=dev) + rope_delta[:, None]
            ctx = [(k[:b, :, :s], v[:b, :, :s]) for k, v in zip(self.k, self.v)]
            visible = torch.arange(s, device=dev)[None, :] < lengths[:, None]
            h = self.draft.block_hidden(emb, positions, ctx, visible)      # (B, n, H)
        # one (B * 7, H) matrix: a strided 3-D slice would run as B batched products, each
        # reading the whole LM head
        hb = h[:, 1:].reshape(b * (n - 1), -1)
        logits = self.head(hb).float().view(b, n - 1, -1).masked_fill(banned, float("-inf"))
        cand_logits, cand = logits.topk(self.num_candidates, dim=-1)      # (B, n-1, C)
        return h, cand_logits, cand

    def select(self, h: torch.Tensor, next_token: torch.Tensor, cand_logits: torch.Tensor,
               cand: torch.Tensor) -> torch.Tensor:
        """The selector's choice among the candidates, position by position, each scored given the
        token chosen before it -> proposals (B, 7). The scores of every candidate given every token
        the position before could have chosen are one batched product, (B, 7, C, C); only the walk
        along the chosen path is sequential (two small operations a position: 7 x 12 in a loop that
        scored the chosen token's successors one position at a time)."""
        b, m, c = cand.shape
        cand_emb = self.embed(cand).to(h.dtype)                                       # (B, m, C, H)
        first = self.embed(next_token)[:, None, None].to(h.dtype).expand(b, 1, c, -1)
        prev_emb = torch.cat([first, cand_emb[:, :-1]], dim=1)                        # (B, m, C', H)
        hidden = h[:, 1:, None].expand(b, m, c, h.shape[-1])                          # (B, m, C', H)
        scores = self.draft.selector.table(hidden, prev_emb, cand_emb, cand_logits)   # (B, m, C', C)
        chosen, picks = torch.zeros(b, 1, dtype=torch.long, device=cand.device), []   # position 0: any row
        for i in range(m):
            chosen = scores[:, i].gather(1, chosen[:, :, None].expand(b, 1, c))[:, 0].argmax(-1, keepdim=True)
            picks.append(chosen)
        return cand.gather(2, torch.stack(picks, 1))[..., 0]
