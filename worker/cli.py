"""``alpamayo-worker``: serve, run one scene, build the demo checkpoint, check a DFlash2 head.

``alpamayo-worker --help`` does not import torch: the modules that import it (worker.engine,
worker.model.*, worker.dflash.*) are imported inside the commands that use them.

Exit codes: 0 ok; 1 failure (a head that fails its checks, a scene that dead-letters, a crash);
2 refused configuration (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import textwrap
import time

import schemas as S
from worker import log_filter
from worker.config import VARIABLES, ConfigError, load_settings
from worker.errors import Refusal
from worker.intake import Intake, Job, RawRecord
from worker.process import serve

__all__ = ["main"]

PROG = "alpamayo-worker"


def _settings_or_exit():
    try:
        return load_settings()
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    log_filter.install()


# --------------------------------------------------------------------------------------------
# serve
# --------------------------------------------------------------------------------------------


def cmd_serve(_args) -> int:
    settings = _settings_or_exit()
    _logging(settings.log_level)
    return serve(settings)


# --------------------------------------------------------------------------------------------
# run-scene
# --------------------------------------------------------------------------------------------


def cmd_run_scene(args) -> int:
    # the scene generator (PIL, msgspec files) stays out of the serve command's imports
    from worker.scenes import read_scene
    from worker.scenes.request import build_request

    settings = _settings_or_exit()
    _logging(settings.log_level)
    k_values = tuple(sorted(set(settings.k_values) | {args.k}))
    settings = dataclasses.replace(settings, k_values=k_values)
    from worker.engine import Engine     # torch

    scene = read_scene(args.path)
    req = build_request(scene, args.task, args.k, temperature=args.temperature, seed=args.seed,
                        max_tokens=args.max_tokens, question=args.question)
    value, headers = S.encode_request(req)
    engine = Engine(settings)
    t0 = time.perf_counter()
    engine.prepare()
    engine.load(warmup=False)
    if settings.max_reasoning_tokens is not None:
        engine.runtime.trajectory_max_new = settings.max_reasoning_tokens
    engine.runtime.warmup([args.k])
    print(f"# loaded {engine.checkpoint} ({settings.profile}) and warmed K={args.k} in "
          f"{time.perf_counter() - t0:.1f}s")
    intake = Intake(settings, _seed)
    received = time.time()
    job = intake.process(RawRecord("run-scene", 0, 0, value, S.request_key(req), tuple(headers)), received)
    if not isinstance(job, Job):
        print(f"dead letter: {job.error_code.value} at {job.error_field}: {job.error_message}")
        return 1
    start = time.time()
    res = engine.infer([job.scene])[0]
    if res.error:
        print(f"dead letter: {res.error[0]}: {res.error[1]}")
        return 1
    res.timings_ms["image_prep"] = res.timings_ms.get("image_prep", 0.0) + job.image_prep_ms
    result = engine.to_result(req, res, None, (start - received) * 1000.0, (time.time() - received) * 1000.0,
                              job.warnings)
    _print_result(result, scene)
    return 0


def _seed(request_id: str) -> int:
    from worker.engine import default_seed     # torch

    return default_seed(request_id)


def _print_result(result, scene) -> None:
    print(f"request {result.request_id}: task {result.task}, K={result.num_samples}, "
          f"profile {result.model.profile}")
    for i, out in enumerate(result.outputs):
        text = result.metrics.reasoning_texts[i] if i < len(result.metrics.reasoning_texts) else out.text
        print(f"  sample {i} ({result.metrics.generated_tokens[i]} tokens): {text!r}")
        if out.meta_action is not None:
            m = out.meta_action
            print(f"    meta action: longitudinal={m.longitudinal} lateral={m.lateral} lane={m.lane}")
        if out.boxes:
            print(f"    boxes: {[(b.label, b.bbox_2d) for b in out.boxes]}")
        if out.auto_label is not None:
            print(f"    auto label: {out.auto_label}")
    if result.answer is not None:
        print(f"  answer: {result.answer!r}")
    if result.pred_trajectories is not None:
        gt = scene.ego_future_xyz
        for i, traj in enumerate(result.pred_trajectories):
            end = traj[-1]
            length = sum(math.dist(a, b) for a, b in zip([[0.0, 0.0, 0.0]] + traj[:-1], traj))
            ade = sum(math.dist(p[:2], g[:2]) for p, g in zip(traj, gt)) / len(traj)
            print(f"  trajectory {i}: {len(traj)} points, end ({end[0]:.2f}, {end[1]:.2f}) m, "
                  f"path {length:.1f} m, ADE vs planner {ade:.2f} m")
    t = result.metrics.timings
    print(f"  timings ms: queue {t.queue_ms:.1f}, image_prep {t.image_prep_ms:.1f}, prefill {t.prefill_ms:.1f}, "
          f"decode {t.decode_ms:.1f}, diffusion {t.diffusion_ms:.1f}, total {t.total_ms:.1f}")
    spec = result.metrics.speculative_decoding
    if spec is not None:
        print(f"  speculative: {spec.num_spec_steps} steps, {spec.num_accepted_draft_tokens}/"
              f"{spec.num_draft_tokens} drafts accepted ({spec.draft_acceptance_rate:.2f}), "
              f"mean acceptance length {spec.mean_acceptance_length:.2f}")
    for w in result.warnings:
        print(f"  warning: {w}")


# --------------------------------------------------------------------------------------------
# check-head, demo-checkpoint
# --------------------------------------------------------------------------------------------


def cmd_check_head(args) -> int:
    settings = _settings_or_exit()
    # torch
    from worker.dflash.head import check_head
    from worker.engine import resolve_checkpoint
    from worker.model.checkpoint import validate_layout

    try:
        ckpt = resolve_checkpoint(settings)
        cfg, _ = validate_layout(ckpt)
        hc = check_head(args.dir, cfg)
    except Refusal as exc:         # a refused checkpoint or head
        print(exc.line())
        return 1
    print(f"ok: {args.dir} is a DFlash2 head for {ckpt} (block size {hc.block_size}, "
          f"target layers {list(hc.target_layer_ids)})")
    return 0


def cmd_demo_checkpoint(argv: list[str]) -> int:
    from worker.demo.build import main as build_main     # training code: never imported by serve

    rc = build_main(argv)
    return int(rc or 0)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _variables_help() -> str:
    """Every environment variable with its meaning and default (worker.config.VARIABLES)."""
    lines = ["environment variables (worker/config.py):"]
    for name, text in VARIABLES.items():
        lines.append(f"  {name}")
        lines += textwrap.wrap(text, 96, initial_indent="      ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="Alpamayo 2 Super Kafka GPU worker "
                                 "(configuration: environment variables, see README)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="consume scene jobs from Kafka and publish results (one process per GPU)",
                   description=textwrap.fill("Consume scene jobs from Kafka and publish results (one process "
                                             "per GPU). Configured by environment variables only; a bad value "
                                             "stops startup with one line naming the variable (exit 2).", 100),
                   epilog=_variables_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    rs = sub.add_parser("run-scene", help="run one scene file end to end through the engine and print the result")
    rs.add_argument("path", help="scene file (worker.scenes.write_scene)")
    rs.add_argument("--task", default="trajectory",
                    choices=S.TASKS)
    rs.add_argument("--k", type=int, default=1, help="num_traj_samples (default 1)")
    rs.add_argument("--temperature", type=float, default=None, help="default 0 for K=1, else 0.6")
    rs.add_argument("--seed", type=int, default=None)
    rs.add_argument("--max-tokens", type=int, default=None, help="text tasks: generated-token cap")
    rs.add_argument("--question", default=None, help="vqa/grounding question (default: the scene's)")
    sub.add_parser("demo-checkpoint", add_help=False,
                   help="build (or reuse) the embedded demo checkpoint (arguments go to worker.demo.build)")
    ch = sub.add_parser("check-head", help="check a DFlash2 head directory against the configured checkpoint")
    ch.add_argument("dir", help="head directory (as for NIM_ALPAMAYO_SPECULATIVE_MODEL)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo-checkpoint":
        return cmd_demo_checkpoint(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "run-scene":
            try:
                return cmd_run_scene(args)
            except Refusal as exc:          # as serve: one line saying what to change
                print(f"alpamayo-worker: {exc.line()}", file=sys.stderr, flush=True)
                return 2
        if args.command == "check-head":
            return cmd_check_head(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 2


if __name__ == "__main__":
    sys.exit(main())
