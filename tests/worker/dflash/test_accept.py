"""Speculative accept -> commit on hand-made tensors: worker/dflash/accept.py, DecodeBatch.commit,
and the per-row / per-request counters of worker/dflash/metrics.py."""

import torch

from worker.dflash.accept import accepted_prefix, commit_counts
from worker.dflash.metrics import RowStats, SpecStats, row_stats
from worker.model.generate import DecodeBatch

T = lambda *rows: torch.tensor(rows, dtype=torch.long)      # noqa: E731  one row per argument
V = lambda *xs: torch.tensor(xs, dtype=torch.long)          # noqa: E731
TERM = V(99)
BIG = 1000


def test_accepted_prefix_all_none_and_partial():
    proposals = T([1, 2, 3], [1, 2, 3], [1, 2, 3], [5, 2, 3])
    tokens = T([1, 2, 3, 4], [1, 2, 7, 4], [1, 8, 3, 4], [1, 2, 3, 4])
    # row 1: a later match after a mismatch does not count; row 3: first draft wrong
    assert accepted_prefix(proposals, tokens).tolist() == [3, 2, 1, 0]


def test_commit_counts_all_accepted_takes_the_bonus_token():
    tokens = T([1, 2, 3, 4])
    assert commit_counts(tokens, V(3), TERM, V(BIG)).tolist() == [4]


def test_commit_counts_none_accepted_commits_the_target_token():
    tokens = T([7, 2, 3, 4])
    assert commit_counts(tokens, V(0), TERM, V(BIG)).tolist() == [1]


def test_commit_counts_stop_after_a_terminal_token():
    tokens = T([1, 99, 3, 4],       # terminal among the accepted drafts: committed, nothing after it
               [1, 2, 99, 4],       # terminal is the bonus token
               [1, 2, 3, 99],       # terminal after the bonus token: not reached
               [99, 2, 99, 4])      # first terminal wins
    n = V(3, 2, 1, 3)
    assert commit_counts(tokens, n, TERM, V(BIG, BIG, BIG, BIG)).tolist() == [2, 3, 2, 1]
    assert commit_counts(tokens, n, V(98, 99), V(BIG, BIG, BIG, BIG)).tolist() == [2, 3, 2, 1]


def test_commit_counts_stop_at_max_new():
    tokens = T([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4])
    n = V(3, 3, 1)
    assert commit_counts(tokens, n, TERM, V(2, 1, 5)).tolist() == [2, 1, 2]
    # padding rows: max_new 1 with their one token recorded -> no room
    assert commit_counts(tokens, n, TERM, V(0, 0, 0)).tolist() == [0, 0, 0]


def batch(lengths, next_token, generated, n_generated, max_new, finishing, done):
    gen = torch.zeros(len(lengths), max(max_new), dtype=torch.long)
    for r, g in enumerate(generated):
        gen[r, :len(g)] = torch.tensor(g, dtype=torch.long)
    return DecodeBatch(cache=None, lengths=V(*lengths), next_token=V(*next_token),
                       rope_delta=torch.zeros(len(lengths), dtype=torch.long), params=None, banned=None,
                       terminal=TERM, max_new=V(*max_new), generated=gen, n_generated=V(*n_generated),
                       finishing=torch.tensor(finishing), done=torch.tensor(done))


def test_commit_speculative_rows():
    # rows: bonus after 1 accepted draft; terminal on an accepted draft (in the cache: done at once);
    # max_new on an accepted draft; finishing (its last token was fed: done); done; padding (done)
    b = batch(lengths=[10, 20, 30, 40, 50, 5], next_token=[5, 6, 7, 99, 0, 0],
              generated=[[5], [6], [6, 7], [1, 99], [1], [0]], n_generated=[1, 1, 2, 2, 1, 1],
              max_new=[8, 8, 4, 8, 8, 1], finishing=[False, False, False, True, False, True],
              done=[False, False, False, False, True, True])
    tokens = T([11, 12, 13, 14], [21, 99, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44], [51, 52, 53, 54],
               [61, 62, 63, 64])
    n = V(1, 3, 3, 3, 3, 0)
    m = commit_counts(tokens, n, b.terminal, b.max_new - b.n_generated)
    assert m.tolist() == [2, 2, 2, 4, 4, 0]      # the last three are ignored by commit
    b.commit(tokens, m, n)
    assert b.steps == 1
    assert b.n_generated.tolist() == [3, 3, 4, 2, 1, 1]
    assert b.generated[:3, :4].tolist() == [[5, 11, 12, 0], [6, 21, 99, 0], [6, 7, 31, 32]]
    assert b.generated[3:].tolist() == [[1, 99, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [0] * 8]
    # K/V: next_token + committed accepted drafts; finishing rows +1 (last token fed); done rows frozen
    assert b.lengths.tolist() == [12, 23, 33, 41, 50, 5]
    assert b.next_token.tolist() == [12, 6, 7, 99, 0, 0]       # only the bonus row gets a new one
    assert b.done.tolist() == [False, True, True, True, True, True]
    assert b.finishing.tolist() == [False, False, False, True, False, True]


def test_commit_bonus_token_that_ends_the_row_is_finishing():
    b = batch(lengths=[10, 10], next_token=[5, 5], generated=[[5], [5]], n_generated=[1, 1], max_new=[8, 3],
              finishing=[False, False], done=[False, False])
    tokens = T([1, 99, 3], [1, 2, 3])
    n = V(1, 2)
    m = commit_counts(tokens, n, b.terminal, b.max_new - b.n_generated)
    assert m.tolist() == [2, 2]
    b.commit(tokens, m, n)
    assert b.lengths.tolist() == [12, 13]                     # row 1 ends on an accepted draft: in cache
    assert b.next_token.tolist() == [99, 5]
    assert b.finishing.tolist() == [True, False] and b.done.tolist() == [False, True]
    b.commit(T([0, 0, 0], [0, 0, 0]), V(1, 1), V(0, 0))       # the flush step
    assert b.lengths.tolist() == [13, 13] and b.done.tolist() == [True, True]
    assert b.n_generated.tolist() == [3, 3]


def test_commit_one_token_is_the_baseline_step():
    b = batch(lengths=[10, 10, 10], next_token=[5, 6, 7], generated=[[5], [6], [7]], n_generated=[1, 1, 1],
              max_new=[4, 2, 4], finishing=[False, False, True], done=[False, False, False])
    b.commit(T([8], [9], [10]), torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert b.lengths.tolist() == [11, 11, 11]
    assert b.generated.tolist() == [[5, 8, 0, 0], [6, 9, 0, 0], [7, 0, 0, 0]]
    assert b.next_token.tolist() == [8, 9, 7]
    assert b.finishing.tolist() == [False, True, True]         # row 1 reached max_new
    assert b.done.tolist() == [False, False, True]
    assert b.generating.tolist() == [True, False, False]


def test_row_stats_count_generating_steps_only():
    generating = [torch.tensor([True, True, False]), torch.tensor([True, False, False])]
    accepted = [V(3, 7, 5), V(0, 2, 5)]
    rows = row_stats(generating, accepted, 3, 7)
    assert rows == [RowStats([3, 0], [7, 7]), RowStats([7], [7]), RowStats([], [])]
    assert row_stats([], [], 2, 7) == [RowStats([], []), RowStats([], [])]
    s = SpecStats.merge(7, rows)
    assert (s.per_step_accepted, s.steps, s.accepted, s.drafted) == ([3, 0, 7], 3, 10, 21)
