"""Oracle proposals for benchmarks and tests.

Random weights make real acceptance meaningless, so the benchmark runs the real draft network
(its cost is real) but proposes a recorded reference continuation, each proposal replaced by a
wrong token with probability `error_rate`, chosen to hit a target mean acceptance length tau.
Errors are drawn with the counter-based noise, so runs are reproducible.
"""

from __future__ import annotations

import torch

from worker.dflash.proposer import Proposer
from worker.model.inputs import to_device
from worker.model.sampling import uniform


def error_rate_for_tau(tau: float, num_spec_tokens: int = 7) -> float:
    """Per-token error rate e with 1 + sum_{i=1..n} (1-e)^i = tau (bisection)."""
    if not 1.0 <= tau <= num_spec_tokens + 1:
        raise ValueError(f"tau must be in [1, {num_spec_tokens + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        e = (lo + hi) / 2
        t = 1 + sum((1 - e) ** i for i in range(1, num_spec_tokens + 1))
        lo, hi = (e, hi) if t > tau else (lo, e)
    return (lo + hi) / 2


def reference_rows(results) -> torch.Tensor:
    """SceneResults -> their generated tokens per row (scene-major, K per scene), zero-padded
    (R, longest + 8): the reference an oracle proposes from."""
    rows = [toks for r in results for toks in r.token_ids]
    ref = torch.zeros(len(rows), max(len(t) for t in rows) + 8, dtype=torch.long)
    for i, t in enumerate(rows):
        ref[i, :len(t)] = torch.tensor(t)
    return ref


class OracleProposer:
    def __init__(self, inner: Proposer, reference: torch.Tensor, error_rate: float, seed: int = 0):
        """reference (R, L) long: each row's recorded generated tokens (padded)."""
        self.inner = inner
        self.reference = reference
        self.error_rate = error_rate
        self.seed = seed
        self.block_size = inner.block_size

    def __getattr__(self, name):          # begin, write_context, ... go to the real proposer
        return getattr(self.inner, name)

    @property
    def graphs(self):                     # set by the speculator's `begin`: the real proposer's graphs
        return self.inner.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.inner.graphs = graphs

    def prepare(self, batch) -> None:
        """Put the reference, error rate and seed where the graphed loop steps read them: device
        buffers kept on the real proposer (the reference's: batch rows x the draft cache's
        capacity), shared by every oracle over it, so a step captured for one oracle replays with
        the next one's."""
        k = self.inner.k[0] if self.inner.k else None
        rows = max(batch.rows, k.shape[0] if k is not None else 0)
        width = max(k.shape[2] if k is not None else 0, self.reference.shape[1])
        buf = getattr(self.inner, "oracle_reference", None)
        if buf is None or buf.shape[0] < rows or buf.shape[1] < width or buf.device != batch.lengths.device:
            if buf is not None and self.inner.graphs is not None:
                self.inner.graphs.clear()          # steps captured over the old buffer
            buf = self.inner.oracle_reference = torch.zeros(rows, width, dtype=torch.long, device=batch.lengths.device)
            self.inner.oracle_vocab = torch.zeros((), dtype=torch.long, device=buf.device)
            self.inner.oracle_seed = torch.zeros((), dtype=torch.long, device=buf.device)
            self.inner.oracle_error_rate = torch.zeros((), dtype=torch.float32, device=buf.device)
        buf.zero_()
        ref = self.reference[:rows]
        buf[:ref.shape[0], :ref.shape[1]] = to_device(ref, buf.device)     # no wait for the prefill before it
        self.inner.oracle_vocab.fill_(max(int(self.reference.max()) + 2, 2))
        self.inner.oracle_seed.fill_(self.seed)
        self.inner.oracle_error_rate.fill_(self.error_rate)

    def reference_tokens(self, n_generated: torch.Tensor, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (want, idx) (rows, n): the reference's next n tokens of each row and their columns
        (rows padded to a graph bucket read zeros)."""
        ref = self.inner.oracle_reference[:rows]
        idx = (n_generated[:, None] + torch.arange(n, device=ref.device)).clamp(max=ref.shape[1] - 1)
        return ref.gather(1, idx), idx

    def propose(self, batch) -> torch.Tensor:
        """The real draft pass (its cost is real), then the reference's tokens with errors in its
        place: a graph of their own over the persistent caches, as the draft pass is, so that the
        oracle's ~25 small operations are not measured as host launches the real proposer has not."""
        real = self.inner.propose(batch)                                   # pay the draft's cost
        if self.inner.graphed:
            return self.inner.graphs.run(("oracle", real.shape[0]), self._replace, real, batch.n_generated)
        return self._replace(real, batch.n_generated)

    def _replace(self, real: torch.Tensor, n_generated: torch.Tensor) -> torch.Tensor:
        want, idx = self.reference_tokens(n_generated, real.shape[0], real.shape[1])
        key = self.inner.oracle_seed + torch.arange(real.shape[0], device=real.device)
        u = uniform(key, idx, 1, stream=3)[..., 0]
        wrong = (want + 1 + (u * 97).long()) % self.inner.oracle_vocab
        return torch.where(u < self.inner.oracle_error_rate, wrong, want)


class SelectorCeiling(OracleProposer):
    """The best any selector over the draft's top-C could do: the real draft pass and selector
    run (their cost is real), then wherever the reference's next tokens are all among the
    candidates, those are proposed instead. Its acceptance over a head with the selector zeroed
    bounds the selector gain (`report.measure_bars`, `selector_gain_ceiling`)."""

    def __init__(self, inner: Proposer, reference: torch.Tensor):
        super().__init__(inner, reference, error_rate=0.0)

    def propose(self, batch) -> torch.Tensor:
        inner = self.inner
        cap = inner.k[0].shape[2] if inner.graphed else int(batch.lengths.max())
        h, cand_logits, cand = inner.candidates(batch.next_token, batch.lengths, batch.rope_delta, batch.banned, cap)
        chosen = inner.select(h, batch.next_token, cand_logits, cand)
        want, _ = self.reference_tokens(batch.n_generated, chosen.shape[0], chosen.shape[1])      # (B, 7)
        in_top = (cand == want[..., None]).any(-1).long().cumprod(1).bool()
        return torch.where(in_top, want, chosen)

