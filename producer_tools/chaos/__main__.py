"""``python -m producer_tools.chaos SCENARIO ...``: the reliability harness's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from producer_tools import chaos
from producer_tools.chaos.broker import Broker
from producer_tools.chaos.figures import Figures, format_table
from producer_tools.chaos.multi_sink import run_multi_sink
from producer_tools.chaos.pipeline import DEFAULT_PARTITIONS, GUARANTEES, _work_dir
from producer_tools.chaos.poison import run_poison
from producer_tools.chaos.scenarios import run_broker_restart, run_crash, run_fuzz, run_leader_kill, run_soak
from producer_tools.chaos.takeover import run_same_host, run_zombie

log = logging.getLogger("alpamayo.chaos")


def _guarantees(text: str) -> list[str]:
    if text == "both":
        return list(GUARANTEES)
    if text not in GUARANTEES:
        raise argparse.ArgumentTypeError(f"use exactly_once, at_least_once or both, not {text!r}")
    return [text]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m producer_tools.chaos",
                                 description=chaos.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["crash", "broker-restart", "leader-kill", "fuzz", "soak", "zombie",
                                        "same-host", "poison", "multi-sink"])
    ap.add_argument("--scenes", type=int, default=None, help="scenes to publish (crash/broker faults/poison/multi-sink)")
    ap.add_argument("--kills", type=int, default=None, help="crash: worker SIGKILLs (default 3)")
    ap.add_argument("--faults", type=int, default=12,
                    help="multi-sink: random sink faults (SIGKILL, SIGTERM, restart; default 12)")
    ap.add_argument("--sink-kills", type=int, default=0, help="crash: sink SIGKILLs as well (default 0)")
    ap.add_argument("--review-threshold", type=float, default=None,
                    help="crash: K = 2 requests and a review topic at this threshold, checked against the lake")
    ap.add_argument("--guarantee", type=_guarantees, default=None,
                    help="exactly_once | at_least_once | both (default: both for crash, exactly_once otherwise; "
                         "at_least_once for fuzz)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS)
    ap.add_argument("--reasoning-tokens", type=int, default=4, help="ALPAMAYO_MAX_REASONING_TOKENS (default 4)")
    ap.add_argument("--batch-size", type=int, default=4, help="ALPAMAYO_MAX_BATCH_SIZE (default 4)")
    ap.add_argument("--down-s", type=float, default=None, help="broker faults: seconds down (default 5 / 10)")
    ap.add_argument("--hard", action="store_true", help="broker-restart: SIGKILL the node instead of stopping it")
    ap.add_argument("--bad", type=int, default=10_000, help="fuzz: bad messages (default 10000)")
    ap.add_argument("--good", type=int, default=200, help="fuzz: good messages (default 200)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=200.0, help="fuzz: allowed worker RSS growth")
    ap.add_argument("--minutes", type=float, default=30.0, help="soak: duration (default 30)")
    ap.add_argument("--rate", type=float, default=2.0, help="soak: scenes per second (default 2)")
    ap.add_argument("--checkpoint", help="NIM_FT_CHECKPOINT for the worker (default: the cached tiny random one)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="ALPAMAYO_DEVICE (default cpu)")
    ap.add_argument("--bootstrap-servers", help="use this broker (crash/fuzz/soak) instead of starting a local one")
    ap.add_argument("--work-dir", help="logs, lake, run manifests (default: a temp dir, kept on failure)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--timeout", type=float, default=1800.0, help="settle timeout per run (s)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument("-v", "--verbose", action="count", default=0)
    return ap


async def _main(args) -> list[Figures]:
    sc = args.scenario
    guarantees = args.guarantee or (list(GUARANTEES) if sc == "crash" else
                                    ["at_least_once"] if sc == "fuzz" else ["exactly_once"])
    work = _work_dir(args.work_dir, sc)
    args._work = work
    print(f"# work dir: {work}", file=sys.stderr)
    nodes = 3 if sc == "leader-kill" else 1
    if args.bootstrap_servers and sc in ("broker-restart", "leader-kill"):
        raise SystemExit(f"error: {sc} needs a local cluster the harness controls: leave out --bootstrap-servers")
    if args.checkpoint:
        os.environ["ALPAMAYO_CHAOS_CHECKPOINT"] = str(Path(args.checkpoint).resolve())
    os.environ["ALPAMAYO_CHAOS_DEVICE"] = args.device
    if args.bootstrap_servers:
        broker = Broker(args.bootstrap_servers)
    else:
        broker = await Broker.start_local(f"chaos-{sc}-{os.getpid()}", nodes=nodes)
    figs = []
    try:
        for g in guarantees:
            common = dict(guarantee=g, work=work, partitions=args.partitions, timeout=args.timeout)
            if sc == "crash":
                fig = await run_crash(broker, scenes=args.scenes or 1000,
                                      kills=10 if args.kills is None else args.kills, sink_kills=args.sink_kills,
                                      seed=args.seed, reasoning_tokens=args.reasoning_tokens,
                                      batch_size=args.batch_size, review_threshold=args.review_threshold, **common)
            elif sc == "broker-restart":
                fig = await run_broker_restart(broker, scenes=args.scenes or 300, down_s=args.down_s or 5.0,
                                               hard=args.hard, reasoning_tokens=args.reasoning_tokens,
                                               batch_size=args.batch_size, **common)
            elif sc == "leader-kill":
                fig = await run_leader_kill(broker, scenes=args.scenes or 300, down_s=args.down_s or 10.0,
                                            reasoning_tokens=args.reasoning_tokens, batch_size=args.batch_size,
                                            **common)
            elif sc == "zombie":
                fig = await run_zombie(broker, scenes=args.scenes or 200, reasoning_tokens=args.reasoning_tokens,
                                       **common)
            elif sc == "same-host":
                fig = await run_same_host(broker, scenes=args.scenes or 200, reasoning_tokens=args.reasoning_tokens,
                                          **common)
            elif sc == "multi-sink":
                fig = await run_multi_sink(broker, scenes=args.scenes or 600, faults=args.faults, seed=args.seed,
                                           work=work, partitions=args.partitions, timeout=args.timeout)
            elif sc == "fuzz":
                fig = await run_fuzz(broker, bad=args.bad, good=args.good, seed=args.seed,
                                     max_rss_growth_mb=args.max_rss_growth_mb, **common)
            elif sc == "poison":
                fig = await run_poison(broker, scenes=args.scenes or 40, **common)
            else:
                fig = await run_soak(broker, minutes=args.minutes, rate=args.rate,
                                     reasoning_tokens=args.reasoning_tokens, batch_size=args.batch_size, **common)
            figs.append(fig)
            print(format_table([fig]), file=sys.stderr, flush=True)
    finally:
        await broker.close()
    return figs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL if args.verbose < 2 else logging.DEBUG)
    if args.verbose == 0:
        log.setLevel(logging.INFO)
    t0 = time.monotonic()
    try:
        figs = asyncio.run(_main(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_table(figs))
    print(f"\n({args.scenario}: {time.monotonic() - t0:.0f}s in all; python -m producer_tools.chaos "
          f"{' '.join(sys.argv[1:] if argv is None else argv)})")
    if args.json:
        print(json.dumps([f.to_json() for f in figs], indent=2, default=str))
    ok = all(f.ok for f in figs)
    work = getattr(args, "_work", None)
    if work is not None and ok and not args.keep and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    elif work is not None:
        print(f"# work dir kept: {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
