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
Per step the policy (worker/dflash/policy.py) picks 7 drafts, 3 drafts (verify over 4 tokens) or
none: a plain decode step, the baseline's own, when drafting is expected to commit fewer tokens
per second (low acceptance, large batches).
Greedy rows take argmax at each position, so acceptance is exact match; sampled rows accept
the proposal exactly when the target's own sample equals it. Either way every committed token is
the token the baseline would have produced at that position.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from worker.dflash.accept import accepted_prefix, commit_counts
from worker.dflash.draft import DraftModel
from worker.dflash.head import HeadConfig, check_head
from worker.dflash.metrics import RowStats, SpecStats, row_stats
from worker.dflash.policy import VERIFY_TOKENS, SpeculationPolicy, StepCosts
from worker.dflash.proposer import Proposer
from worker.model.decoder import TextDecoder
from worker.model.fp8 import Fp8Linear
from worker.model.generate import STATE, DecodeBatch, run_step, start_batch
from worker.model.inputs import to_host
from worker.model.sampling import SamplingParams, sample


class DFlash2Speculator:
    """The Speculator (worker/model/generate.py) of AlpamayoRuntime: trajectory requests decode
    through `decode`."""

    def __init__(self, draft: DraftModel, base_model, head_path: str | None = None):
        self.draft = draft
        self.config: HeadConfig = draft.config
        self.proposer = Proposer(draft, base_model.language_model.embed_tokens, base_model.lm_head)
        self._target_mlp = base_model.language_model.layers[0].mlp     # its products say the profile
        self._match_profile()
        self.target_layer_ids = tuple(self.config.target_layer_ids)
        self.block_size = self.config.block_size
        self.num_spec_tokens = self.config.num_spec_tokens
        self.head_path = head_path
        self.dtype = next(base_model.parameters()).dtype
        self.policy = SpeculationPolicy()

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
        self._match_profile()
        self.proposer.begin(rows, capacity, dev, self.dtype, persistent=persistent)

    def _match_profile(self) -> None:
        """fp8 proposals where the target's layers are fp8: at construction (a checkpoint loaded for
        an fp8 profile, before the memory plan) and at each batch (a model quantised afterwards)."""
        if isinstance(self._target_mlp.down_proj, Fp8Linear):
            self.proposer.use_fp8()

    def load_context(self, rows: slice, hidden: dict[int, torch.Tensor], rope_deltas: list[int], per: int = 1) -> None:
        """A prefill pass's G prompts' hidden states {layer: (G, P, H)} as the draft context of
        `rows` (prompt j's per samples at rows.start + j * per ...), written in one pass."""
        self.proposer.write_prompts(rows, hidden, rope_deltas, per)

    def merge_stats(self, rows: list[RowStats]) -> SpecStats:
        return SpecStats.merge(self.num_spec_tokens, rows)

    # ---------------------------------------------------------------- the loop
    @torch.inference_mode()
    def decode(self, decoder: TextDecoder, batch: DecodeBatch, group: object = None
               ) -> tuple[DecodeBatch, Callable[[], list[RowStats]]]:
        """Decode every row to done; each step verifies 3 or 7 drafts or is a plain decode step,
        as the policy (worker/dflash/policy.py) chooses from the rows' acceptance so far and the
        step costs of `calibrate`. group: the batch's (task, K), whose acceptance the policy keeps.
        -> (batch, stats): stats() gives the per-row stats and folds the batch's acceptance into
        its group's (both read the steps' logs from the device: call it once the next stage is
        launched, as the runtime does after the expert's)."""
        policy = self.policy
        costs = policy.costs_for(batch.rows)
        acceptance = policy.start(group, batch.rows, batch.lengths.device)
        self.proposer.prepare(batch)
        generating_log, accepted_log, drafted_log = [], [], []
        # the first block is drafted while the host reads the first head when the first step will
        # verify (as after each verify step below); proposals: the next verify step's drafts
        pending, generating = self._head(batch, acceptance)
        proposals = self.proposer.propose(batch) if policy.first_choice(costs, group) else None
        head = _read(pending)
        while not head[0]:
            n = policy.choose(costs, head[1], head[2:2 + len(policy.drafts)])
            if n == 0:
                self._decode_step(decoder, batch)
                accepted = torch.zeros_like(batch.lengths)
            else:
                accepted = self._verify_step(decoder, batch, n,
                                             self.proposer.propose(batch) if proposals is None else proposals)
            generating_log.append(generating)
            accepted_log.append(accepted)
            drafted_log.append(n)
            # the step's head goes to the host, then (after a verify step) the next step's block is
            # drafted: the host reads the head, chooses and launches the next step while the device
            # drafts, instead of the device idling through that turnaround (H200, 2026-12-03: a
            # 17-step reasoning 1.8 ms shorter); after a decode step the next one drafts first if it verifies
            pending, generating = self._head(batch, acceptance, (generating, accepted, n))
            proposals = self.proposer.propose(batch) if n else None
            head = _read(pending)
            acceptance.record(head, n)

        def stats() -> list[RowStats]:
            policy.finish(group, acceptance)
            return row_stats(generating_log, accepted_log, batch.rows, self.num_spec_tokens, drafted_log)
        return batch, stats

    def _head(self, batch: DecodeBatch, acceptance, last=None) -> tuple[tuple, torch.Tensor]:
        """What the policy reads before a step (`RowAcceptance.step`: the last step's acceptance
        observed), copied to the host without waiting (read it with `_read`), and the rows
        generating now."""
        head, generating = acceptance.step(batch.done, batch.finishing, self.policy.drafts, last)
        (head,), ready = to_host(head)
        return (head, ready), generating

    def _verify_step(self, decoder: TextDecoder, batch: DecodeBatch, n: int, proposals: torch.Tensor) -> torch.Tensor:
        """Verify [next_token, d1..dn] of proposals (B, >= n), accept, commit -> accepted drafts (R,)
        long. One CUDA graph per n and rows bucket over the persistent caches (generate.run_step);
        the drafting is the proposer's own graph, run before it."""
        def step(b: DecodeBatch, drafts: torch.Tensor) -> tuple[torch.Tensor]:
            drafts = drafts[:, :n]                                                           # (B, n)
            block = torch.cat([b.next_token[:, None], drafts], dim=1)                        # (B, n + 1)
            out = decoder.step(block, b.lengths, b.rope_delta, b.cache, context_len=b.context_len(n + 1),
                               capture=self.target_layer_ids)
            self.proposer.write_context(out.hidden, b.lengths, b.rope_delta)
            offsets = torch.arange(1, n + 2, device=b.lengths.device)                        # sampled positions
            tokens = sample(b.mask_logits(out.logits), b.params, b.lengths[:, None] + offsets)   # (B, n + 1)
            accepted = accepted_prefix(drafts, tokens)
            m = commit_counts(tokens, accepted, b.terminal, b.max_new - b.n_generated)
            b.commit(tokens, m, accepted)
            return (torch.minimum(accepted, m),)
        return run_step(decoder, batch, f"verify{n}", step, proposals)[0].clone()

    def _decode_step(self, decoder: TextDecoder, batch: DecodeBatch) -> None:
        """The baseline's step (generate.baseline_decode), its hidden states kept as draft context.
        Its forward is a graph but the step is not one whole graph like the verify step: on the
        H200 (32B shape, 2026-12-01) replaying that whole-step graph hit an illegal address, not
        yet understood (docs/benchmarks.md); the policy's warm-up times it as it runs."""
        out = decoder.step(batch.next_token[:, None], batch.lengths, batch.rope_delta, batch.cache,
                           context_len=batch.context_len(1), capture=self.target_layer_ids)
        self.proposer.write_context(out.hidden, batch.lengths, batch.rope_delta)
        tokens = sample(batch.mask_logits(out.logits), batch.params, batch.lengths[:, None] + 1)     # (B, 1)
        batch.commit(tokens, torch.ones_like(batch.lengths), torch.zeros_like(batch.lengths))

    # ---------------------------------------------------------------- warm-up
    @torch.inference_mode()
    def calibrate(self, decoder: TextDecoder, cache, rows_buckets: list[int], context: int, banned: torch.Tensor,
                  reps: int = 5) -> None:
        """Measure, per rows bucket, the seconds of a whole loop step for each choice (a decode
        step, verify of 3 or 7 drafts), and for reports of its parts (the decode(1) and verify(T)
        forwards, a draft pass), over `cache` (the persistent one: CUDA graphs are captured here,
        as later batches will replay them) at `context` live positions per row. Writes scratch K/V
        at positions context.. of the cache's and the draft's rows (no batch is live)."""
        dev = cache.k.device
        vocab = self.proposer.lm_head.out_features
        for rows in rows_buckets:
            lengths = torch.full((rows,), context, dtype=torch.long, device=dev)
            delta = torch.zeros(rows, dtype=torch.long, device=dev)
            params = SamplingParams(key=torch.arange(rows, device=dev), temperature=torch.zeros(rows, device=dev),
                                    top_p=torch.ones(rows, device=dev),
                                    top_k=torch.zeros(rows, dtype=torch.long, device=dev))
            probe = start_batch(cache, lengths, torch.zeros(rows, vocab, device=dev), delta, params, banned,
                                torch.tensor([-1], device=dev), torch.full((rows,), 8, device=dev))
            start = {f: getattr(probe, f).clone() for f in STATE}

            def restart():                       # every timed loop step starts from the same state
                for f, v in start.items():
                    getattr(probe, f).copy_(v)

            def forward(t: int):
                ids = torch.zeros(rows, t, dtype=torch.long, device=dev)
                out = decoder.step(ids, lengths, delta, cache, context_len=context + t,
                                   capture=self.target_layer_ids)
                self.proposer.write_context(out.hidden, lengths, delta)

            def loop_step(n: int):           # a verify step drafts its block first
                if n == 0:
                    return self._decode_step(decoder, probe)
                return self._verify_step(decoder, probe, n, self.proposer.propose(probe))
            self.policy.costs[rows] = StepCosts(
                loop={n: _seconds(lambda n=n: loop_step(n), reps, restart) for n in (0, *self.policy.drafts)},
                decode=_seconds(lambda: forward(1), reps),
                verify={t: _seconds(lambda t=t: forward(t), reps) for t in VERIFY_TOKENS},
                draft=_seconds(lambda: self.proposer.propose(probe), reps, restart))


def _seconds(fn, reps: int, setup=lambda: None) -> float:
    """Fastest of `reps` timed calls of fn() after one untimed call (which captures its CUDA
    graph), each after an untimed setup(): the least disturbed by other work on the machine."""
    setup()
    fn()
    times = []
    for _ in range(reps):
        setup()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _read(head: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[float]:
    values, ready = head
    if ready is not None:
        ready.synchronize()
    return values.tolist()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
