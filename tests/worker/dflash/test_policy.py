"""Speculation that never costs (CPU, fp32): with step costs measured at warm-up, the DFlash2 loop
drafts where acceptance pays and takes the baseline's decode step where it does not; outputs equal
the baseline's either way."""

import msgspec
import pytest
import torch

import schemas as S

from worker.dflash.loop import DFlash2Speculator
from worker.dflash.metrics import SpecStats, speculative_block
from worker.dflash.policy import SpeculationPolicy, StepCosts
from worker.metrics import WorkerMetrics
from worker.model.runtime import AlpamayoRuntime

from tests.schemas.test_contract import result
from tests.worker.graph_replay import use_replaying_graphs
from tests.worker.dflash.test_speculative_decoding import oracle_run
from tests.worker.model.test_runtime import scene


@pytest.fixture(scope="module")
def runtimes(tiny):
    ckpt, head = tiny
    base = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32)
    spec = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                                speculator_factory=DFlash2Speculator.factory(str(head)))
    for r in (base, spec):
        r.trajectory_max_new = 48
    # step costs of a GPU at batch 1 (verify(8) 1.1x decode, a draft pass 0.1x): the shared CPU's
    # timings are too noisy for a test's decisions; calibration itself is tested below
    spec.speculator.policy.costs = {b: StepCosts(loop={0: 1.0, 3: 1.15, 7: 1.2}, decode=1.0, verify={4: 1.05, 8: 1.1},
                                                 draft=0.1) for b in (1, 2, 4)}
    return base, spec


def requests(k=1, temperature=0.0):
    return [scene(i, k=k, temperature=temperature, seed=20 + i) for i in range(2)]


def test_calibration_measures_each_bucket(tiny):
    ckpt, head = tiny
    rt = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                              speculator_factory=DFlash2Speculator.factory(str(head)))
    rt.calibrate_speculation([1, 2])
    costs = rt.speculator.policy.costs
    assert sorted(costs) == [1, 2]
    for c in costs.values():
        assert c.decode > 0 and c.draft > 0 and sorted(c.verify) == [4, 8] and min(c.verify.values()) > 0
        assert sorted(c.loop) == [0, 3, 7] and min(c.loop.values()) > 0


def test_calibration_over_graphed_steps_stays_inside_the_cache(tiny):
    """Calibration times whole loop steps at the last context that fits the persistent cache;
    each graph's warm-up calls start from the same state (a step advances its rows), so none
    writes past the cache (CPU replay of the graphs: an index error if one did)."""
    ckpt, head = tiny
    rt = AlpamayoRuntime.load(ckpt, device="cpu", dtype=torch.float32,
                              speculator_factory=DFlash2Speculator.factory(str(head)))
    rt.enable_graphs(max_rows=2, capacity=64)
    graphs = use_replaying_graphs(rt)
    rt.calibrate_speculation([1, 2])
    assert {k[0] for k in graphs._graphs} >= {"verify3", "verify7", "draft"}
    assert sorted(rt.speculator.policy.costs) == [1, 2]


@pytest.mark.parametrize("k,temperature", [(1, 0.0), (2, 0.7)])
def test_low_acceptance_takes_the_baseline_step(runtimes, k, temperature):
    base, spec = runtimes
    reqs = requests(k, temperature)
    ref = base.run(reqs)
    spec.speculator.policy.groups.clear()
    first = oracle_run(spec, reqs, [r.token_ids for r in ref], error_rate=1.0)     # every draft wrong
    again = oracle_run(spec, reqs, [r.token_ids for r in ref], error_rate=1.0)     # the group learnt it
    for x, y, z in zip(ref, first, again):
        assert x.token_ids == y.token_ids == z.token_ids
        assert (x.trajectories == z.trajectories).all()
    blocks = [speculative_block(r.speculative) for r in again]
    assert all(b["speculated_step_fraction"] <= 0.1 for b in blocks), blocks
    assert all(b["num_baseline_steps"] > 0 for b in blocks)


def test_high_acceptance_drafts(runtimes):
    base, spec = runtimes
    reqs = requests()
    ref = base.run(reqs)
    spec.speculator.policy.groups.clear()
    got = oracle_run(spec, reqs, [r.token_ids for r in ref], error_rate=0.0)        # every draft right
    for x, y in zip(ref, got):
        assert x.token_ids == y.token_ids
        b = speculative_block(y.speculative)
        assert b["speculated_step_fraction"] == 1.0 and b["mean_verify_tokens"] > 4, b
        assert b["mean_acceptance_length"] > 3


def test_choice_weighs_expected_tokens_against_step_costs():
    p = SpeculationPolicy()
    costs = StepCosts(loop={0: 1.0, 3: 1.3, 7: 1.5}, decode=1.0, verify={4: 1.1, 8: 1.3}, draft=0.2)
    assert p.choose(costs, 4, [4 * 1.1, 4 * 1.2]) == 0        # ~1.1 tokens per row: not worth 1.3-1.5x
    assert p.choose(costs, 4, [4 * 3.5, 4 * 4.0]) == 3        # 3.5/1.3 beats 4.0/1.5
    assert p.choose(costs, 4, [4 * 3.9, 4 * 7.5]) == 7
    assert p.choose(None, 4, [0.0, 0.0]) == 7                 # uncalibrated: always draft (old behaviour)


def test_the_first_choice_on_the_host_is_the_first_heads_choice():
    """The loop drafts its first block before reading the first head when `first_choice` says the
    first step verifies: that is the choice the head's expected tokens then give, for any group."""
    p = SpeculationPolicy()
    costs = StepCosts(loop={0: 1.0, 3: 1.3, 7: 1.5}, decode=1.0, verify={4: 1.1, 8: 1.3}, draft=0.2)
    seen = set()
    for counts in [(0.0, 0.0), (0.2, 9.0), (2.0, 3.0), (3.0, 1.0), (40.0, 1.0)]:
        p.groups[("trajectory", 1)] = counts
        acceptance = p.start(("trajectory", 1), 4, torch.device("cpu"))
        generating = torch.tensor([True, True, True, False])
        on_device = p.choose(costs, 3.0, acceptance.expected_tokens(generating, p.drafts).tolist())
        assert p.first_choice(costs, ("trajectory", 1)) == on_device, counts
        seen.add(on_device)
    assert seen == {0, 3, 7}


def test_baseline_steps_reach_the_result_block_and_prometheus():
    block = speculative_block(SpecStats(7, [7, 2, 0], [7, 7, 3], baseline_steps=5))
    assert (block["num_spec_steps"], block["num_baseline_steps"]) == (3, 5)
    assert block["speculated_step_fraction"] == 3 / 8 and block["mean_verify_tokens"] == 1 + 17 / 3
    spec = S.SpeculativeDecoding(**block)
    m = WorkerMetrics(spec_counters=True)
    m.observe_result(msgspec.structs.replace(result(), metrics=msgspec.structs.replace(
        result().metrics, speculative_decoding=spec)))
    text = m.render().decode()
    assert 'alpamayo_spec_decode_baseline_steps_total{method="dflash2"} 5.0' in text
    assert 'alpamayo_spec_decode_verify_steps_total{method="dflash2"} 3.0' in text
