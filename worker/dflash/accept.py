"""Verify/accept: which of a verify step's tokens each row commits (pure tensor arithmetic).

One verify step fed [next_token, d_1..d_S] and sampled the target at the S + 1 positions after
next_token (`tokens`, with the baseline's position-keyed noise). Row r accepts the longest prefix
d_1..d_n equal to the target's own tokens; since those are equal, the committed tokens are always
the first m of `tokens`: the n accepted drafts, then the bonus token tokens[r, n] (the target's
token at the first mismatch, or after d_S), cut after the first terminal token and at the row's
remaining room, exactly where the baseline would stop. The commit itself is
DecodeBatch.commit (worker/model/generate.py).
"""

from __future__ import annotations

import torch


def accepted_prefix(proposals: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """proposals (B, S) long, tokens (B, S + 1) long -> n (B,) long in [0, S]: the length of the
    longest prefix where proposals equal the target's tokens."""
    return (proposals == tokens[:, :proposals.shape[1]]).long().cumprod(1).sum(1)


def commit_counts(tokens: torch.Tensor, accepted: torch.Tensor, terminal: torch.Tensor,
                  room: torch.Tensor) -> torch.Tensor:
    """-> m (B,) long: row r commits tokens[r, :m[r]];
    m = min(n + 1, index of the first terminal among tokens[:, :n + 1] + 1, room).

    tokens (B, S + 1) long: the target's tokens of the verify step
    accepted (B,) long: n, from accepted_prefix
    terminal (t,) long: ids that end a row (committed, nothing after them)
    room (B,) long: tokens the row may still generate (max_new - n_generated; >= 1 while it
        generates: finishing, done and padding rows get whatever this gives and commit nothing,
        see DecodeBatch.commit)"""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    is_term = torch.isin(tokens, terminal) & (positions <= accepted[:, None])
    upto_term = torch.where(is_term.any(1), is_term.long().argmax(1) + 1, tokens.shape[1])
    return torch.minimum(torch.minimum(accepted + 1, upto_term), room)
