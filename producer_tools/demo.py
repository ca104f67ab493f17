"""`make demo` (python -m producer_tools.demo): the main job end to end on the embedded demo model.

1. start a local Apache Kafka (deploy/local), 2. build or reuse the demo checkpoint and its
DFlash2 head, 3. create this run's topics, 4. start the worker (`python -m worker serve`) on the
bf16-dflash2 profile (`--profile`, `make demo DEMO_ARGS="--profile fp8-dflash2"`) with K = 1,2,3
and wait until it is ready, 5. publish synthetic scenes of
every task and several K (plus two invalid requests, to show dead letters), 6. wait for one
result or dead letter per request, 7. print a summary per task and write a PNG of trajectories.
Exits non-zero if any request is unanswered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np

from deploy.local.cluster import LocalKafka
from deploy.local.host import free_ports
from producer_tools.answers import collect_answers, send_requests
from producer_tools.common import kafka_options, new_run_id
from producer_tools.publish import run_request
from producer_tools.scene_sources import iter_synthetic
from producer_tools.topics import create_topics, plan_topics
from worker.config import PROFILES
from worker.demo_cache import demo_checkpoint, demo_head
from worker.scenes import bev_plot, generate_scene
from worker.process import spawn_worker, stop_worker, wait_ready

N_SCENES = 8


def _requests(run_id: str, n: int):
    """(InferRequest, expected) for every task and K = 1, 2, 3; two invalid requests."""
    _, items = iter_synthetic(n, seed=7_000_000)
    items = list(items)
    out = []
    for i, item in enumerate(items):
        k = 1 + i % 3
        out.append(run_request(item, "trajectory", k, run_id, temperature=0.6 if k > 1 else 0.0, seed=i))
        task = ("meta_action", "auto_labeling", "vqa", "grounding")[i % 4]
        out.append(run_request(item, task, 1, run_id, max_tokens=160))
    bad_k = run_request(items[0], "trajectory", 5, run_id, temperature=0.6, seed=1)     # K not served
    bad_img = msgspec.structs.replace(run_request(items[1], "trajectory", 1, run_id, seed=2),
                                      request_id=f"{run_id}:bad-image", images=[b"not an image"] * 24)
    return out + [bad_k, bad_img], items


async def _publish_and_collect(opts, reqs, timeout_s: float):
    sent_at = await send_requests(opts, reqs)
    print(f"published {len(reqs)} requests to {opts.request_topic}", flush=True)
    results, dead, missing = await collect_answers(opts, set(sent_at), timeout_s)
    return {i: (r, at - sent_at[i]) for i, (r, at) in results.items()}, dead, missing


def _summary(results: dict, dead: dict) -> str:
    rows = ["| task | results | latency p50 ms | latency p95 ms | acceptance rate | mean acceptance length |",
            "|---|---|---|---|---|---|"]
    by_task: dict[str, list] = {}
    for r, _ in results.values():
        by_task.setdefault(r.task, []).append(r)
    for task in ("trajectory", "meta_action", "auto_labeling", "vqa", "grounding"):
        rs = by_task.get(task, [])
        if not rs:
            continue
        lat = sorted(r.metrics.timings.total_ms for r in rs)
        p50 = statistics.median(lat)
        p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
        specs = [r.metrics.speculative_decoding for r in rs if r.metrics.speculative_decoding is not None]
        if specs:
            acc = sum(s.num_accepted_draft_tokens for s in specs)
            drafted = sum(s.num_draft_tokens for s in specs)
            steps = sum(s.num_spec_steps for s in specs)
            rate, mal = f"{acc / max(drafted, 1):.3f}", f"{1 + acc / max(steps, 1):.2f}"
        else:
            rate = mal = "-"
        rows.append(f"| {task} | {len(rs)} | {p50:.0f} | {p95:.0f} | {rate} | {mal} |")
    codes: dict[str, int] = {}
    for d in dead.values():
        codes[str(d.error_code)] = codes.get(str(d.error_code), 0) + 1
    rows.append(f"| dead letters | {len(dead)} | | | {', '.join(f'{c}: {n}' for c, n in sorted(codes.items()))} | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m producer_tools.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--scenes", type=int, default=N_SCENES)
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--keep-kafka", action="store_true", help="leave the local broker running")
    ap.add_argument("--profile", choices=PROFILES, default="bf16-dflash2", help="NIM_MODEL_PROFILE of the worker")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    with local_broker(keep=args.keep_kafka) as bootstrap:
        return _run(args, bootstrap, t0)


@contextlib.contextmanager
def local_broker(keep: bool, name: str = "demo"):
    """The demo's local Kafka, started or reused, with a lease held while the demo runs
    (`LocalKafka.acquire`): at the end it stops unless `keep` (--keep-kafka) or another run still
    holds a lease (two `make demo`s, or a demo beside `make test`'s demo test, share it)."""
    print("== 1. local Apache Kafka", flush=True)
    kafka = LocalKafka(name=name)
    bootstrap = kafka.acquire()
    print(f"   bootstrap {bootstrap}", flush=True)
    try:
        yield bootstrap
    finally:
        if not keep and not kafka.release():
            print(f"   local Kafka {name!r} left running: another run still uses it", flush=True)


def _run(args, bootstrap: str, t0: float) -> int:
    print("== 2. demo checkpoint and DFlash2 head", flush=True)
    checkpoint = demo_checkpoint()                # shipped, verified against its manifest
    head = demo_head(checkpoint)
    print(f"   checkpoint {checkpoint}\n   head       {head}", flush=True)
    run_id = new_run_id("demo")
    opts = kafka_options({}, bootstrap_servers=bootstrap, request_topic=f"{run_id}.requests",
                         result_topic=f"{run_id}.results", dead_letter_topic=f"{run_id}.dead-letters")
    asyncio.run(create_topics(opts, plan_topics(opts, partitions=3)))
    print(f"== 3. topics {opts.request_topic}, {opts.result_topic}, {opts.dead_letter_topic}", flush=True)
    port = free_ports(1)[0]
    env = {"NIM_MODEL_PROFILE": args.profile, "NIM_ALPAMAYO_TRAJ_SAMPLES": "1,2,3",
           "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "ALPAMAYO_REQUEST_TOPIC": opts.request_topic,
           "ALPAMAYO_RESULT_TOPIC": opts.result_topic, "ALPAMAYO_DEAD_LETTER_TOPIC": opts.dead_letter_topic,
           "ALPAMAYO_GROUP_ID": f"{run_id}-workers", "ALPAMAYO_HTTP_PORT": str(port), "ALPAMAYO_HTTP_HOST": "127.0.0.1"}
    for var in ("NIM_PRECISION", "NIM_FT_CHECKPOINT", "NIM_ALPAMAYO_SPECULATIVE_MODEL"):
        os.environ.pop(var, None)
    print(f"== 4. worker ({args.profile}, K=1,2,3): loading and warming up", flush=True)
    proc = spawn_worker(env)
    code = 1
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=600, proc=proc)
        print(f"   ready on :{port} ({time.perf_counter() - t0:.0f}s since start)", flush=True)
        reqs, items = _requests(run_id, args.scenes)
        print(f"== 5. publishing {len(reqs)} requests (all tasks, K=1,2,3, 2 invalid)", flush=True)
        results, dead, missing = asyncio.run(_publish_and_collect(opts, reqs, args.timeout))
        print("== 6. summary", flush=True)
        table = _summary(results, dead)
        print(table)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("alpamayo_spec_decode"):
                    print("   " + line)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text(table + "\n")
        _plot(items, results, out / "trajectories.png", args.profile)
        print(f"== 7. wrote {out / 'summary.md'} and {out / 'trajectories.png'}")
        if missing:
            print(f"UNANSWERED: {len(missing)} request(s): {sorted(missing)[:5]}", file=sys.stderr)
            code = 1
        else:
            print(f"every request answered: {len(results)} results, {len(dead)} dead letters "
                  f"({time.perf_counter() - t0:.0f}s in all)")
            code = 0
    finally:
        stop_worker(proc, timeout=90)
    return code


def _plot(items, results, path: Path, profile: str) -> None:
    scenes, preds = [], []
    for r, _ in results.values():
        if r.task == "trajectory" and r.pred_trajectories and len(scenes) < 6:
            seed = 7_000_000 + next(i for i, it in enumerate(items) if it.scene_id == r.labels.get("scene_id"))
            scenes.append(generate_scene(seed))
            preds.append(np.asarray(r.pred_trajectories, dtype=np.float32))
    if scenes:
        k = sorted({len(p) for p in preds})
        bev_plot(scenes, preds, path, title=f"make demo: {profile} (demo checkpoint), K={','.join(map(str, k))}")


if __name__ == "__main__":
    raise SystemExit(main())
