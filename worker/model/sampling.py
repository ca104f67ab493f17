"""Sampling with counter-based randomness: the noise for a token depends only on
(seed, sample index, absolute position, vocab id), never on batch composition or step count.

Consequences we rely on:
  * same seed + same inputs -> same outputs, whatever the batch-mates;
  * DFlash2 verification samples the target at each of the 8 block positions with exactly the
    noise the baseline would use at those positions, then accepts while sample == proposal.
    Every committed token is therefore the baseline's own sample (lossless in distribution,
    and identical token for token when logits are equal).

Sampling itself is the exponential race: argmax(p / E), E ~ Exp(1), which draws from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MASK24 = (1 << 24) - 1
_U_MAX = 1.0 - 2.0 ** -24    # the largest float32 below 1


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def uniform(key: torch.Tensor, position: torch.Tensor, n: int, stream: int = 0) -> torch.Tensor:
    """Uniform (0, 1) noise. key (B,) int64, position (B, T) int64 -> (B, T, n) float32.

    Open at 1: the top 24-bit value plus 1/2 rounds to 1.0 in float32 (one draw in 2**24), and
    1.0 would make the exponential race's -log(u) zero, so it is clamped to the float below 1."""
    base = splitmix64(splitmix64(key[:, None] * 4 + stream) + position)            # (B, T)
    z = splitmix64(base[..., None] + torch.arange(n, device=key.device, dtype=torch.long))
    return (((_srl(z, 40) & _MASK24).float() + 0.5) * (1.0 / (1 << 24))).clamp(max=_U_MAX)


def normal(key: torch.Tensor, shape: tuple[int, ...], stream: int = 1) -> torch.Tensor:
    """Standard normal noise (Box-Muller). key (B,) -> (B, *shape) float32, one stream per key."""
    n = 1
    for s in shape:
        n *= s
    pos = torch.zeros(key.shape[0], 1, dtype=torch.long, device=key.device)
    u = uniform(key, pos, 2 * n, stream=stream)[:, 0]
    u1, u2 = u[:, :n], u[:, n:]
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)
    return z.view(key.shape[0], *shape)


def sample_key(seed: int, sample_index: int) -> int:
    """One int64 key per (request seed, sample index)."""
    x = torch.tensor([(seed * 1_000_003 + sample_index) % (1 << 63)], dtype=torch.long)
    return int(splitmix64(x)[0])


@dataclass
class SamplingParams:
    """Per-row sampling parameters as device tensors (B,)."""

    key: torch.Tensor            # int64
    temperature: torch.Tensor    # float32; 0 -> greedy
    top_p: torch.Tensor          # float32 in (0, 1]
    top_k: torch.Tensor          # int64; 0 -> off
    all_greedy: bool | None = None   # every row greedy (read from `temperature` once, on first use)

    def select(self, rows: torch.Tensor) -> "SamplingParams":
        return SamplingParams(self.key[rows], self.temperature[rows], self.top_p[rows], self.top_k[rows])

    def greedy_only(self) -> bool:
        if self.all_greedy is None:
            self.all_greedy = bool((self.temperature <= 0).all())
        return self.all_greedy


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (B, T, V) fp32 (banned ids already -inf) -> probabilities after temperature,
    top-k and top-p (rows with temperature 0 get a one-hot argmax)."""
    b, t, v = logits.shape
    temp = params.temperature.view(b, 1, 1)
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=logits.device).view(1, 1, v)
    k = params.top_k.view(b, 1, 1)
    drop = (k > 0) & (ranks >= k)
    probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cum = probs_sorted.cumsum(-1) - probs_sorted          # mass strictly before each token
    drop = drop | (cum >= params.top_p.view(b, 1, 1))
    drop[..., 0] = False
    probs_sorted = probs_sorted.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs_sorted).scatter_(-1, order, probs_sorted)
    probs = probs / probs.sum(-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, onehot, probs)


def sample(logits: torch.Tensor, params: SamplingParams, position: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), position (B, T) absolute positions of the tokens being chosen -> (B, T).

    Greedy rows take argmax; others the exponential race with position-keyed noise. A batch of
    greedy rows only skips the filtering and the noise (a sort of every row's vocabulary).
    """
    if params.greedy_only():
        return logits.argmax(-1)
    probs = filtered_probs(logits, params)
    u = uniform(params.key, position, logits.shape[-1])
    race = probs / (-torch.log(u))
    chosen = race.argmax(-1)
    greedy = (params.temperature <= 0).view(-1, 1)
    return torch.where(greedy, logits.argmax(-1), chosen)
