"""``alpamayo-producer``: publish scene jobs, sink results into a Parquet lake, audit runs, replay
dead letters, qualify DFlash2 against its baseline, report over a lake.

Kafka connection and topic names come from the worker's environment variables
(``ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS``, ``ALPAMAYO_KAFKA_SECURITY_PROTOCOL``,
``ALPAMAYO_KAFKA_SASL_MECHANISM``/``_USERNAME``/``_PASSWORD``, ``ALPAMAYO_KAFKA_SSL_CAFILE``,
``ALPAMAYO_REQUEST_TOPIC``, ``ALPAMAYO_RESULT_TOPIC``, ``ALPAMAYO_DEAD_LETTER_TOPIC``); the
``--bootstrap-servers`` and ``--*-topic`` flags override them. A command that talks to Kafka first
waits up to ``ALPAMAYO_KAFKA_WAIT_S`` (default 5) for a broker, then stops with one line.

    alpamayo-producer topics create --partitions 6 --replication-factor 3
    alpamayo-producer topics describe
    alpamayo-producer publish --synthetic 100 --seed 0 --tasks trajectory,vqa --k 1 --object-store file:///data/claims
    alpamayo-producer publish --scenes-dir scenes/ --run-id run-20250101-a   # resumes run-20250101-a
    alpamayo-producer sink --lake lake/ [--until-idle 30] [--samples] [--requests]
    alpamayo-producer lake compact --lake lake/
    alpamayo-producer audit RUN_ID --lake lake/
    alpamayo-producer dlq list --lake lake/
    alpamayo-producer dlq replay --lake lake/ --code inference_failed --run-id RUN_ID
    alpamayo-producer qualify --out qual/ [--checkpoint DIR --head DIR]
    alpamayo-producer qualify --uncertainty --scenes 64 --out qual/
    alpamayo-producer report --lake lake/ --out report/ [--force]
    alpamayo-producer review --lake lake/ --run-id RUN_ID --out review/

Exit status: 0 success; audit: 0 COMPLETE, 1 FAILED (requests dead-lettered), 3 INCOMPLETE (requests
not landed yet); qualify --uncertainty: 1 when it missed its bar; 2 usage/configuration/Kafka errors;
130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

import schemas as S
from producer_tools.common import ToolError, check_brokers, die, kafka_options, new_run_id, parse_size
from worker import log_filter
from worker.config import ConfigError

# Each command imports its own module when it runs, so that ``--help`` and the light commands do
# not load the heavy optional dependencies: pyarrow (sink, audit, dlq, report), torch (qualify).

TASK_CHOICES = ("trajectory", "meta_action", "auto_labeling", "vqa", "grounding")


def _tasks(text: str) -> list[str]:
    if text in ("all", "mix"):
        return list(TASK_CHOICES)
    out = [t.strip() for t in text.split(",") if t.strip()]
    for t in out:
        if t not in TASK_CHOICES:
            raise argparse.ArgumentTypeError(f"unknown task {t!r} (use {', '.join(TASK_CHOICES)} or all)")
    if not out:
        raise argparse.ArgumentTypeError("no task given")
    return out


def _size2(text: str) -> tuple[int, int]:
    try:
        w, h = text.lower().split("x")
        return int(w), int(h)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None


def _kv(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k.strip(), v


def _bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 900KiB, 1MiB, 921600)") from None


def _kafka_args(p: argparse.ArgumentParser, *, topics: Sequence[str] = ("request", "result", "dead-letter")) -> None:
    g = p.add_argument_group("Kafka (defaults from the ALPAMAYO_* environment variables)")
    g.add_argument("--bootstrap-servers", help="overrides ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS")
    for t in topics:
        g.add_argument(f"--{t}-topic", dest=f"{t.replace('-', '_')}_topic",
                       help=f"overrides ALPAMAYO_{t.replace('-', '_').upper()}_TOPIC")


def _kafka(args, check: bool = True) -> Any:
    """The Kafka options of a command; ``check``: a broker must answer first (one line otherwise)."""
    opts = kafka_options(bootstrap_servers=args.bootstrap_servers,
                         request_topic=getattr(args, "request_topic", None),
                         result_topic=getattr(args, "result_topic", None),
                         dead_letter_topic=getattr(args, "dead_letter_topic", None))
    if check:
        check_brokers(opts)
    return opts


def _command(sub, name: str, help: str, *examples: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose --help shows its description and examples."""
    return sub.add_parser(name, help=help, description=textwrap.fill(description or help[0].upper() + help[1:] + ".", 100),
                          epilog="examples:\n" + "\n".join(f"  alpamayo-producer {e}" for e in examples),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="alpamayo-producer", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # -- topics ------------------------------------------------------------------------------
    tp = _command(sub, "topics", "create/describe the request, result and dead-letter topics",
                  "topics create --partitions 6", "topics describe")
    tsub = tp.add_subparsers(dest="topics_command", required=True, metavar="create|describe")
    tc = _command(tsub, "create", "create the three topics (existing ones are left unchanged)",
                  "topics create --partitions 6 --replication-factor 3",
                  "topics create --partitions 1 --bootstrap-servers 127.0.0.1:9092")
    tc.add_argument("--partitions", type=int, default=6, help="partitions per topic (default 6)")
    tc.add_argument("--replication-factor", type=int, default=None, help="replicas per partition (default: min(3, brokers))")
    tc.add_argument("--max-message-bytes", type=_bytes, default=2 << 20,
                    help="requests/results max.message.bytes (default 2MiB; dead letters get +256KiB)")
    tc.add_argument("--retention-ms", type=int, default=7 * 24 * 3600 * 1000,
                    help="requests/results retention.ms (default 7 days)")
    tc.add_argument("--dead-letter-retention-ms", type=int, default=30 * 24 * 3600 * 1000,
                    help="dead letters' retention.ms (default 30 days)")
    tc.add_argument("--compact-results", action="store_true", help="cleanup.policy=compact,delete on results")
    tc.add_argument("--config", type=_kv, action="append", default=[], metavar="KEY=VALUE",
                    help="extra topic config for all three (repeatable)")
    _kafka_args(tc)
    td = _command(tsub, "describe", "partitions, replication and configs of the topics (exit 1: one is missing)",
                  "topics describe", "topics describe alpamayo.results --json")
    td.add_argument("names", nargs="*", help="topics (default: the three configured ones)")
    td.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _kafka_args(td)

    # -- publish -----------------------------------------------------------------------------
    pp = _command(sub, "publish", "publish scene jobs of a run to the request topic",
                  "publish --synthetic 20 --tasks trajectory,vqa --run-id demo-1",
                  "publish --scenes-dir scenes/ --k 3 --object-store file:///data/claims",
                  "publish --synthetic 20 --run-id demo-1      # resumes demo-1: skips what was published",
                  description="Publish InferRequests of a run (one per scene and task) and record each "
                  "acknowledged one in the run manifest <runs-dir>/<run-id>.jsonl; see "
                  "producer_tools/scene_sources.py for the manifest format.")
    src = pp.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenes-dir", help="directory of *.msgpack scene files")
    src.add_argument("--manifest", help="JSONL or Parquet manifest of scenes")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic scenes")
    pp.add_argument("--seed", type=int, default=0, help="first synthetic scene seed (default 0)")
    pp.add_argument("--image-size", type=_size2, default=None,
                    help="synthetic image WxH (default: worker.scenes.DEFAULT_IMAGE_SIZE, what the shipped demo model was trained on)")
    pp.add_argument("--image-format", choices=("png", "jpeg"), default="png", help="synthetic image format (default png)")
    pp.add_argument("--tasks", "--task", type=_tasks, default=["trajectory"],
                    help="task or comma list, or 'all' (default trajectory)")
    pp.add_argument("--mix", choices=("all", "round-robin"), default="all",
                    help="every task per scene (all) or tasks in turn per scene (round-robin)")
    pp.add_argument("--k", type=int, default=1, help="num_traj_samples (default 1)")
    pp.add_argument("--run-id", help="run id (default: generated); an existing run's id resumes it")
    pp.add_argument("--runs-dir", default="runs", help="where run manifests live (default ./runs)")
    pp.add_argument("--temperature", type=float, help="default 0 for K=1, the contract's 0.6 for K>1")
    pp.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the contract's)")
    pp.add_argument("--sampling-seed", type=int, help="request seed (default: the worker derives one per request id)")
    pp.add_argument("--max-tokens", type=int, help="generated-token cap for the text tasks")
    pp.add_argument("--ground-truth", action="store_true",
                    help="attach the scene's future egomotion to every request with ego history (the worker "
                         "ignores it outside auto_labeling; sink --requests lands it for ADE)")
    pp.add_argument("--label", type=_kv, action="append", default=[], metavar="KEY=VALUE", help="request label")
    pp.add_argument("--object-store", help="claim-check store root (file:///DIR or DIR)")
    pp.add_argument("--claim-check-threshold", type=_bytes, default=900 * 1024,
                    help="messages above this go through the object store (default 900KiB)")
    pp.add_argument("--json-encoding", action="store_true", help="send JSON instead of msgpack")
    pp.add_argument("--rate", type=float, help="requests per second (default unlimited)")
    pp.add_argument("--max-inflight", type=int, default=64, help="unacknowledged sends (default 64)")
    pp.add_argument("--compression", choices=("gzip", "snappy", "lz4", "zstd"), help="producer compression")
    pp.add_argument("--limit", type=int, help="publish at most this many new requests")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _kafka_args(pp, topics=("request",))

    # -- sink --------------------------------------------------------------------------------
    sp = _command(sub, "sink", "consume results and dead letters into a Parquet lake (exactly once)",
                  "sink --lake lake/", "sink --lake lake/ --until-idle 30 --no-progress")
    sp.add_argument("--lake", required=True, help="lake root directory")
    sp.add_argument("--group-id", default="alpamayo-lake-sink", help="consumer group (default alpamayo-lake-sink)")
    sp.add_argument("--no-dead-letters", action="store_true", help="results only")
    sp.add_argument("--no-results", action="store_true", help="dead letters only")
    sp.add_argument("--samples", action="store_true",
                    help="also the samples table: one row per sample of each result (e.g. --samples)")
    sp.add_argument("--requests", action="store_true",
                    help="also the requests table from the request topic (no images; ego history and ground "
                         "truth as columns, for ADE by a join), e.g. --requests --request-topic alpamayo.requests")
    sp.add_argument("--rotate-rows", type=int, default=10_000, help="records per file and partition (default 10000)")
    sp.add_argument("--rotate-seconds", type=float, default=60.0, help="close a file this long after its first record")
    sp.add_argument("--until-idle", type=float, metavar="S", help="exit after S seconds without records")
    sp.add_argument("--max-records", type=int, help="exit after this many records")
    sp.add_argument("--lock-timeout", type=float, default=120.0, help="wait this long for a partition lock")
    sp.add_argument("--session-timeout-ms", type=int, default=10_000,
                    help="consumer session timeout: how soon a dead sink's partitions move (default 10000)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sp.add_argument("--debug-pause", type=float, default=0.0, help=argparse.SUPPRESS)
    _kafka_args(sp, topics=("request", "result", "dead-letter"))

    # -- audit -------------------------------------------------------------------------------
    au = _command(sub, "audit", "reconcile a run's planned and published requests with the lake",
                  "audit demo-1 --lake lake/", "audit demo-1 --lake lake/ --json | head",
                  description="Reconcile a run's planned and published requests with the lake. Verdict and "
                  "exit status: COMPLETE (0) every planned request has a result; FAILED (1) every one landed, "
                  "some only as dead letters; INCOMPLETE (3) some have not landed (the resume command is "
                  "shown).")
    au.add_argument("run_id", help="the run id publish printed (--run-id)")
    au.add_argument("--lake", required=True, help="lake root directory (as for sink)")
    au.add_argument("--manifest", help="run manifest (default <runs-dir>/<run_id>.jsonl)")
    au.add_argument("--runs-dir", default="runs", help="where run manifests live (default ./runs)")
    au.add_argument("--no-manifest", action="store_true", help="audit the lake alone (no missing ids)")
    au.add_argument("--strict", action="store_true", help="also fail on failed/duplicated/unexpected ids")
    au.add_argument("--json", action="store_true", help="print the report as JSON")

    # -- lake ---------------------------------------------------------------------------------
    lp = _command(sub, "lake", "lake maintenance", "lake compact --lake lake/ --group-id alpamayo-lake-sink")
    lsub = lp.add_subparsers(dest="lake_command", required=True, metavar="compact")
    lc = _command(lsub, "compact", "merge small segment files of finished ranges (safe next to running sinks)",
                  "lake compact --lake lake/ --group-id alpamayo-lake-sink",
                  "lake compact --lake lake/ --target-rows 50000 --bootstrap-servers kafka:9092")
    lc.add_argument("--lake", required=True, help="lake root directory")
    lc.add_argument("--group-id", default="alpamayo-lake-sink",
                    help="the sink's consumer group: only ranges below its committed offsets are merged "
                         "(default alpamayo-lake-sink)")
    lc.add_argument("--target-rows", type=int, default=100_000, help="rows per merged range (default 100000)")
    _kafka_args(lc, topics=())

    # -- dlq ---------------------------------------------------------------------------------
    dp = _command(sub, "dlq", "dead-letter tools: list them by code, replay them after a fix",
                  "dlq list --lake lake/", "dlq replay --lake lake/ --code inference_failed --run-id demo-1")
    dsub = dp.add_subparsers(dest="dlq_command", required=True, metavar="list|replay")
    dl = _command(dsub, "list", "one row per error code: count, retryable, replayed, a sample message",
                  "dlq list --lake lake/", "dlq list --from-topic --run-id demo-1 --json")
    dr = _command(dsub, "replay", "re-publish selected dead letters' original bytes to the request topic",
                  "dlq replay --lake lake/ --code inference_failed --dry-run",
                  "dlq replay --from-topic --retryable-only --limit 100")
    for d in (dl, dr):
        dsrc = d.add_mutually_exclusive_group(required=True)
        dsrc.add_argument("--lake", help="read dead letters from the lake")
        dsrc.add_argument("--from-topic", nargs="?", const="", metavar="TOPIC",
                          help="read dead letters from the topic (default the dead-letter topic)")
        d.add_argument("--run-id", action="append", default=[], help="run id (repeatable)")
        d.add_argument("--runs-dir", default="runs", help="replay ledger directory (default ./runs)")
    dl.add_argument("--json", action="store_true", help="the rows as JSON")
    _kafka_args(dl, topics=("dead-letter",))
    dr.add_argument("--code", action="append", default=[], help="error code (repeatable)")
    dr.add_argument("--request-id", action="append", default=[], help="request id (repeatable)")
    dr.add_argument("--retryable-only", action="store_true", help="only claim_check_failed/inference_failed/internal_error")
    dr.add_argument("--limit", type=int, help="replay at most this many")
    dr.add_argument("--to-topic", help="default: the request topic")
    dr.add_argument("--force", action="store_true", help="replay again what the ledger says was replayed")
    dr.add_argument("--dry-run", action="store_true", help="list what would be replayed, send nothing")
    _kafka_args(dr, topics=("request", "dead-letter"))

    # -- qualify -----------------------------------------------------------------------------
    qp = _command(sub, "qualify", "DFlash2 vs its baseline profile, per task, offline through the engine",
                  "qualify --out qual/", "qualify --checkpoint ckpt/ --head head/ --precision fp8 --device cuda")
    qp.add_argument("--out", default="qualification", help="output directory (default ./qualification)")
    qp.add_argument("--checkpoint", help="checkpoint dir (default: the demo checkpoint)")
    hg = qp.add_mutually_exclusive_group()
    hg.add_argument("--head", help="DFlash2 head dir (default: the demo head)")
    hg.add_argument("--random-head", action="store_true", help="untrained head (plumbing check)")
    qp.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="bf16 vs bf16-dflash2, or fp8")
    qp.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    qp.add_argument("--fp32", action="store_true", help="compute in fp32")
    qp.add_argument("--scenes", type=int, help="scenes per task (default 8; with --uncertainty 64)")
    qp.add_argument("--seed", type=int, default=0, help="first synthetic scene seed (default 0)")
    qp.add_argument("--scenes-dir", help="scene files instead of synthetic scenes")
    qp.add_argument("--image-size", type=_size2, default=None,
                    help="synthetic image WxH (default: worker.scenes.DEFAULT_IMAGE_SIZE, what the shipped demo model was trained on)")
    qp.add_argument("--tasks", type=_tasks, default=list(TASK_CHOICES), help="default all five")
    qp.add_argument("--repeats", type=int, default=1, help="timed repeats per scene (default 1)")
    qp.add_argument("--k", type=int, default=1, help="num_traj_samples (default 1)")
    qp.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    qp.add_argument("--max-tokens", type=int, help="cap for the text tasks")
    qp.add_argument("--trajectory-max-new", type=int, help="reasoning cap for trajectory (default 256)")
    qp.add_argument("--trajectory-atol", type=float, default=0.05,
                    help="metres within which the profiles' trajectories agree (default 0.05)")
    qp.add_argument("--cache-root", help="where demo checkpoint/head are cached (default ALPAMAYO_CACHE)")
    qp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    qp.add_argument("--uncertainty", action="store_true",
                    help="instead: calibrate the results' uncertainty against minADE on held-out synthetic scenes "
                         "(AUROC for minADE > 2 m, Spearman) at each of --ks")
    qp.add_argument("--ks", type=lambda t: [int(x) for x in t.split(",")], default=[3, 6],
                    help="with --uncertainty: K values (default 3,6)")

    # -- report ------------------------------------------------------------------------------
    rp = _command(sub, "report", "summary and plots over a lake", "report --lake lake/ --out report/",
                  "report --lake lake/ --run-id demo-1")
    rp.add_argument("--lake", required=True, help="lake root directory (as for sink)")
    rp.add_argument("--out", default="report", help="output directory (default ./report)")
    rp.add_argument("--run-id", help="one run only (default: every run in the lake)")

    rp.add_argument("--force", action="store_true",
                    help="overwrite an earlier report in --out (without it, an existing report is refused)")

    # -- review ------------------------------------------------------------------------------
    vp = _command(sub, "review", "a run's doubtful results (uncertainty at or above a threshold) and their plots",
                  "review --lake lake/ --run-id demo-1 --out review/", "review --lake lake/ --threshold 0.7 --limit 10")
    vp.add_argument("--lake", required=True, help="the lake the sink wrote")
    vp.add_argument("--run-id", help="only this run (default: every run in the lake)")
    vp.add_argument("--out", default="review", help="folder for the plots, review.md and review.json")
    vp.add_argument("--threshold", type=float, help="default ALPAMAYO_REVIEW_THRESHOLD (0.5)")
    vp.add_argument("--scenes-dir", help="scene files with the ground truth (synthetic scenes are regenerated)")
    vp.add_argument("--limit", type=int, help="plot at most this many (most doubtful first)")

    # -- scenes ------------------------------------------------------------------------------
    sc = _command(sub, "scenes", "write synthetic scene files (a source for publish --scenes-dir)",
                  "scenes --out scenes/ --n 20", "scenes --out scenes/ --n 4 --image-size 1920x1080 --image-format jpeg")
    sc.add_argument("--out", required=True, help="directory to write *.msgpack scene files into")
    sc.add_argument("--n", type=int, required=True, help="how many scenes")
    sc.add_argument("--seed", type=int, default=0, help="first scene seed (default 0)")
    sc.add_argument("--image-size", type=_size2, default=None,
                    help="image WxH (default: worker.scenes.DEFAULT_IMAGE_SIZE, what the shipped demo model was trained on)")
    sc.add_argument("--image-format", choices=("png", "jpeg"), default="png", help="image format (default png)")
    return ap


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def cmd_topics(args) -> int:
    from producer_tools import topics as T

    kafka = _kafka(args)
    if args.topics_command == "create":
        rf = args.replication_factor
        if rf is None:
            rf = min(3, asyncio.run(T.broker_count(kafka)))
        plans = T.plan_topics(kafka, partitions=args.partitions, replication_factor=rf,
                              max_message_bytes=args.max_message_bytes, retention_ms=args.retention_ms,
                              dead_letter_retention_ms=args.dead_letter_retention_ms,
                              compact_results=args.compact_results, extra=dict(args.config))
        res = asyncio.run(T.create_topics(kafka, plans))
        for r, p in zip(res, plans):
            print(f"{r['name']} ({r['role']}): {r['status']}"
                  + (f" partitions={p['partitions']} replication={p['replication_factor']} {p['configs']}"
                     if r["status"] == "created" else ""))
        return 0
    rows = asyncio.run(T.describe_topics(kafka, args.names or None))
    if args.json:
        _print_json(rows)
    else:
        print(T.format_description(rows))
    return 0 if all(r["exists"] for r in rows) else 1


def _resume_command(argv: Sequence[str], run_id: str) -> str:
    """The publish command line again with its --run-id and without --limit: what finishes the run."""
    out, skip = ["alpamayo-producer"], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--limit", "--run-id"):
            skip = True
        elif not a.startswith(("--limit=", "--run-id=")):
            out.append(a)
    return shlex.join(out + ["--run-id", run_id])


def cmd_publish(args) -> int:
    from producer_tools import publish as P
    from producer_tools.scene_sources import iter_manifest, iter_scene_dir, iter_synthetic, manifest_tasks

    kafka = _kafka(args)
    scene_tasks = None
    if args.scenes_dir:
        total, items = iter_scene_dir(args.scenes_dir)
        source = f"scenes-dir:{args.scenes_dir}"
    elif args.manifest:
        total, items = iter_manifest(args.manifest)
        scene_tasks = manifest_tasks(args.manifest)
        source = f"manifest:{args.manifest}"
    else:
        from worker.scenes import DEFAULT_IMAGE_SIZE

        size = args.image_size or DEFAULT_IMAGE_SIZE
        total, items = iter_synthetic(args.synthetic, args.seed, size, args.image_format)
        source = f"synthetic:{args.synthetic}@{args.seed}:{size[0]}x{size[1]}:{args.image_format}"
    if not 1 <= args.k <= 16:
        die("--k must be in 1..16")
    if args.k > 1 and args.temperature == 0:
        die("--k > 1 needs --temperature > 0")
    run_id = args.run_id or new_run_id()
    opts = P.PublishOptions(
        tasks=args.tasks, mix=args.mix, k=args.k, run_id=run_id, runs_dir=args.runs_dir,
        temperature=args.temperature, top_p=args.top_p, sampling_seed=args.sampling_seed,
        max_tokens=args.max_tokens, labels=dict(args.label), ground_truth=args.ground_truth,
        claim_check_threshold=args.claim_check_threshold,
        object_store=args.object_store,
        content_type=S.CONTENT_TYPE_JSON if args.json_encoding else S.CONTENT_TYPE_MSGPACK,
        rate=args.rate, max_inflight=args.max_inflight, compression=args.compression, limit=args.limit,
        progress=not args.no_progress, source=source,
        planned=P.planned_total(scene_tasks or [None] * total, args.tasks, args.mix),
        resume_command=_resume_command(args.argv, run_id))
    summary = asyncio.run(P.publish(kafka, items, opts, total_scenes=total))
    _print_json(summary)
    return 0


def cmd_sink(args) -> int:
    from producer_tools.sink import SinkOptions, run_sink

    kafka = _kafka(args)
    opts = SinkOptions(lake=args.lake, group_id=args.group_id, include_results=not args.no_results,
                       include_dead_letters=not args.no_dead_letters, include_samples=args.samples,
                       include_requests=args.requests, rotate_rows=args.rotate_rows,
                       rotate_seconds=args.rotate_seconds, until_idle=args.until_idle, max_records=args.max_records,
                       lock_timeout=args.lock_timeout, session_timeout_ms=args.session_timeout_ms,
                       progress=not args.no_progress, debug_pause=args.debug_pause)
    if opts.rotate_rows < 1:
        die("--rotate-rows must be >= 1")
    stats = asyncio.run(run_sink(kafka, opts))
    _print_json(stats)
    return 0


def cmd_audit(args) -> int:
    from producer_tools.audit import audit_run, format_report

    rep = audit_run(args.run_id, args.lake, manifest_path=args.manifest, runs_dir=args.runs_dir,
                    use_manifest=not args.no_manifest)
    if args.json:
        _print_json(rep.to_json())
    else:
        print(format_report(rep))
    return rep.exit_code(strict=args.strict)


def cmd_dlq(args) -> int:
    from producer_tools import dlq as D

    kafka = _kafka(args, check=not (args.lake and (args.dlq_command == "list" or args.dry_run)))
    if args.lake:
        items = D.from_lake(args.lake, run_id=args.run_id[0] if len(args.run_id) == 1 else None)
    else:
        items = asyncio.run(D.from_topic(kafka, args.from_topic or None))
    if args.dlq_command == "list":
        rows = D.by_code(D.select(items, run_ids=args.run_id), args.runs_dir)
        if args.json:
            _print_json(rows)
        else:
            print(D.format_by_code(rows))
        return 0
    chosen = D.select(items, codes=args.code, run_ids=args.run_id, request_ids=args.request_id,
                      retryable_only=args.retryable_only, limit=args.limit)
    summary = asyncio.run(D.replay(kafka, chosen, to_topic=args.to_topic, runs_dir=args.runs_dir, force=args.force,
                                   dry_run=args.dry_run))
    summary["available"] = len(items)
    _print_json(summary)
    return 0


def cmd_qualify(args) -> int:
    if args.uncertainty:
        return _qualify_uncertainty(args)
    from producer_tools.qualify import QualifyOptions, qualify

    opts = QualifyOptions(
        out=args.out, checkpoint=args.checkpoint, head=args.head, random_head=args.random_head,
        precision=args.precision, device=args.device, fp32=args.fp32, scenes=args.scenes or QualifyOptions.scenes,
        seed=args.seed,
        scenes_dir=args.scenes_dir, image_size=args.image_size or QualifyOptions.image_size, tasks=args.tasks, repeats=args.repeats, k=args.k,
        temperature=args.temperature, max_tokens=args.max_tokens, trajectory_max_new=args.trajectory_max_new,
        trajectory_atol=args.trajectory_atol,
        progress=not args.no_progress, cache_root=args.cache_root)
    s = qualify(opts)
    print(s["table"])
    print()
    print(f"report: {s['markdown']}")
    for k, v in s["plots"].items():
        print(f"{k}: {v}")
    return 0


def _qualify_uncertainty(args) -> int:
    from producer_tools.calibration import CalibrationOptions, calibrate

    s = calibrate(CalibrationOptions(out=args.out, checkpoint=args.checkpoint, device=args.device,
                                     scenes=args.scenes or CalibrationOptions.scenes,
                                     seed=args.seed, ks=args.ks, image_size=args.image_size or CalibrationOptions.image_size,
                                     progress=not args.no_progress, cache_root=args.cache_root,
                                     trajectory_max_new=args.trajectory_max_new))
    print(s["table"])
    print()
    print(f"report: {s['markdown']}")
    return 1 if any(r["meets_bar"] is False for r in s["per_k"]) else 0


def cmd_review(args) -> int:
    from producer_tools.review import review_run

    s = review_run(args.lake, args.out, run_id=args.run_id, threshold=args.threshold, scenes_dir=args.scenes_dir,
                   limit=args.limit)
    print(f"{s['doubtful']} doubtful results (uncertainty >= {s['threshold']:g}); plots in {args.out}")
    print(s["table"])


def cmd_lake(args) -> int:
    from producer_tools.compact import committed_offsets, compact_lake

    if not (Path(args.lake) / "_sink" / "ranges").is_dir():
        die(f"--lake {args.lake}: no sink range index there ({args.lake}/_sink/ranges): point --lake at a sink's lake")
    committed = asyncio.run(committed_offsets(_kafka(args), args.group_id))
    _print_json(compact_lake(args.lake, committed, target_rows=args.target_rows))
    return 0


def cmd_report(args) -> int:
    from producer_tools.report import lake_report

    s = lake_report(args.lake, args.out, run_id=args.run_id, force=args.force)
    print(open(s["markdown"]).read())
    return 0


def cmd_scenes(args) -> int:
    from worker.scenes import DEFAULT_IMAGE_SIZE, write_scenes

    paths = write_scenes(args.out, args.n, args.seed, args.image_size or DEFAULT_IMAGE_SIZE,
                         image_format=args.image_format)
    print(f"wrote {len(paths)} scene files to {args.out}")
    return 0


COMMANDS = {"topics": cmd_topics, "publish": cmd_publish, "sink": cmd_sink, "audit": cmd_audit, "dlq": cmd_dlq,
            "qualify": cmd_qualify, "report": cmd_report, "review": cmd_review, "lake": cmd_lake,
            "scenes": cmd_scenes}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.verbose < 2:
        logging.getLogger("aiokafka").setLevel(max(level, logging.WARNING))
        log_filter.install()
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()                   # a closed pipe shows here, not at interpreter exit
        return code
    except (ToolError, ConfigError) as exc:
        die(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                  # `alpamayo-producer audit ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                           # 128 + SIGPIPE, as a shell pipeline reports it
    except Exception as exc:  # Kafka errors: one line, not a traceback
        from aiokafka.errors import KafkaError

        if isinstance(exc, KafkaError):
            die(f"Kafka: {type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    sys.exit(main())
