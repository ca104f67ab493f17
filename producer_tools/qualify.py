"""``alpamayo-producer qualify``: DFlash2 against its matching baseline, offline through the engine.

The seed's Qualification section: compare each DFlash2 profile with its matching baseline on
representative requests of every task served; use the baseline where DFlash2 does not improve
end-to-end latency; send the first request of a given K once, untimed, before measuring.

How: one :class:`~worker.model.runtime.AlpamayoRuntime` is loaded with the DFlash2 speculator
(same weights for both profiles); the baseline profile runs the same runtime with its speculator
detached. For every task, one warm-up request per profile runs untimed; then every scene runs
through both profiles (alternating which goes first, ``--repeats`` times), one request per batch,
timed end to end (``AlpamayoRuntime.run`` wall time, CUDA synchronised).

Per task: latency p50/p95 of both profiles and the speedup (baseline p50 / dflash2 p50), output
agreement (identical generated token ids and texts, trajectories within ``--trajectory-atol`` metres;
expected 100% at temperature 0; the largest trajectory difference is reported too),
DFlash2 acceptance rate (accepted / drafted) and mean acceptance length (1 + accepted / verify
steps), and a verdict. DFlash2 only drafts for ``trajectory``; the other tasks decode the
baseline way on a dflash2 profile, so their speedup shows the profile's overhead (about 1).

Outputs in ``--out``: ``qualification.md`` (the table), ``qualification.json`` (summary and
per-request measurements), ``latency_cdf.png``, ``acceptance_histogram.png``,
``bev_trajectories.png`` (dflash2 predictions over the scenes' ground truth) and
``bev_baseline.png``.

Checkpoint: ``--checkpoint DIR`` or the shipped demo checkpoint (``worker.demo_cache``). Head:
``--head DIR``, or the shipped demo head, or with
``--random-head`` an untrained head of the right shape (acceptance is then near 0 and only the
plumbing is qualified).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from producer_tools.common import ToolError, percentile
from worker.demo_cache import demo_checkpoint, demo_head
from schemas import TASKS as ALL_TASKS
from worker.scenes import DEFAULT_IMAGE_SIZE, bev_plot, generate_scene, read_scene
from worker.scenes.request import runtime_request

__all__ = ["QualifyOptions", "qualify", "format_table", "random_head"]


@dataclass
class QualifyOptions:
    out: str = "qualification"
    checkpoint: str | None = None
    head: str | None = None
    random_head: bool = False
    precision: str = "bf16"
    device: str | None = None
    fp32: bool = False                      # compute in fp32 (CPU default anyway)
    scenes: int = 8
    seed: int = 0
    scenes_dir: str | None = None
    image_size: tuple[int, int] = DEFAULT_IMAGE_SIZE
    tasks: Sequence[str] = ALL_TASKS
    repeats: int = 1
    k: int = 1
    temperature: float = 0.0
    max_tokens: int | None = None           # cap for the text tasks (None: the runtime's defaults)
    trajectory_atol: float = 0.05           # metres: trajectories closer than this agree
    trajectory_max_new: int | None = None   # reasoning cap for trajectory (None: 256 as released)
    bev_scenes: int = 9
    progress: bool = True
    cache_root: str | None = None


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------


def random_head(checkpoint: str | Path, out_dir: str | Path, seed: int = 1) -> Path:
    """An untrained DFlash2 head matching ``checkpoint`` (plumbing checks only)."""
    from worker.dflash.draft import write_random_head  # torch: heavy, only when a head is written

    return write_random_head(checkpoint, out_dir, seed, note="random head written by alpamayo-producer qualify")


def _resolve(opts: QualifyOptions) -> tuple[Path, Path, str]:
    if opts.checkpoint:
        ckpt = Path(opts.checkpoint)
    else:
        ckpt = demo_checkpoint()                      # shipped, verified against its manifest
    if opts.head:
        return ckpt, Path(opts.head), "custom"
    if opts.random_head:
        return ckpt, random_head(ckpt, Path(opts.out) / "random-head"), "random"
    return ckpt, demo_head(ckpt, opts.cache_root), "demo"


def _load_scenes(opts: QualifyOptions) -> list:
    if opts.scenes_dir:
        paths = sorted(Path(opts.scenes_dir).glob("*.msgpack"))[: opts.scenes]
        if not paths:
            raise ToolError(f"no *.msgpack scene files in {opts.scenes_dir}")
        return [read_scene(p) for p in paths]
    return [generate_scene(opts.seed + i, opts.image_size) for i in range(opts.scenes)]


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    scene_id: str
    task: str
    repeat: int
    baseline_ms: float
    dflash2_ms: float
    agree: bool
    disagreement: str | None
    text_agree: bool
    trajectory_max_diff_m: float | None
    baseline_tokens: int
    dflash2_tokens: int
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_histogram: list[int] = field(default_factory=list)
    baseline_stages_ms: dict[str, float] = field(default_factory=dict)
    dflash2_stages_ms: dict[str, float] = field(default_factory=dict)


def _timed(rt, req, device) -> tuple[Any, float]:
    import torch  # heavy: loaded only when a qualification runs

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    res = rt.run([req])[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t0) * 1000.0
    if res.error is not None:
        raise ToolError(f"{req.request_id}: the runtime failed: {res.error[0]}: {res.error[1]}")
    return res, ms


def _compare(a, b, atol: float) -> tuple[str | None, bool, float | None]:
    """(disagreement or None, texts identical, max trajectory difference in metres)."""
    text = None
    if a.token_ids != b.token_ids:
        text = "token ids differ"
        for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                text = f"sample {j}: token ids differ from position {n}"
                break
    elif a.texts != b.texts:
        text = "texts differ"
    diff = None
    if (a.trajectories is None) != (b.trajectories is None):
        return text or "one profile has no trajectories", text is None, None
    if a.trajectories is not None:
        diff = float(np.abs(np.asarray(a.trajectories, np.float64) - np.asarray(b.trajectories, np.float64)).max())
    if text is not None:
        return text, False, diff
    if diff is not None and diff > atol:
        return f"trajectories differ by up to {diff:.3g} m (> {atol} m)", True, diff
    return None, True, diff


def _summarise(ms: list[Measurement], task: str, speculative_task: bool) -> dict[str, Any]:
    base = [m.baseline_ms for m in ms]
    spec = [m.dflash2_ms for m in ms]
    b50, b95 = percentile(base, 50), percentile(base, 95)
    s50, s95 = percentile(spec, 50), percentile(spec, 95)
    steps = sum(m.spec_steps for m in ms)
    drafted = sum(m.spec_drafted for m in ms)
    accepted = sum(m.spec_accepted for m in ms)
    hist: list[int] = []
    for m in ms:
        for i, c in enumerate(m.spec_histogram):
            if i >= len(hist):
                hist.extend([0] * (i + 1 - len(hist)))
            hist[i] += c
    speedup = b50 / s50 if s50 > 0 else float("nan")
    row = {
        "task": task, "n": len(ms), "baseline_p50_ms": b50, "baseline_p95_ms": b95,
        "dflash2_p50_ms": s50, "dflash2_p95_ms": s95, "speedup_p50": speedup,
        "speedup_p95": b95 / s95 if s95 > 0 else float("nan"),
        "agreement": sum(m.agree for m in ms) / len(ms) if ms else float("nan"),
        "text_agreement": sum(m.text_agree for m in ms) / len(ms) if ms else float("nan"),
        "trajectory_max_diff_m": max((m.trajectory_max_diff_m for m in ms if m.trajectory_max_diff_m is not None),
                                     default=None),
        "speculative": speculative_task and steps > 0,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1.0 + accepted / steps if steps else None,
        "spec_steps": steps, "drafted": drafted, "accepted": accepted, "acceptance_histogram": hist,
        "mean_tokens": float(np.mean([m.baseline_tokens for m in ms])) if ms else 0.0,
    }
    # DFlash2 can only pay off where it drafts; elsewhere a "speedup" is measurement noise
    row["verdict"] = "dflash2" if row["speculative"] and speedup > 1.0 else "baseline"
    return row


def _fmt(v, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("| task | n | baseline p50 ms | baseline p95 ms | dflash2 p50 ms | dflash2 p95 ms | speedup (p50) "
            "| agreement | text agreement | trajectory max abs diff m | acceptance rate | mean acceptance length | use |")
    sep = "|" + "---|" * 13
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['n']} | {_fmt(r['baseline_p50_ms'])} | {_fmt(r['baseline_p95_ms'])} "
            f"| {_fmt(r['dflash2_p50_ms'])} | {_fmt(r['dflash2_p95_ms'])} | {_fmt(r['speedup_p50'], '.2f')}x "
            f"| {_fmt(100 * r['agreement'], '.0f')}% | {_fmt(100 * r['text_agreement'], '.0f')}% "
            f"| {_fmt(r['trajectory_max_diff_m'], '.2g')} | {_fmt(r['draft_acceptance_rate'], '.3f')} "
            f"| {_fmt(r['mean_acceptance_length'], '.2f')} | {r['verdict']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------


def _plots(out: Path, rows: list[dict], ms: list[Measurement], scenes: list, preds: dict[str, dict]) -> dict[str, str]:
    import matplotlib  # heavy optional dependency: only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    tasks = [r["task"] for r in rows]
    n = len(tasks)
    cols = min(3, n)
    nrows = int(math.ceil(n / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for prof, key, color in (("baseline", "baseline_ms", "tab:blue"), ("dflash2", "dflash2_ms", "tab:orange")):
            xs = np.sort([getattr(m, key) for m in ms if m.task == task])
            if len(xs) == 0:
                continue
            ys = np.arange(1, len(xs) + 1) / len(xs)
            ax.step(np.r_[xs[0], xs], np.r_[0.0, ys], where="post", label=prof, color=color)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("latency (ms)", fontsize=8)
        ax.set_ylabel("CDF", fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("End-to-end latency per request: baseline vs dflash2", fontsize=10)
    fig.tight_layout()
    paths["latency_cdf"] = str(out / "latency_cdf.png")
    fig.savefig(paths["latency_cdf"], dpi=90)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    spec_rows = [r for r in rows if r["acceptance_histogram"]]
    if spec_rows:
        for i, r in enumerate(spec_rows):
            h = np.asarray(r["acceptance_histogram"], dtype=float)
            h = h / max(h.sum(), 1)
            x = np.arange(len(h)) + (i - (len(spec_rows) - 1) / 2) * 0.8 / len(spec_rows)
            a1.bar(x, h, width=0.8 / len(spec_rows), label=r["task"])
        a1.legend(fontsize=7)
    else:
        a1.text(0.5, 0.5, "no speculative steps", ha="center", va="center", transform=a1.transAxes)
    a1.set_xlabel("draft tokens accepted per verify step", fontsize=8)
    a1.set_ylabel("share of verify steps", fontsize=8)
    a1.set_title("DFlash2 acceptance histogram", fontsize=9)
    mal = [1.0 + m.spec_accepted / m.spec_steps for m in ms if m.spec_steps]
    if mal:
        a2.hist(mal, bins=min(20, max(5, len(mal))), color="tab:orange", alpha=0.8)
    else:
        a2.text(0.5, 0.5, "no speculative requests", ha="center", va="center", transform=a2.transAxes)
    a2.set_xlabel("mean acceptance length per request", fontsize=8)
    a2.set_ylabel("requests", fontsize=8)
    a2.set_title("per-request mean acceptance length", fontsize=9)
    fig.tight_layout()
    paths["acceptance_histogram"] = str(out / "acceptance_histogram.png")
    fig.savefig(paths["acceptance_histogram"], dpi=90)
    plt.close(fig)

    if "trajectory" in preds and scenes and hasattr(scenes[0], "facts"):
        for prof, name in (("dflash2", "bev_trajectories"), ("baseline", "bev_baseline")):
            pr = preds["trajectory"].get(prof, {})
            shown = [s for s in scenes if s.scene_id in pr]
            paths[name] = str(bev_plot(shown, [pr[s.scene_id] for s in shown], out / f"{name}.png",
                                       title=f"qualify: {prof} profile, trajectory task"))
    return paths


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


def qualify(opts: QualifyOptions) -> dict[str, Any]:
    """Run the qualification; returns the summary (also written to ``out``)."""
    # torch and the runtime: heavy, loaded only when a qualification runs (not for --help)
    import torch

    from worker.dflash.loop import DFlash2Speculator
    from worker.dflash.metrics import speculative_block
    from worker.engine import default_seed
    from worker.model.runtime import AlpamayoRuntime

    for t in opts.tasks:
        if t not in ALL_TASKS:
            raise ToolError(f"unknown task {t!r}: use one of {', '.join(ALL_TASKS)}")
    if opts.k > 1 and opts.temperature == 0:
        raise ToolError("K > 1 needs --temperature > 0")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt, head, head_kind = _resolve(opts)
    t0 = time.perf_counter()
    rt = AlpamayoRuntime.load(ckpt, device=opts.device, precision=opts.precision,
                              dtype=torch.float32 if opts.fp32 else None,
                              speculator_factory=DFlash2Speculator.factory(str(head)))
    load_s = time.perf_counter() - t0
    if opts.trajectory_max_new is not None:
        rt.trajectory_max_new = int(opts.trajectory_max_new)
    speculator = rt.speculator
    scenes = _load_scenes(opts)
    profiles = {"baseline": None, "dflash2": speculator}

    def run(profile: str, req):
        rt.speculator = profiles[profile]
        try:
            return _timed(rt, req, rt.device)
        finally:
            rt.speculator = speculator

    measurements: list[Measurement] = []
    preds: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    total = len(opts.tasks) * len(scenes) * opts.repeats
    bar = tqdm(total=total, unit="scene", desc="qualify", disable=not opts.progress, file=sys.stderr)
    warmup_ms: dict[str, dict[str, float]] = {}
    try:
        for task in opts.tasks:
            def mk(sc, tag=""):
                rid = f"{sc.scene_id}:{task}:k{opts.k}{tag}"
                return runtime_request(sc, task, request_id=rid, num_samples=opts.k, temperature=opts.temperature,
                                       seed=default_seed(rid), max_tokens=opts.max_tokens)
            warm = mk(scenes[0], ":warmup")
            warmup_ms[task] = {p: run(p, warm)[1] for p in ("baseline", "dflash2")}   # untimed warm-up
            for rep in range(opts.repeats):
                for i, sc in enumerate(scenes):
                    req = mk(sc)
                    order = ("baseline", "dflash2") if (i + rep) % 2 == 0 else ("dflash2", "baseline")
                    got = {p: run(p, req) for p in order}
                    (b, b_ms), (s, s_ms) = got["baseline"], got["dflash2"]
                    diff, text_ok, traj_diff = _compare(b, s, opts.trajectory_atol)
                    m = Measurement(scene_id=sc.scene_id, task=task, repeat=rep, baseline_ms=b_ms, dflash2_ms=s_ms,
                                    agree=diff is None, disagreement=diff, text_agree=text_ok,
                                    trajectory_max_diff_m=traj_diff, baseline_tokens=sum(b.generated_tokens),
                                    dflash2_tokens=sum(s.generated_tokens),
                                    baseline_stages_ms=dict(b.timings_ms), dflash2_stages_ms=dict(s.timings_ms))
                    if s.speculative is not None:
                        blk = speculative_block(s.speculative)
                        m.spec_steps = blk["num_spec_steps"]
                        m.spec_drafted = blk["num_draft_tokens"]
                        m.spec_accepted = blk["num_accepted_draft_tokens"]
                        m.spec_histogram = list(blk["acceptance_histogram"])
                    measurements.append(m)
                    if rep == 0 and b.trajectories is not None and i < opts.bev_scenes:
                        preds.setdefault(task, {}).setdefault("baseline", {})[sc.scene_id] = np.asarray(b.trajectories)
                        preds[task].setdefault("dflash2", {})[sc.scene_id] = np.asarray(s.trajectories)
                    bar.update(1)
    finally:
        bar.close()
        rt.speculator = speculator

    rows = [_summarise([m for m in measurements if m.task == t], t, t == "trajectory") for t in opts.tasks]
    plots = _plots(out, rows, measurements, scenes[: opts.bev_scenes], preds)
    meta = {
        "checkpoint": str(ckpt), "head": str(head), "head_kind": head_kind, "precision": opts.precision,
        "profiles": [opts.precision, f"{opts.precision}-dflash2"], "device": str(rt.device),
        "dtype": str(rt.dtype).replace("torch.", ""), "scenes": len(scenes), "repeats": opts.repeats, "k": opts.k,
        "temperature": opts.temperature, "max_tokens": opts.max_tokens,
        "trajectory_max_new": rt.trajectory_max_new, "load_seconds": round(load_s, 2), "warmup_ms": warmup_ms,
        "created_at": time.time(),
    }
    table = format_table(rows)
    md = [
        "# DFlash2 qualification",
        "",
        f"Checkpoint `{ckpt}`; head `{head}` ({head_kind}); profiles **{opts.precision}** vs "
        f"**{opts.precision}-dflash2** on {meta['device']} ({meta['dtype']}); {len(scenes)} scenes x "
        f"{opts.repeats} repeat(s) per task; K={opts.k}, temperature {opts.temperature}. One untimed warm-up "
        "request per task and profile first. Latency is end-to-end per request (one request per batch).",
        "",
        table,
        "",
        "*speedup* = baseline p50 / dflash2 p50. *agreement* = share of requests whose generated tokens and texts "
        f"are identical across the two profiles and whose trajectories differ by at most {opts.trajectory_atol} m "
        "(*text agreement*: tokens and texts alone; the action expert reads K/V that speculative verification "
        "computes in blocks, equal up to floating-point rounding, which the flow-matching sampler can amplify). "
        "DFlash2 drafts only for `trajectory`; other tasks "
        "decode the baseline way on a dflash2 profile. *use*: the profile to serve for the task (the baseline "
        "where DFlash2 does not improve latency, and for tasks it does not draft).",
    ]
    if head_kind == "random":
        md += ["", "> Random (untrained) head: acceptance is near zero; this run checks the plumbing only."]
    bad = [m for m in measurements if not m.agree]
    if bad:
        md += ["", "Disagreements:", ""] + [f"- {m.scene_id} {m.task}: {m.disagreement}" for m in bad[:20]]
    md += ["", "Plots: " + ", ".join(f"[{k}]({Path(v).name})" for k, v in plots.items()), ""]
    (out / "qualification.md").write_text("\n".join(md))
    summary = {"meta": meta, "tasks": rows, "plots": plots, "table": table,
               "markdown": str(out / "qualification.md"), "measurements": [asdict(m) for m in measurements]}
    (out / "qualification.json").write_text(json.dumps(summary, indent=1, default=float))
    return summary
