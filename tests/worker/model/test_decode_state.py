"""The decode loop's per-step bookkeeping (worker/model/generate.py): what it writes, and how few
device operations it takes (each one a kernel of every verify step's graph on the GPU)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.model.generate import DecodeBatch


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def batch(rows=5, width=40):
    g = torch.Generator().manual_seed(0)
    n = torch.randint(0, 20, (rows,), generator=g)
    gen = torch.randint(0, 1000, (rows, width), generator=g)
    return DecodeBatch(cache=None, lengths=n.clone(), next_token=torch.zeros(rows, dtype=torch.long),
                       rope_delta=torch.zeros(rows, dtype=torch.long), params=None, banned=None, terminal=None,
                       max_new=torch.full((rows,), 30), generated=gen, n_generated=n,
                       finishing=torch.zeros(rows, dtype=torch.bool), done=torch.zeros(rows, dtype=torch.bool))


def test_record_writes_each_rows_committed_tokens_after_its_own_and_nothing_else():
    b = batch()
    before, n0 = b.generated.clone(), b.n_generated.clone()
    tokens = torch.arange(5 * 8).view(5, 8) + 5000
    m = torch.tensor([1, 8, 0, 3, 5])
    ops = Ops()
    with ops:
        b._record(tokens, m)
    want = before.clone()
    for r in range(5):
        want[r, n0[r]:n0[r] + m[r]] = tokens[r, :m[r]]
    assert torch.equal(b.generated, want) and torch.equal(b.n_generated, n0 + m)
    # one gather and one scatter for the whole block: the per-token loop took 5 operations a token
    assert len(ops.names) <= 10, ops.names
