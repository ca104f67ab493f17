"""The lake's tables as an analyst reads them: run_id, scene_id and submitted_at are columns inside
the files; ``sink --samples`` adds one row per sample, ``sink --requests`` the requests with ego
history and ground truth, so ADE is a join of samples and requests."""

import numpy as np
import pyarrow.parquet as pq

import schemas as S
from producer_tools import lake as LK
from producer_tools.publish import run_request
from producer_tools.scene_sources import iter_synthetic

from tests.producer_tools.sink_harness import FakeConsumer, Rec, make_result, sink_pass


async def test_samples_and_requests_tables_give_ade_by_a_join(tmp_path):
    lake = tmp_path / "lake"
    items = list(iter_synthetic(2, seed=7)[1])
    reqs = [run_request(item, "trajectory", 2, "run-ade", temperature=0.6, submitted_at=1_700_000_000.5,
                        ground_truth=True) for item in items]
    assert all(r.future_egomotion is not None and len(r.future_egomotion.ego_future_xyz) == 64 for r in reqs)
    req_recs = [Rec("req", 0, i, 1_700_000_001_000, r.request_id.encode(), *S.encode_request(r))
                for i, r in enumerate(reqs)]
    results = []
    for i, r in enumerate(reqs):
        res = make_result(r.request_id, "run-ade", i, k=2)
        kept = {f: getattr(res, f) for f in res.__struct_fields__ if f not in ("labels", "submitted_at", "uncertainty")}
        results.append(S.InferResult(**kept, labels=dict(r.labels), submitted_at=r.submitted_at,
                                     uncertainty=S.Uncertainty(uncertainty=0.25 * (i + 1), lateral_spread_m=0.5 * i)))
    res_recs = [Rec("res", 0, i, 1_700_000_002_000, r.request_id.encode(), *S.encode_result(r))
                for i, r in enumerate(results)]
    await sink_pass(lake, req_recs, FakeConsumer(), rotate_rows=10, include_requests=True)
    await sink_pass(lake, res_recs, FakeConsumer(), rotate_rows=10, include_samples=True)

    # inside the files, not only in the path
    for table, cols in (("results", {"run_id", "scene_id", "submitted_at", "uncertainty"}), ("samples", {"run_id", "scene_id", "sample"}),
                        ("requests", {"run_id", "scene_id", "submitted_at", "temperature", "ego_future_xyz"})):
        [path] = LK.lake_files(lake, table)
        assert cols <= set(pq.read_schema(path).names), table
    got = LK.read_lake(lake, "results", columns=["request_id", "run_id", "scene_id", "submitted_at", "uncertainty",
                                                 "uncertainty_lateral_spread_m", "uncertainty_trajectory_spread_m"])
    assert [(g["run_id"], g["scene_id"]) for g in got.to_pylist()] == [("run-ade", it.scene_id) for it in items]
    # the request's submitted_at and the uncertainty block, as columns of the results table
    assert [(g["submitted_at"].timestamp(), g["uncertainty"], g["uncertainty_lateral_spread_m"],
             g["uncertainty_trajectory_spread_m"]) for g in got.to_pylist()] == \
        [(1_700_000_000.5, 0.25, 0.0, None), (1_700_000_000.5, 0.5, 0.5, None)]
    rq = LK.read_lake(lake, "requests").to_pylist()
    assert [r["submitted_at"].timestamp() for r in rq] == [1_700_000_000.5] * 2
    assert [(r["temperature"], r["num_traj_samples"], len(r["ego_history_xyz"])) for r in rq] == [(0.6, 2, 16)] * 2

    # ADE of each sample: samples JOIN requests ON request_id
    samples = LK.read_lake(lake, "samples", columns=["request_id", "sample", "pred_xyz"])
    assert samples.num_rows == 4 and samples.column("sample").to_pylist() == [0, 1, 0, 1]
    gt_by_id = {r["request_id"]: r["ego_future_xyz"] for r in LK.read_lake(lake, "requests").to_pylist()}
    for row in samples.to_pylist():            # (pyarrow's join has no fixed-size lists; DuckDB's does: README)
        want_req = next(r for r in reqs if r.request_id == row["request_id"])
        want_res = next(r for r in results if r.request_id == row["request_id"])
        pred = np.array(want_res.pred_trajectories[row["sample"]])[:, :2]
        gt = np.array(want_req.future_egomotion.ego_future_xyz)[:, :2]
        ade = np.linalg.norm(np.array(row["pred_xyz"])[:, :2] - np.array(gt_by_id[row["request_id"]])[:, :2],
                             axis=1).mean()
        assert abs(ade - np.linalg.norm(pred - gt, axis=1).mean()) < 1e-4
