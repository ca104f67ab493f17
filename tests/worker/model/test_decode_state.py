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


def test_after_a_replay_the_batch_holds_the_graphs_buffers_and_only_the_next_token_is_copied_in():
    """A decoding step's graph copied ~14 inputs in (and the state back out) every step, ~0.17 ms
    of the H200 host's time between two steps; the batch now adopts the graph's buffers, so a
    step of the same key copies in only the token the last one sampled. Same tokens as plain steps."""
    from types import SimpleNamespace

    from tests.worker.graph_replay import ReplayingGraphs
    from worker.model.generate import run_step
    from worker.model.sampling import SamplingParams

    def new_batch():
        b = batch(rows=3)
        b.generated.zero_()
        b.n_generated.zero_()
        b.max_new.fill_(9)
        b.params = SamplingParams(torch.arange(3), torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.long))
        b.banned, b.terminal = torch.zeros(50, dtype=torch.bool), torch.tensor([49])
        return b

    def step(b):                                     # "samples" next_token + 1, then commits it
        tokens = (b.next_token + 1)[:, None] % 40
        b.commit(tokens, torch.ones_like(b.lengths), torch.zeros_like(b.lengths))
        return (tokens[:, 0] * 2,)

    plain, graphed = new_batch(), new_batch()
    plain_decoder = SimpleNamespace(graphs=None, persistent=plain.cache)
    graphs = ReplayingGraphs()
    decoder = SimpleNamespace(graphs=graphs, persistent=graphed.cache)
    copies = []
    for i in range(4):
        want = run_step(plain_decoder, plain, "toy", step)
        ops = Ops()
        with ops:
            got = run_step(decoder, graphed, "toy", step)
        copies.append(ops.names[:ops.names.index("aten.add")].count("aten.copy_"))   # before the replay's first op
        assert torch.equal(got[0], want[0])
        for f in ("lengths", "next_token", "generated", "n_generated", "finishing", "done"):
            assert torch.equal(getattr(graphed, f), getattr(plain, f)), f
    assert copies[0] == 14 and copies[1:] == [1, 1, 1], copies
    assert graphed.lengths is graphs.static_inputs(next(iter(graphs._graphs)))[0]
