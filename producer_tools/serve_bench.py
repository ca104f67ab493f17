"""The whole worker's throughput through Kafka against the engine alone (issue 17):
`python -m producer_tools.serve_bench [--scenes 256] [--batch 16] [--k 1] [--image-size 1080x1920]`.

1. a local Apache Kafka (deploy/local; JAVA_HOME may point at a jlink-trimmed runtime) and this
   run's topics;
2. a backlog of N trajectory requests (`--distinct` synthetic scenes at `--image-size`, JPEG,
   cycled under distinct request ids), published before the worker starts;
3. `python -m worker serve` with this process's environment (NIM_MODEL_PROFILE, NIM_FT_CHECKPOINT,
   ALPAMAYO_LOAD_FORMAT=dummy for a config-only directory, ...) and ALPAMAYO_MAX_BATCH_SIZE =
   `--batch`: Kafka-path scenes/s = N / (last answer - ready);
4. the worker stopped, the same records through the worker's own intake (untimed) and engine in
   this process, in batches of `--batch`: engine-only scenes/s = N / the batches' summed wall time;
5. the table `target | measured | status`: the Kafka path >= 95% of the engine alone, every request
   answered, and how many reasoning texts the two paths share (informational: batch composition
   may differ). Writes it to `--out`/serve_bench.md; exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import msgspec

import schemas as S
from deploy.local.cluster import LocalKafka
from deploy.local.host import free_ports
from producer_tools.answers import collect_answers, send_requests
from producer_tools.common import kafka_options, metric_sum, new_run_id
from producer_tools.publish import run_request
from producer_tools.scene_sources import iter_synthetic
from producer_tools.topics import create_topics, plan_topics
from worker.metrics import ENGINE_PHASES
from worker.process import spawn_worker, stop_worker, wait_ready

KAFKA_OVER_ENGINE = 0.95        # the bar: Kafka-path scenes/s over the engine alone's
SCENE_SEED = 7_500_000


def build_requests(run_id: str, n: int, distinct: int, image_hw: tuple[int, int], k: int) -> list[S.InferRequest]:
    """n trajectory requests over `distinct` synthetic scenes (JPEG frames of image_hw), ids unique."""
    _, items = iter_synthetic(min(n, distinct), seed=SCENE_SEED, image_size=image_hw, image_format="jpeg")
    items = list(items)
    out = []
    for i in range(n):
        req = run_request(items[i % len(items)], "trajectory", k, run_id, temperature=0.6 if k > 1 else 0.0,
                          seed=i)
        out.append(msgspec.structs.replace(req, request_id=f"{req.request_id}:{i}"))
    return out


def kafka_path(opts, env: dict[str, str], reqs: list[S.InferRequest], timeout_s: float, log_path: Path):
    """Publish the backlog, start the worker, read every answer -> (scenes/s, results, dead, missing,
    first answer s, engine seconds, last answer s, `batch_walls` text), times from readiness."""
    sent = asyncio.run(send_requests(opts, reqs))
    print(f"   published {len(sent)} requests to {opts.request_topic}", flush=True)
    with open(log_path, "w") as log:
        proc = spawn_worker(env, stdout=log, stderr=log)
        try:
            base_url = f"http://127.0.0.1:{env['ALPAMAYO_HTTP_PORT']}"
            wait_ready(base_url, timeout=timeout_s, proc=proc)
            print(f"   worker ready; reading answers (log: {log_path})", flush=True)
            results, dead, missing = asyncio.run(collect_answers(opts, set(sent), timeout_s))
            engine = engine_seconds(base_url)
            # the run's clock starts when the worker became ready (it fetches right after), by its own
            # gauge: the polled readiness comes up to a poll late, and a short run then showed its
            # engine busy 140% of the run and a Kafka path faster than it was
            ready = metric_sum(base_url, "alpamayo_ready_since_seconds")
        finally:
            stop_worker(proc, timeout=120)
    if not ready:
        raise RuntimeError("the worker reported no alpamayo_ready_since_seconds")
    last = max((at for _, at in results.values()), default=ready)
    first = min((at for _, at in results.values()), default=ready)
    return (len(results) / max(last - ready, 1e-9), results, dead, missing, first - ready, engine, last - ready,
            batch_walls(results, ready))


def engine_seconds(base_url: str) -> dict[str, float]:
    """The worker's engine-thread seconds per phase and its batch count, from its Prometheus
    metrics -> {"infer": s, "output": s, "batches": n}."""
    out = {phase: metric_sum(base_url, f'alpamayo_engine_seconds_total{{phase="{phase}"') for phase in ENGINE_PHASES}
    return {**out, "batches": metric_sum(base_url, "alpamayo_batch_size_count"),
            "scenes": metric_sum(base_url, "alpamayo_batch_size_sum")}


def engine_split(engine: dict[str, float], wall_s: float, alone_infer_s: float, alone_batches: int,
                 untimed: tuple[float, float] | None = None) -> str:
    """"10 batches of 16.0 scenes on average; infer 9.8 + output 0.1 s per batch, busy 83% of the
    run; ...; alone: infer 9.6 s per batch": fewer scenes per batch than --batch (a partial batch
    at the start) costs one more batch's decode and diffusion; an engine slower per batch inside the worker points at
    contention for the host, a low busy fraction at time lost between batches (the run's clock
    starts when the worker became ready). `untimed`: seconds per batch of
    infer outside the timed stages (Kafka path, alone)."""
    n = max(engine["batches"], 1.0)
    busy = (engine["infer"] + engine["output"]) / max(wall_s, 1e-9)
    text = (f"{engine['batches']:.0f} batches of {engine.get('scenes', 0.0) / n:.1f} scenes on average; "
            f"infer {engine['infer'] / n:.2f} + output {engine['output'] / n:.2f} s per batch, busy {busy:.0%} "
            f"of the run (host work of the next batch, prepared meanwhile: {engine.get('prepare', 0.0) / n:.2f} s "
            f"per batch); alone: infer {alone_infer_s / max(alone_batches, 1):.2f} s per batch")
    if untimed:
        text += f"; infer outside the timed stages {untimed[0]:.2f} / {untimed[1]:.2f} s per batch"
    return text


def in_process(env: dict[str, str], reqs: list[S.InferRequest]):
    """The worker's engine (loaded and warmed as `worker serve` does) and intake in this process,
    and the requests as records through that intake (untimed) -> (engine, intake, records, jobs)."""
    from worker.config import load_settings
    from worker.engine import Engine, default_seed
    from worker.intake import Intake, Job, RawRecord
    from worker.service import load_engine

    settings = load_settings({**os.environ, **env})
    engine = Engine(settings)
    load_engine(engine, settings)
    intake = Intake(settings, default_seed, shrink_frame=engine.shrink_frame)
    records, jobs = [], []
    for i, req in enumerate(reqs):
        value, headers = S.encode_request(req)
        records.append(RawRecord("in-process", 0, i, value, S.request_key(req), tuple(headers)))
        job = intake.process(records[-1])
        if not isinstance(job, Job):
            raise RuntimeError(f"{req.request_id}: {job.error_code.value}: {job.error_message}")
        jobs.append(job)
    return engine, intake, records, jobs


def engine_only(env: dict[str, str], reqs: list[S.InferRequest], batch: int):
    """The same records through the worker's intake (untimed) and engine in this process ->
    (scenes/s, {request id: SceneResult}, seconds in the engine)."""
    engine, _, _, jobs = in_process(env, reqs)
    out, wall = {}, 0.0
    for i in range(0, len(jobs), batch):
        part = jobs[i:i + batch]
        t0 = time.perf_counter()
        res = engine.infer([j.scene for j in part])
        wall += time.perf_counter() - t0
        out.update((j.request.request_id, r) for j, r in zip(part, res))
    return len(jobs) / wall, out, wall


STAGES = ("prefill", "decode", "diffusion")


def stage_times(results: dict, direct: dict) -> tuple[str, dict[str, float], dict[str, float]]:
    """Per-scene engine stage times, Kafka path / engine alone, as text of medians and means
    ("prefill 410 / 402 ms (mean 431 / 403), ..."): a stage slower inside the worker points at
    contention for the host (the engine thread shares the process with intake and the Kafka
    clients); equal stages point elsewhere (`engine_split`). -> (text, {stage: mean ms} Kafka path,
    {stage: mean ms} alone): means, since a batch's stages are its scenes' sum (a median hides a
    batch's slow scenes, and the time they took then counted as outside the stages)."""
    kafka = {s: [getattr(r.metrics.timings, f"{s}_ms") for r, _ in results.values()] for s in STAGES}
    alone = {s: [r.timings_ms.get(s, 0.0) for r in direct.values()] for s in STAGES}
    text = ", ".join(f"{s} {statistics.median(kafka[s]):.0f} / {statistics.median(alone[s]):.0f} ms (mean "
                     f"{statistics.fmean(kafka[s]):.0f} / {statistics.fmean(alone[s]):.0f})" for s in STAGES)
    return text, {s: statistics.fmean(v) for s, v in kafka.items()}, {s: statistics.fmean(v) for s, v in alone.items()}


def prefill_by_batch(results: dict, direct: dict) -> str:
    """Each batch's mean prefill per scene, in the order the batches' results came, Kafka path;
    then the engine alone's: whether the Kafka path's slower prefills (a mean above the alone
    run's, medians equal, on the H200) are a few batches or spread. A batch's scenes share
    its decode time, the key here."""
    def means(pairs) -> str:
        batches: dict[float, list[float]] = {}
        for decode_ms, prefill_ms in pairs:
            batches.setdefault(decode_ms, []).append(prefill_ms)
        return ", ".join(f"{statistics.fmean(v):.0f}" for v in batches.values())
    kafka = means((r.metrics.timings.decode_ms, r.metrics.timings.prefill_ms) for r, _ in results.values())
    alone = means((r.timings_ms.get("decode", 0.0), r.timings_ms.get("prefill", 0.0)) for r in direct.values())
    return f"Kafka path {kafka}; alone {alone}"


def batch_walls(results: dict, ready: float) -> str:
    """The Kafka path's batches by their answers' arrival: "first 13.8 s, later median 6.9 s (min
    6.7, max 7.0); after the first: 2.31 scenes/s". A batch's scenes share its decode time (the key,
    as in `prefill_by_batch`) and are published together; the first batch's wall runs from the
    worker's readiness, so it holds the pipeline's filling (fetch, frame decoding of the first
    scenes, one-time costs) that later batches, prepared while the one before runs, do not. The
    rate after the first batch is informational: the bar counts the whole run from readiness."""
    ends: dict[float, tuple[float, int]] = {}
    for result, at in results.values():
        key = result.metrics.timings.decode_ms
        last, n = ends.get(key, (0.0, 0))
        ends[key] = (max(last, at), n + 1)
    order = sorted(ends.values())
    if not order:
        return ""
    walls = [order[0][0] - ready] + [b[0] - a[0] for a, b in zip(order, order[1:])]
    text = f"first {walls[0]:.1f} s"
    if len(walls) > 1:
        later = walls[1:]
        after = sum(n for _, n in order[1:]) / max(order[-1][0] - order[0][0], 1e-9)
        text += (f", later median {statistics.median(later):.1f} s (min {min(later):.1f}, max {max(later):.1f}); "
                 f"after the first: {after:.3f} scenes/s")
    return text


def batch_stage_s(ms: dict[str, float], scenes_per_batch: float) -> float:
    """Seconds of timed stages in one batch: each scene's prefill, the batch's decode and diffusion."""
    return (scenes_per_batch * ms["prefill"] + ms["decode"] + ms["diffusion"]) / 1e3


def table(kafka_sps: float, engine_sps: float, n: int, answered: int, dead: int, same_text: int, compared: int,
          stages: str = "", first_answer_s: float | None = None, engine: str = "", by_batch: str = "",
          walls: str = "") -> str:
    ratio = kafka_sps / engine_sps
    rows = [("Kafka-path scenes/s >= 0.95x the engine alone at the same batch",
             f"{kafka_sps:.3f} / {engine_sps:.3f} scenes/s = {ratio:.3f}x", ratio >= KAFKA_OVER_ENGINE),
            ("every request answered with a result", f"{answered} of {n} ({dead} dead letters)",
             answered == n),
            ("reasoning identical to the engine alone's (informational)", f"{same_text} of {compared}", None)]
    if stages:
        rows.append(("engine stage per scene, median (mean), Kafka path / engine alone (informational)", stages, None))
    if by_batch:
        rows.append(("prefill per scene, mean of each batch in the order they ran, ms (informational)", by_batch, None))
    if walls:
        rows.append(("batch wall, Kafka path, by its answers (informational)", walls, None))
    if engine:
        rows.append(("engine thread, Kafka path (informational)", engine, None))
    if first_answer_s is not None:
        rows.append(("first answer after the worker was ready (informational)", f"{first_answer_s:.1f} s", None))
    lines = ["| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'-' if ok is None else 'met' if ok else 'missed'} |" for t, m, ok in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m producer_tools.serve_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--scenes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="ALPAMAYO_MAX_BATCH_SIZE, and the engine-only batches")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--distinct", type=int, default=4, help="distinct synthetic scenes the requests cycle through")
    ap.add_argument("--image-size", default="1080x1920", help="HxW of every frame")
    ap.add_argument("--reasoning-tokens", type=int, default=None,
                    help="reasoning-token cap of the worker and the engine alone (ALPAMAYO_MAX_REASONING_TOKENS; "
                         "default: the release's 256)")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default="serve-bench-out")
    ap.add_argument("--bootstrap-servers", default=None, help="a running Kafka (default: start a local one)")
    args = ap.parse_args(argv)
    h, w = (int(x) for x in args.image_size.lower().split("x"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print("== 1. local Apache Kafka", flush=True)
    kafka = None if args.bootstrap_servers else LocalKafka(name="serve-bench")
    bootstrap = args.bootstrap_servers or kafka.start()
    try:
        run_id = new_run_id("serve-bench")
        opts = kafka_options({}, bootstrap_servers=bootstrap, request_topic=f"{run_id}.requests",
                             result_topic=f"{run_id}.results", dead_letter_topic=f"{run_id}.dead-letters")
        asyncio.run(create_topics(opts, plan_topics(opts, partitions=args.partitions, max_message_bytes=64 << 20)))
        print(f"== 2. {args.scenes} requests, K={args.k}, {args.distinct} distinct scenes of {h}x{w}", flush=True)
        reqs = build_requests(run_id, args.scenes, args.distinct, (h, w), args.k)
        env = {"NIM_ALPAMAYO_TRAJ_SAMPLES": str(args.k), "ALPAMAYO_MAX_BATCH_SIZE": str(args.batch),
               "ALPAMAYO_MAX_BATCH_WAIT_MS": "200", "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
               "ALPAMAYO_REQUEST_TOPIC": opts.request_topic, "ALPAMAYO_RESULT_TOPIC": opts.result_topic,
               "ALPAMAYO_DEAD_LETTER_TOPIC": opts.dead_letter_topic, "ALPAMAYO_GROUP_ID": f"{run_id}-workers",
               "ALPAMAYO_HTTP_PORT": str(free_ports(1)[0]), "ALPAMAYO_HTTP_HOST": "127.0.0.1"}
        if args.reasoning_tokens is not None:
            env["ALPAMAYO_MAX_REASONING_TOKENS"] = str(args.reasoning_tokens)
        print(f"== 3. the worker ({os.environ.get('NIM_MODEL_PROFILE', 'bf16')}) through Kafka", flush=True)
        kafka_sps, results, dead, missing, first_s, engine, wall_s, walls = kafka_path(opts, env, reqs, args.timeout,
                                                                                       out / "worker.log")
    finally:
        if kafka is not None:
            kafka.stop()
    print(f"   {kafka_sps:.3f} scenes/s; {len(results)} results, {len(dead)} dead letters, {len(missing)} unanswered",
          flush=True)
    print("== 4. the engine alone on the same records", flush=True)
    engine_sps, direct, alone_s = engine_only(env, reqs, args.batch)
    compared = [rid for rid in results if rid in direct and direct[rid].error is None]
    same = sum(list(results[rid][0].metrics.reasoning_texts) == list(direct[rid].texts) for rid in compared)
    stages, untimed, by_batch = "", None, ""
    alone_batches = -(-len(reqs) // args.batch)
    if results and direct:
        stages, kafka_ms, alone_ms = stage_times(results, direct)
        by_batch = prefill_by_batch(results, direct)
        n_kafka = max(engine["batches"], 1.0)
        untimed = (engine["infer"] / n_kafka - batch_stage_s(kafka_ms, len(results) / n_kafka),
                   alone_s / alone_batches - batch_stage_s(alone_ms, len(direct) / alone_batches))
    split = engine_split(engine, wall_s, alone_s, alone_batches, untimed)
    text = table(kafka_sps, engine_sps, len(reqs), len(results), len(dead), same, len(compared), stages, first_s,
                 split, by_batch, walls)
    print("== 5. Kafka path against the engine alone\n" + text, flush=True)
    (out / "serve_bench.md").write_text(text + "\n")
    return 0 if "| missed |" not in text else 1


if __name__ == "__main__":
    sys.exit(main())
