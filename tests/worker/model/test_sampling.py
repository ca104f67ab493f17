"""Position-keyed sampling (worker/model/sampling.py) at the edge of its noise."""

import torch

from worker.model.sampling import SamplingParams, sample, sample_key, uniform

KEY = sample_key(0, 0)
POSITION = 6520          # for KEY, vocab id 26's 24 noise bits are all ones (found by search)


def test_uniform_stays_below_one_where_its_bits_are_all_ones():
    u = uniform(torch.tensor([KEY]), torch.tensor([[POSITION]]), 64)
    assert float(u.max()) < 1.0


def test_sample_never_draws_a_banned_id():
    logits = torch.full((1, 1, 64), float("-inf"))
    logits[0, 0, :3] = torch.tensor([2.0, 1.0, 0.5])          # ids 3.. banned, 26 among them
    params = SamplingParams(torch.tensor([KEY]), torch.tensor([0.6]), torch.tensor([0.98]), torch.tensor([0]))
    assert int(sample(logits, params, torch.tensor([[POSITION]]))[0, 0]) in (0, 1, 2)
