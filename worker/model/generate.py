"""Batched reasoning decode over the static cache: the state every decoding loop shares with its
one commit step, the interface of a speculative decoder, and the baseline loop (one token per
step). DFlash2 (worker/dflash/loop.py) implements Speculator on the same state.

Row bookkeeping (R rows = scenes x samples):
  lengths[r]     tokens of row r whose K/V are in the cache (prompt + fed generated tokens)
  next_token[r]  the newest sampled token, not yet in the cache
  generated      (R, cache capacity) sampled tokens; n_generated[r] of them valid (one width
                 per cache, so a graphed step's buffers fit every batch over it)
A row *finishes* when it samples a terminal token or reaches its max_new; its last token is
then still fed once so that its K/V is in the cache (the expert attends up to and including
`<|traj_future_start|>`), after which the row is done and frozen.
Every loop step is: one forward over each row's next_token (plus drafts, when speculating), the
target's tokens at the positions after it, then DecodeBatch.commit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Protocol

import torch

from worker.model.decoder import StaticKVCache, TextDecoder
from worker.model.graphs import GraphCache
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
    generated: torch.Tensor      # (R, cache.capacity) long
    n_generated: torch.Tensor    # (R,) long
    finishing: torch.Tensor      # (R,) bool: last token sampled, K/V not yet written
    done: torch.Tensor           # (R,) bool
    steps: int = 0               # forward passes run by the loop (one commit each)
    in_graph: bool = False       # a copy being captured by run_step: no host reads

    def context_len(self, fed: int) -> int:
        """Keys a forward feeding `fed` tokens per row attends (a host int, TextDecoder.forward);
        in a graph the persistent cache's capacity, which the graphed decoder step uses anyway."""
        return self.cache.capacity if self.in_graph else int(self.lengths.max()) + fed

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    @property
    def generating(self) -> torch.Tensor:
        """(R,) bool: rows still sampling new tokens (neither finishing nor done)."""
        return ~self.done & ~self.finishing

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(self.banned, float("-inf"))

    def commit(self, tokens: torch.Tensor, m: torch.Tensor, accepted: torch.Tensor) -> None:
        """Advance every row after one forward that fed its next_token at position lengths (and,
        when speculating, drafts after it).

        tokens (R, T) long: the target's tokens at positions lengths+1 .. lengths+T
        m (R,) long: a generating row r commits tokens[r, :m[r]] (m >= 1; the baseline's m is 1);
            finishing and done rows commit nothing whatever m says
        accepted (R,) long: how many of those tokens were fed in this forward as accepted drafts,
            their K/V written (0 for the baseline)
        A finishing row had its last token fed: done. A generating row's cache grows by its fed
        next_token and its committed accepted drafts; if it committed no more than those, its
        last token is already in the cache and it is done; otherwise the last committed token
        (the bonus token) is its next_token, finishing if terminal or at max_new."""
        self.steps += 1
        active = ~self.done
        flushed = active & self.finishing
        generating = active & ~self.finishing
        m = torch.where(generating, m, 0)
        self._record(tokens, m)
        in_cache = generating & (m <= accepted)
        bonus = generating & ~in_cache
        self.lengths += torch.where(active, 1 + torch.minimum(m, accepted), 0)
        self.done |= flushed | in_cache
        self._feed_next(bonus, tokens.gather(1, (m - 1).clamp(min=0)[:, None])[:, 0])

    def _record(self, tokens: torch.Tensor, m: torch.Tensor) -> None:
        """Write tokens (R, T)[r, :m[r]] after row r's generated tokens, in one scatter (one per
        token before: ~40 of a verify step's ~150 small kernels). A row never reaches the buffer's
        last column (its width, the cache's capacity, exceeds prompt + max_new + a block), so the
        columns written are distinct; the clamp only keeps the unwritten ones in range."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        idx = (self.n_generated[:, None] + offsets).clamp(max=self.generated.shape[1] - 1)     # (R, T)
        keep = offsets < m[:, None]
        self.generated.scatter_(1, idx, torch.where(keep, tokens, self.generated.gather(1, idx)))
        self.n_generated += m

    def _feed_next(self, rows: torch.Tensor, token: torch.Tensor) -> None:
        """token (R,) becomes next_token of `rows` (R,) bool; a terminal token or max_new finishes the row."""
        self.next_token = torch.where(rows, token, self.next_token)
        self.finishing |= rows & (torch.isin(token, self.terminal) | (self.n_generated >= self.max_new))


STATE = ("lengths", "next_token", "generated", "n_generated", "finishing", "done")   # what commit changes
_PARAMS = tuple(f.name for f in fields(SamplingParams) if f.name != "all_greedy")    # its tensors, in order


def run_step(decoder: TextDecoder, batch: DecodeBatch, name: str,
             step: Callable[..., tuple[torch.Tensor, ...]], *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One loop step: step(batch, *extra) runs the forward(s), samples and commits, -> its extra
    outputs (extra: more input tensors, e.g. a verify step's drafts).

    Over the persistent cache with graphs on, the whole step is one CUDA graph per (name, rows,
    widths, greedy): its eager sampling, acceptance and commit ops cost the host about what the
    forward does on a small model (docs/benchmarks.md, the demo checkpoint's K=1 batch). After a
    replay the batch holds the graph's own buffers (its state, which the graph advances in place,
    and its constants), so the next step of the same key copies in only the next token: copying
    all ~14 inputs cost the H200's host ~0.17 ms between two steps, time the GPU sat idle
    (torch.profiler, 2026-12-03). The batch's tensors are then valid until that key runs for
    another batch; the extra outputs are graph buffers (consume them before the next call)."""
    graphs = decoder.graphs
    if batch.cache is not decoder.persistent or graphs is None or not graphs.enabled:
        return step(batch, *extra)
    greedy = batch.params.greedy_only()                  # read before capture (a host sync)
    params = tuple(getattr(batch.params, f) for f in _PARAMS)
    inputs = tuple(getattr(batch, f) for f in STATE) + params + (batch.rope_delta, batch.banned, batch.terminal,
                                                                 batch.max_new) + extra
    own = len(inputs) - len(extra)

    def captured(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state, rest = t[:len(STATE)], t[len(STATE):own]
        b = DecodeBatch(batch.cache, **dict(zip(STATE, state)),
                        params=SamplingParams(*rest[:len(params)], all_greedy=greedy),
                        rope_delta=rest[-4], banned=rest[-3], terminal=rest[-2], max_new=rest[-1],
                        in_graph=True)
        outputs = step(b, *t[own:])
        return tuple(getattr(b, f) for f in STATE) + tuple(outputs)

    key = (name, batch.rows, batch.generated.shape[1], batch.terminal.shape[0], greedy)
    out = graphs.run(key, captured, *inputs)
    static = graphs.static_inputs(key)
    if static is None or out[0] is not static[0]:        # ran plainly, inside another capture
        for f, t in zip(STATE, out):
            getattr(batch, f).copy_(t)
    else:
        n, p = len(STATE), len(params)
        for f, t in zip(STATE, out):
            setattr(batch, f, t)
        batch.params = SamplingParams(*static[n:n + p], all_greedy=greedy)
        batch.rope_delta, batch.banned, batch.terminal, batch.max_new = static[n + p:own]
    batch.steps += 1
    return out[len(STATE):]


class Speculator(Protocol):
    """What the model runtime (worker/model/runtime.py) needs of a speculative decoder; DFlash2's
    is worker/dflash/loop.py."""

    block_size: int                         # tokens fed per verify step: the cache headroom it needs
    target_layer_ids: tuple[int, ...]       # target layers whose hidden states the prefill captures

    def begin(self, rows: int, capacity: int, persistent: bool = False, graphs: GraphCache | None = None) -> None:
        """Size the speculator's own caches for a batch of `rows` x `capacity` positions."""

    def load_context(self, rows: slice, hidden: dict[int, torch.Tensor], rope_deltas: list[int], per: int = 1) -> None:
        """A prefill pass's G prompts' hidden states {layer: (G, P, H)} become the context of
        `rows`: prompt j's per samples are rows rows.start + j * per .. + per - 1 (rope_deltas[j]
        its rotary offset)."""

    def decode(self, decoder: TextDecoder, batch: DecodeBatch, group: object = None
               ) -> tuple[DecodeBatch, Callable[[], list[Any]]]:
        """Decode every row to done; -> (batch, stats): stats() gives one per-row stats object per
        row and may wait for the device (the runtime calls it once the expert is launched). group:
        the batch's (task, K), for speculators that learn acceptance per group."""

    def calibrate(self, decoder: TextDecoder, cache: StaticKVCache, rows_buckets: list[int], context: int,
                  banned: torch.Tensor) -> None:
        """Measure step costs per rows bucket over `cache` at `context` live positions (warm-up)."""

    def merge_stats(self, rows: list[Any]) -> Any:
        """The per-row stats of one request's K samples -> its per-request stats (SceneResult.speculative)."""


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
        generated=torch.zeros(r, cache.capacity, dtype=torch.long, device=dev),
        n_generated=torch.zeros(r, dtype=torch.long, device=dev),
        finishing=torch.zeros(r, dtype=torch.bool, device=dev),
        done=torch.zeros(r, dtype=torch.bool, device=dev),
    )
    batch._record(first[:, None], torch.ones_like(first))
    batch._feed_next(torch.ones(r, dtype=torch.bool, device=dev), first)
    if real_rows is not None and real_rows < r:
        batch.done[real_rows:] = True
    return batch


@torch.inference_mode()
def baseline_decode(decoder: TextDecoder, batch: DecodeBatch) -> DecodeBatch:
    """One token per step until every row is done."""
    def step(b: DecodeBatch) -> tuple[()]:
        out = decoder.step(b.next_token[:, None], b.lengths, b.rope_delta, b.cache, context_len=b.context_len(1))
        tokens = sample(b.mask_logits(out.logits), b.params, b.lengths[:, None] + 1)   # (R, 1)
        b.commit(tokens, torch.ones_like(b.lengths), torch.zeros_like(b.lengths))
        return ()

    while not bool(batch.done.all()):
        run_step(decoder, batch, "baseline", step)
    return batch
