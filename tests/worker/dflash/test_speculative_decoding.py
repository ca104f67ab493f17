"""DFlash2: head checks, lossless batched verification, speculative metrics (CPU, fp32)."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.demo.layout import write_random_checkpoint
from worker.dflash.draft import write_random_head
from worker.dflash.head import HeadError, check_head
from worker.dflash.loop import DFlash2Speculator
from worker.dflash.metrics import speculative_block
from worker.dflash.oracle import OracleProposer, error_rate_for_tau
from worker.model.config import AlpamayoConfig
from worker.model.runtime import AlpamayoRuntime

from tests.worker.graph_replay import use_replaying_graphs
from tests.worker.test_bench_throughput import assert_expert_routing
from tests.worker.model.test_runtime import ExpertInputs, assert_same_expert_inputs, scene


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def head(ckpt, tmp_path_factory):
    return write_random_head(ckpt, tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def runtimes(ckpt, head):
    base = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    spec = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(head)))
    for r in (base, spec):
        r.trajectory_max_new = 24
    return base, spec


def test_random_head_is_lossless_and_counts(runtimes):
    base, spec = runtimes
    reqs = [scene(1, k=2, temperature=0.8, seed=3), scene(2, k=2, temperature=0.8, seed=4)]
    with ExpertInputs(base) as ea:
        a = base.run(reqs)
    with ExpertInputs(spec) as eb:
        b = spec.run(reqs)
    assert_same_expert_inputs(ea, eb)
    for x, y in zip(a, b):
        assert x.texts == y.texts
        assert x.speculative is None
        s = y.speculative
        assert s.num_spec_tokens == 7 and s.steps > 0
        assert all(d == 7 for d in s.per_step_drafted)


def oracle_run(spec, reqs, reference_runs, error_rate):
    """Run `reqs` on the spec runtime with proposals from the reference generations."""
    rows = [toks for res in reference_runs for toks in res]
    width = max(len(t) for t in rows) + 8
    ref = torch.zeros(len(rows), width, dtype=torch.long)
    for i, t in enumerate(rows):
        ref[i, :len(t)] = torch.tensor(t)
    inner = spec.speculator.proposer
    spec.speculator.proposer = OracleProposer(inner, ref, error_rate, seed=5)
    try:
        return spec.run(reqs)
    finally:
        spec.speculator.proposer = inner


@pytest.mark.parametrize("k,temperature", [(1, 0.0), (2, 0.7), (3, 0.7)])
def test_lossless_with_mixed_acceptance(runtimes, k, temperature):
    base, spec = runtimes
    reqs = [scene(i, k=k, temperature=temperature, seed=10 + i) for i in range(2)]
    with ExpertInputs(base) as ea:
        ref = base.run(reqs)
    toks = [r.token_ids for r in ref]
    with ExpertInputs(spec) as eb:
        got = oracle_run(spec, reqs, toks, error_rate=0.35)
    assert_same_expert_inputs(ea, eb)
    for x, y in zip(ref, got):
        assert x.token_ids == y.token_ids
        hist = np.bincount(y.speculative.per_step_accepted, minlength=8)
        assert hist[0] < y.speculative.steps          # some steps accepted drafts
    all_acc = [a for y in got for a in y.speculative.per_step_accepted]
    assert len(set(all_acc)) >= 3, all_acc            # ragged acceptance across rows and steps


def test_error_rate_for_tau():
    for tau in (2, 4, 6):
        e = error_rate_for_tau(tau)
        assert abs(1 + sum((1 - e) ** i for i in range(1, 8)) - tau) < 1e-6


# ---------------------------------------------------------------- head checks, one per refusal

@pytest.fixture
def base_cfg(ckpt):
    return AlpamayoConfig.from_dir(ckpt)


def copy_head(head, tmp_path):
    d = tmp_path / "h"
    shutil.copytree(head, d)
    return d


def edit_config(d, fn):
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


def test_head_ok(head, base_cfg):
    c = check_head(head, base_cfg)
    assert c.block_size == 8 and c.num_candidates == 16


def test_head_missing_dir(base_cfg, tmp_path):
    with pytest.raises(HeadError, match=f"NIM_ALPAMAYO_SPECULATIVE_MODEL={tmp_path / 'nope'} does not exist"):
        check_head(tmp_path / "nope", base_cfg)


def test_head_empty_dir(base_cfg, tmp_path):
    (tmp_path / "e").mkdir()
    with pytest.raises(HeadError, match=f"NIM_ALPAMAYO_SPECULATIVE_MODEL={tmp_path / 'e'} is empty"):
        check_head(tmp_path / "e", base_cfg)


def test_head_wrong_architecture(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    edit_config(d, lambda c: c.update(architectures=["DFlashDraftModel"]))
    with pytest.raises(HeadError, match=rf"NIM_ALPAMAYO_SPECULATIVE_MODEL={d} has architectures \['DFlashDraftModel'\]"):
        check_head(d, base_cfg)


def test_head_wrong_projector(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    edit_config(d, lambda c: c["dflash_config"].update(projector_type="linear"))
    with pytest.raises(HeadError, match=f"NIM_ALPAMAYO_SPECULATIVE_MODEL={d} has dflash_config.projector_type 'linear'"):
        check_head(d, base_cfg)


def test_head_block_size(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    edit_config(d, lambda c: c.update(block_size=16))
    with pytest.raises(HeadError, match=f"{d} has block_size 16, but 7 speculative tokens need block_size 8"):
        check_head(d, base_cfg)


def test_head_missing_metadata(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    (d / "alpamayo_dflash_metadata.json").unlink()
    with pytest.raises(HeadError, match=f"{d} has no alpamayo_dflash_metadata.json"):
        check_head(d, base_cfg)


def test_head_empty_hash(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    (d / "alpamayo_dflash_metadata.json").write_text(json.dumps({"base_model_config_sha256": ""}))
    with pytest.raises(HeadError, match=f"{d} has no base_model_config_sha256"):
        check_head(d, base_cfg)


def test_head_hash_mismatch(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    (d / "alpamayo_dflash_metadata.json").write_text(json.dumps({"base_model_config_sha256": "ab" * 32}))
    with pytest.raises(HeadError, match=f"{d} was trained for base config sha256 abababab"):
        check_head(d, base_cfg)


def test_head_truncated_shard(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    f = d / "model.safetensors"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:size - 100])
    with pytest.raises(HeadError, match=rf"^NIM_ALPAMAYO_SPECULATIVE_MODEL={d} has a truncated shard model.safetensors: "
                                        rf"expected {size} bytes, found {size - 100}$"):
        check_head(d, base_cfg)


def test_head_shape_mismatch(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    edit_config(d, lambda c: c.update(hidden_size=c["hidden_size"] * 2))
    with pytest.raises(HeadError, match=f"{d} has hidden_size"):
        check_head(d, base_cfg)


def test_head_missing_selector(head, base_cfg, tmp_path):
    d = copy_head(head, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.startswith("selector.")}
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(HeadError, match=f"{d} lacks the candidate selector"):
        check_head(d, base_cfg)


# ---------------------------------------------------------------- statistical losslessness

def chi2_two_sample(a: list[int], b: list[int]) -> tuple[float, float]:
    """Two-sample chi-square statistic over the categories seen, and its p=0.001 critical value
    (Wilson-Hilferty approximation)."""
    cats = sorted(set(a) | set(b))
    na, nb = len(a), len(b)
    stat = 0.0
    for c in cats:
        oa, ob = a.count(c), b.count(c)
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    dof = max(len(cats) - 1, 1)
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    return stat, crit


def test_sampled_distribution_matches_baseline(runtimes):
    """Independent noise (different seeds): DFlash2's sampled tokens cannot be told apart from the
    baseline's; a biased sampler (greedy) is told apart, so the test has power."""
    base, spec = runtimes
    n = 240
    k_req = scene(3, k=n, temperature=1.0, seed=1)
    k_req.top_k = 4
    base.trajectory_max_new = spec.trajectory_max_new = 4
    try:
        ref = base.run([k_req])[0]
        other = scene(3, k=n, temperature=1.0, seed=2)
        other.top_k = 4
        got = oracle_run(spec, [other], [ref.token_ids], error_rate=0.0)[0]
        greedy = scene(3, k=n, temperature=1.0, seed=3)
        greedy.top_k = 1
        biased = base.run([greedy])[0]
    finally:
        base.trajectory_max_new = spec.trajectory_max_new = 24
    acc = got.speculative.accepted
    assert 0 < acc < got.speculative.drafted       # proposals from other noise: some accepted, some not
    for j in (1, 2, 3):
        a = [t[j] for t in ref.token_ids if len(t) > j]
        b = [t[j] for t in got.token_ids if len(t) > j]
        stat, crit = chi2_two_sample(a, b)
        assert stat < crit, (j, stat, crit)
    a = [t[1] for t in ref.token_ids if len(t) > 1]
    c = [t[1] for t in biased.token_ids if len(t) > 1]
    stat, crit = chi2_two_sample(a, c)
    assert stat > crit


def test_speculative_block_arithmetic(runtimes):
    _, spec = runtimes
    res = spec.run([scene(4, k=3, temperature=0.8, seed=9)])[0]
    s = res.speculative
    for detailed in (False, True):
        b = speculative_block(s, detailed)
        assert b["num_spec_tokens"] == 7
        assert sum(b["acceptance_histogram"]) == b["num_spec_steps"] == s.steps
        assert sum(i * c for i, c in enumerate(b["acceptance_histogram"])) == b["num_accepted_draft_tokens"]
        assert b["num_draft_tokens"] == 7 * b["num_spec_steps"]
        assert b["draft_acceptance_rate"] == pytest.approx(b["num_accepted_draft_tokens"] / b["num_draft_tokens"])
        assert b["mean_acceptance_length"] == pytest.approx(1 + b["num_accepted_draft_tokens"] / b["num_spec_steps"])
        assert ("per_step_accepted" in b) == detailed
    assert len(b["per_step_accepted"]) == b["num_spec_steps"] == len(b["per_step_drafted"])
    # K = 3: steps of every sample, each sample took at least one verify step
    assert s.steps >= 3


def test_dflash_persistent_cache_path_is_lossless(ckpt, head, runtimes):
    """The CUDA-graph layout (persistent target and draft caches, padded row buckets, attention
    over the whole capacity), run eagerly on CPU, keeps DFlash2 lossless."""
    base, _ = runtimes
    spec = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(head)))
    spec.enable_graphs(max_rows=8, capacity=512)
    spec.trajectory_max_new = 24
    reqs = [scene(6, k=3, temperature=0.7, seed=2)]
    ref = base.run(reqs)[0]
    got = oracle_run(spec, reqs, [ref.token_ids], error_rate=0.3)[0]
    assert got.token_ids == ref.token_ids
    assert got.speculative.accepted > 0
    assert spec.speculator.proposer.persistent and spec.speculator.proposer.k[0].shape[0] == 8


def test_dflash_graphed_loop_steps_are_lossless(ckpt, head, runtimes):
    """Each DFlash2 verify step (verify, context write, sampling, acceptance, commit) is one graph
    over the persistent caches (generate.run_step) and its draft pass another, run ahead of it;
    replayed on the CPU over their captured buffers they commit the baseline's tokens, and the
    tokens and trajectories of the same loop run plainly, greedy and sampled."""
    base, _ = runtimes
    plain, graphed = (AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                                           speculator_factory=DFlash2Speculator.factory(str(head))) for _ in range(2))
    for r in (plain, graphed):
        r.enable_graphs(max_rows=8, capacity=512)
        r.trajectory_max_new = 24
    graphs = use_replaying_graphs(graphed)
    for reqs in ([scene(6, k=3, temperature=0.7, seed=2)], [scene(7, k=1), scene(8, k=1)]):
        ref = [r.token_ids for r in base.run(reqs)]
        a, b = (oracle_run(r, reqs, ref, error_rate=0.3) for r in (plain, graphed))
        assert [r.token_ids for r in a] == [r.token_ids for r in b] == ref
        assert all(np.array_equal(x.trajectories, y.trajectories) for x, y in zip(a, b))
        assert [r.speculative.per_step_accepted for r in a] == [r.speculative.per_step_accepted for r in b]
        assert sum(r.speculative.accepted for r in b) > 0
    # the verify forward runs inside the step's graph; the draft pass is a graph of its own, and so
    # is an oracle's choice (not measured as host launches the real proposer has not)
    assert {k[0] for k in graphs._graphs} == {"verify7", "draft", "oracle", "expert"}, list(graphs._graphs)


def test_the_next_block_is_drafted_before_the_host_reads_the_steps_head(ckpt, head, runtimes, monkeypatch):
    """The host reads each step's head (a sync), chooses and launches the next step; the device
    drafts the next step's block meanwhile (launched before the read), so it does not idle through
    that turnaround. Outputs stay the baseline's."""
    from worker.dflash import loop

    base, _ = runtimes
    rt = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                              speculator_factory=DFlash2Speculator.factory(str(head)))
    rt.trajectory_max_new = 24
    events = []
    read, verify = loop._read, DFlash2Speculator._verify_step
    monkeypatch.setattr(loop, "_read", lambda h: (events.append("read"), read(h))[1])
    monkeypatch.setattr(DFlash2Speculator, "_verify_step",
                        lambda self, *a: (events.append("verify"), verify(self, *a))[1])
    propose = rt.speculator.proposer.propose
    monkeypatch.setattr(rt.speculator.proposer, "propose", lambda b: (events.append("draft"), propose(b))[1])
    reqs = [scene(7, k=1), scene(8, k=1)]
    assert [r.token_ids for r in rt.run(reqs)] == [r.token_ids for r in base.run(reqs)]
    steps = "".join("v" if e == "verify" else "d" if e == "draft" else "r" for e in events)
    assert steps.startswith("drv") and steps.count("v") >= 2    # the first block too, then the first read
    assert "vdr" in steps and "vr" not in steps, steps          # after each verify step: draft, then read


def test_the_expert_is_launched_before_the_loops_stats_are_read(ckpt, head, runtimes, monkeypatch):
    """The loop's per-row stats and the group's acceptance are read from the device (a wait for
    it) only after the expert's diffusion is launched, so the device goes from the last step
    straight on to the expert; the stats are the same."""
    from worker.dflash import loop
    from worker.model.expert import ActionExpert

    base, _ = runtimes
    rt = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                              speculator_factory=DFlash2Speculator.factory(str(head)))
    rt.trajectory_max_new = 24
    reqs = [scene(7, k=1), scene(8, k=1)]
    ref = [r.token_ids for r in base.run(reqs)]
    first = oracle_run(rt, reqs, ref, error_rate=0.3)
    events = []
    sample, finish = ActionExpert.sample, rt.speculator.policy.finish
    monkeypatch.setattr(ActionExpert, "sample", lambda self, *a, **kw: (events.append("expert"), sample(self, *a, **kw))[1])
    monkeypatch.setattr(rt.speculator.policy, "finish", lambda *a: (events.append("stats"), finish(*a))[1])
    monkeypatch.setattr(loop, "row_stats", lambda *a, f=loop.row_stats: (events.append("stats"), f(*a))[1])
    again = oracle_run(rt, reqs, ref, error_rate=0.3)
    assert events == ["expert", "stats", "stats"], events
    assert [r.speculative for r in again] == [r.speculative for r in first]
    assert [r.token_ids for r in again] == ref


def test_an_oracle_proposes_from_the_shared_buffers_its_prepare_fills():
    """The benchmarks sweep oracles of several error rates over one runtime, and a verify step
    graph captured for the first replays for the next: so propose must read the reference, error
    rate and seed from the device buffers prepare() fills, not from the oracle's own attributes
    (a captured graph keeps those as constants)."""
    from types import SimpleNamespace

    class Draft:                          # the real draft pass is not what this checks
        block_size, k, graphs, graphed = 8, [torch.zeros(2, 1, 64, 4)], None, False

        def propose(self, batch):
            return torch.zeros(batch.rows, 7, dtype=torch.long)

    ref = torch.arange(1, 41).view(2, 20)
    batch = SimpleNamespace(rows=2, lengths=torch.tensor([5, 5]), n_generated=torch.tensor([0, 3]))
    draft = Draft()
    right, wrong = OracleProposer(draft, ref, error_rate=0.0, seed=1), OracleProposer(draft, ref, error_rate=1.0, seed=2)
    right.prepare(batch)
    want = torch.stack([ref[0, 0:7], ref[1, 3:10]])
    assert torch.equal(right.propose(batch), want)
    assert torch.equal(wrong.propose(batch), want)             # the buffers say error rate 0
    wrong.prepare(batch)
    assert not (right.propose(batch) == want).any()            # now they say 1



def test_a_batch_makes_no_device_tensor_from_host_values(runtimes, monkeypatch):
    """In a warm runtime's batch, the worker's code brings host values to the device only through
    `inputs.to_device` (pinned, non-blocking on CUDA): `torch.tensor(list, device=gpu)`
    copies pageable memory and waits for the GPU, which in `load_context` meant waiting for
    every scene's whole prefill before the next could be queued (the sync debug mode's finding);
    nor does it index a device tensor with a Python list (copied to the device the same way: the
    policy's choice did so every step). (The CPU path's transformers cache and vision utilities are not the GPU path's, hence only
    worker/ callers.)"""
    import sys

    _, spec = runtimes
    made_on_device = []
    tensor = torch.tensor

    def recording(data, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if kwargs.get("device") is not None and "/worker/" in caller:
            made_on_device.append((caller, sys._getframe(1).f_lineno))
        return tensor(data, *args, **kwargs)

    class ListIndices(torch.overrides.TorchFunctionMode):   # a list index is copied to the device too
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__:
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                caller = sys._getframe(1).f_code.co_filename
                if "/worker/" in caller and any(isinstance(i, list) for i in index):
                    made_on_device.append((caller, sys._getframe(1).f_lineno))
            return func(*args, **(kwargs or {}))

    spec.run([scene(7, k=2, temperature=0.8, seed=7)])             # warm: per-device constants made
    prepared = spec.prepare([scene(5, k=2, temperature=0.8, seed=5), scene(6, k=2, temperature=0.8, seed=6)])
    monkeypatch.setattr(torch, "tensor", recording)
    with ListIndices():
        results = spec.run(prepared)
    monkeypatch.undo()
    assert all(r.error is None for r in results) and results[0].speculative.steps > 0
    assert made_on_device == []


def test_a_prefill_pass_writes_its_prompts_draft_context_in_one_pass(runtimes, monkeypatch):
    """A prefill pass's G prompts become the draft's context in one projection (a small model's
    scenes each paid the projections' and writes' launches: 0.8 ms of host time a demo scene on
    the H200; queued and packed per batch, 1.4 ms a pass of host time to pack): each prompt's
    samples hold its own projection at positions 0..P-1 with its rotary offset, the rows outside
    the pass nothing."""
    _, spec = runtimes
    sp = spec.speculator
    draft = sp.draft
    projected = []
    monkeypatch.setattr(draft, "project", lambda hidden, f=draft.project: projected.append(1) or f(hidden))
    gen = torch.Generator().manual_seed(0)
    h, p, per, deltas = draft.config.hidden_size, 5, 2, [3, -2, 0]
    hidden = {i: torch.randn(len(deltas), p, h, generator=gen) for i in sp.target_layer_ids}
    sp.begin(9, 16)
    sp.load_context(slice(2, 2 + len(deltas) * per), hidden, deltas, per)
    assert projected == [1]
    for j, delta in enumerate(deltas):
        with torch.inference_mode():
            kv = draft.context_kv(draft.project({i: x[j:j + 1] for i, x in hidden.items()}), torch.arange(p)[None] + delta)
        for layer, (k, v) in enumerate(kv):
            for r in range(2 + j * per, 2 + (j + 1) * per):
                torch.testing.assert_close(sp.proposer.k[layer][r, :, :p], k[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(sp.proposer.v[layer][r, :, :p], v[0], rtol=1e-5, atol=1e-5)
                assert not sp.proposer.k[layer][r, :, p:].any()
    for layer in range(len(sp.proposer.k)):
        for r in (0, 1, 8):
            assert not sp.proposer.k[layer][r].any() and not sp.proposer.v[layer][r].any()


def test_the_runtime_hands_the_draft_one_prefill_pass_at_a_time(runtimes, monkeypatch):
    """The runtime gives the speculator each prefill pass's hidden states whole (G prompts, each
    scene's K samples), not scene by scene: three scenes of one prompt length at K=2 are one call
    over their six rows, and the outputs are still the baseline's."""
    base, spec = runtimes
    calls = []
    real = spec.speculator.load_context
    monkeypatch.setattr(spec.speculator, "load_context", lambda rows, hidden, deltas, per=1: calls.append(
        (rows, next(iter(hidden.values())).shape[0], len(deltas), per)) or real(rows, hidden, deltas, per))
    reqs = [scene(s, k=2, temperature=0.8, seed=s) for s in (11, 12, 13)]
    got, want = spec.run(reqs), base.run(reqs)
    assert calls == [(slice(0, 6), 3, 3, 2)]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_fp8_profiles_propose_through_fp8_weights_and_stay_lossless(ckpt, head):
    """On an fp8 profile the draft's products and the LM head it proposes through are e4m3 (the
    target's own head stays in the compute dtype, so verification, hence every output, is the fp8
    baseline's); on bf16 the proposer uses the target's head itself."""
    from worker.model.fp8 import Fp8Linear

    base = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32, precision="fp8")
    spec = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32, precision="fp8",
                                speculator_factory=DFlash2Speculator.factory(str(head)))
    bf16 = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(head)))
    proposer = spec.speculator.proposer
    assert isinstance(proposer.head, Fp8Linear) and type(proposer.lm_head) is torch.nn.Linear
    assert proposer.lm_head is spec.model.lm_head
    assert isinstance(proposer.draft.fc, Fp8Linear) and isinstance(proposer.draft.layers[0].mlp.down_proj, Fp8Linear)
    assert type(proposer.draft.selector.q_proj) is torch.nn.Linear
    assert bf16.speculator.proposer.head is bf16.model.lm_head
    assert_expert_routing(spec)            # a checkpoint loaded for fp8 routes the expert as `bench.to_fp8` does
    assert type(bf16.speculator.proposer.draft.fc) is torch.nn.Linear
    for r in (base, spec):
        r.trajectory_max_new = 24
    reqs = [scene(i, k=2, temperature=0.7, seed=20 + i) for i in range(2)]
    for x, y in zip(base.run(reqs), spec.run(reqs)):
        assert x.texts == y.texts and y.speculative.steps > 0


def test_a_model_quantised_after_the_speculator_was_built_gets_fp8_proposals_at_the_next_batch(ckpt, head):
    """The benchmarks quantise a built runtime in place (`bench.to_fp8`): the next batch's
    `begin` turns the proposals to fp8 too."""
    from worker.model.fp8 import Fp8Linear, quantize_model_fp8

    spec = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(head)))
    spec.trajectory_max_new = 8
    assert type(spec.speculator.proposer.head) is torch.nn.Linear
    quantize_model_fp8(spec.model)
    spec.run([scene(1, k=1, temperature=0.0, seed=1)])
    assert isinstance(spec.speculator.proposer.head, Fp8Linear)
