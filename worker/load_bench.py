"""Load figures and the memory plan: `python -m worker.load_bench [--shape 32b|tiny] [--layers N]
[--dir DIR] [--out FILE] [--device cuda|cpu] [--k 1,2,3] [--plan-only]`.

Writes a synthetic checkpoint of the release's format (the real tensor names, shapes and dtype,
bf16; shards of the release's size, 71.6 GB in 15) with the first N of the shape's text (and
expert) layers plus everything else, from a few preallocated random buffers; then, each in a
fresh interpreter, loads it (a) cold, after `posix_fadvise(DONTNEED)` on every shard, and (b)
warm, through the engine (bf16-dflash2 with a random head of the right shape, every K warmed,
CUDA graphs captured), and prints `Targets: loading`: GB/s from a warm page cache, the loading
process's host-memory peak (ru_maxrss) against the largest shard + 2 GB, and the time to ready,
extrapolated to all the shape's layers when fewer were written (said in the table). The memory
plan per profile x GPU (worker/model/memory_plan.py, for the shape's full depth) follows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from worker.shapes import SHAPES, shape_config
from worker.demo.layout import Dims, write_support_files
from worker.model.checkpoint import INDEX_FILE, expected_shapes
from worker.model.config import AlpamayoConfig
from worker.model.memory_plan import GIB, GPUS, ModelBytes, longest_rows_for, scenes_that_fit
from worker.model.modelopt import is_fp8_weight

RELEASE_SHARDS = 15                             # the Alpamayo 2 Super release: 15 bf16 shards, 71.6 GB
TARGET_GBPS, TARGET_READY_S, HOST_SLACK = 2.0, 90.0, 2 << 30
PROFILES = ("bf16", "bf16-dflash2", "fp8", "fp8-dflash2")
# columns per row: the default (NIM_ALPAMAYO_MAX_MODEL_LEN unset), and NIM_ALPAMAYO_MAX_MODEL_LEN=4992, which holds
# a 24-frame 1920x1080 trajectory scene: 24 x (180 image + 2) + ~150 text and history + 256 reasoning + 64 action
CAPACITIES = (8192, 4992)


def _bytes(shapes: dict[str, tuple[int, ...]], size: int = 2) -> int:
    return sum(size * _numel(s) for s in shapes.values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- writing the checkpoint
def write_checkpoint(directory: Path, shape: str, layers: int, full_bytes: int) -> dict:
    """The first `layers` layers of `shape` plus everything else, bf16, in shards of the release's
    size; random values from preallocated buffers. -> {bytes, shards, largest_shard, write_s}."""
    t0 = time.perf_counter()
    tok, config = shape_config(shape, layers)
    shapes = expected_shapes(AlpamayoConfig.from_dict(config))
    total = _bytes(shapes)
    n_shards = max(1, round(RELEASE_SHARDS * total / full_bytes))
    per_shard = total / n_shards
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        if groups[-1] and size >= per_shard and len(groups) < n_shards:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += 2 * _numel(shapes[name])
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    buffers = [(torch.randn(16 << 20, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy()
               for _ in range(3)]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, largest = {}, 0
    for i, (shard, group) in enumerate(zip(names, groups)):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in group:
            n = 2 * _numel(shapes[name])
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = shard
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        fd = os.open(directory / shard, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, len(head).to_bytes(8, "little") + head)
            left, j = offset, i
            while left:
                buf = buffers[j % len(buffers)]
                chunk = memoryview(buf)[:min(left, len(buf))]
                left -= os.write(fd, chunk)
                j += 1
            os.fsync(fd)                # dirty pages cannot be dropped from the page cache
        finally:
            os.close(fd)
        largest = max(largest, (directory / shard).stat().st_size)
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    write_support_files(directory, tok, config)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return {"bytes": total, "shards": len(names), "largest_shard": largest, "write_s": time.perf_counter() - t0}


def drop_page_cache(directory: Path) -> str:
    """posix_fadvise(DONTNEED) on every shard; says how much of the page cache it freed."""
    if not hasattr(os, "posix_fadvise"):
        return "not dropped: no posix_fadvise on this system"
    before = _cached_bytes()
    for shard in sorted(directory.glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    after = _cached_bytes()
    if before is None or after is None:
        return "posix_fadvise(DONTNEED) called (page cache size unreadable)"
    return f"posix_fadvise(DONTNEED): page cache {before / 1e9:.1f} -> {after / 1e9:.1f} GB"


def _cached_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------- loading (in a fresh interpreter)
def load_and_warm(directory: str, device: str, k_values: tuple[int, ...], reasoning: int | None) -> dict:
    """Engine load (bf16-dflash2, random head) + warm-up of every K (graphs captured on CUDA)."""
    from worker.config import load_settings
    from worker.engine import Engine
    from worker.model import runtime

    t_import = time.perf_counter()
    if device == "cuda":
        torch.zeros(1, device="cuda")              # the CUDA context's host memory is not the loader's
    expected_shapes(AlpamayoConfig.from_dir(directory))   # transformers' lazy imports, outside the GB/s window
    import_s = time.perf_counter() - t_import
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    settings = load_settings({"NIM_MODEL_PROFILE": "bf16-dflash2", "ALPAMAYO_DEVICE": device,
                              "NIM_ALPAMAYO_TRAJ_SAMPLES": ",".join(map(str, k_values))})
    engine = Engine(settings)
    engine.checkpoint = Path(directory)            # a random head of the right shape (no head directory)
    timed = {}
    load_model = runtime.load_model

    def timed_load(*a, **kw):
        t = time.perf_counter()
        out = load_model(*a, **kw)
        timed["load_s"] = time.perf_counter() - t
        return out
    runtime.load_model = timed_load
    t0 = time.perf_counter()
    engine.load(warmup=False)
    loaded_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if reasoning:
        engine.runtime.trajectory_max_new = reasoning
    t1 = time.perf_counter()
    engine.runtime.warmup(list(k_values))
    if device == "cuda":
        torch.cuda.synchronize()
    return {"import_s": import_s, "load_s": timed["load_s"], "loaded_s": loaded_s, "warm_s": time.perf_counter() - t1,
            "ready_s": import_s + time.perf_counter() - t0, "host_peak": peak, "host_base": base_rss}


def measure(directory: Path, device: str, k_values: tuple[int, ...], reasoning: int | None) -> dict:
    cmd = [sys.executable, "-m", "worker.load_bench", "--child", str(directory), "--device", device,
           "--k", ",".join(map(str, k_values))] + (["--reasoning", str(reasoning)] if reasoning else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise RuntimeError(f"loading child failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- tables
def loading_table(info: dict, cold: dict, warm: dict, drop: str, layers: int, full_layers: int,
                  full_bytes: int) -> str:
    gbps = info["bytes"] / warm["load_s"] / 1e9
    cold_gbps = info["bytes"] / cold["load_s"] / 1e9
    limit = info["largest_shard"] + HOST_SLACK
    peak = max(cold["host_peak"], warm["host_peak"])
    scale = full_layers / layers
    ready = warm["import_s"] + full_bytes / (gbps * 1e9) + (warm["loaded_s"] - warm["load_s"] + warm["warm_s"]) * scale
    note = "" if layers == full_layers else (
        f"; {layers} of {full_layers} layers written, extrapolated to {full_layers}: the load at the measured "
        f"GB/s over {full_bytes / 1e9:.1f} GB, the rest (head, plan, warm-up, graphs) x {scale:g}, imports and CUDA "
        f"context ({warm['import_s']:.1f} s) as measured")

    def status(ok: bool) -> str:
        return "met" if ok else "missed"
    rows = [
        ("Targets: loading", "", ""),
        ("target", "measured", "status"),
        ("---", "---", "---"),
        (f"load from a warm page cache >= {TARGET_GBPS:g} GB/s",
         f"{gbps:.2f} GB/s ({info['bytes'] / 1e9:.1f} GB in {info['shards']} shards, {warm['load_s']:.1f} s); "
         f"cold {cold_gbps:.2f} GB/s ({drop})", status(gbps >= TARGET_GBPS)),
        ("host-memory peak <= largest shard + 2 GB",
         f"{peak / 1e9:.2f} GB ru_maxrss of the loading process (before loading {warm['host_base'] / 1e9:.2f} GB); "
         f"limit {limit / 1e9:.2f} GB", status(peak <= limit)),
        (f"ready (loaded + K warmed + graphs captured) <= {TARGET_READY_S:g} s, bf16-dflash2",
         f"{ready:.1f} s (measured {warm['ready_s']:.1f} s warm, {cold['ready_s']:.1f} s cold{note})",
         status(ready <= TARGET_READY_S)),
    ]
    head, *body = rows
    return f"### {head[0]}\n\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in body) + "\n"


def profile_bytes(shape: str) -> dict[str, ModelBytes]:
    """Device bytes of each profile at the shape's full depth (bf16 KV cache on every profile)."""
    from worker.dflash.draft import DraftModel
    from worker.dflash.head import head_config_for

    _, config = shape_config(shape)
    cfg = AlpamayoConfig.from_dict(config)
    shapes = expected_shapes(cfg)
    bf16 = _bytes(shapes)
    fp8 = sum((_numel(s) + 4 * s[0]) if is_fp8_weight(n, s) else 2 * _numel(s) for n, s in shapes.items())
    hc = head_config_for(cfg, mask_token_id=0)
    with torch.device("meta"):
        draft_shapes = {n: tuple(p.shape) for n, p in DraftModel(hc).state_dict().items()}
    draft = sum(2 * _numel(s) for s in draft_shapes.values())
    # fp8 proposals (`Proposer.use_fp8`): the draft's products but the selector's in e4m3, and an e4m3 LM head
    vocab, hidden = shapes["vlm.lm_head.weight"]
    fp8_draft = vocab * hidden + 4 * vocab + sum(
        _numel(s) + 4 * s[0] if len(s) == 2 and not n.startswith("selector.") else 2 * _numel(s)
        for n, s in draft_shapes.items())
    t = cfg.text
    target = 2 * cfg.num_layers * int(t["num_key_value_heads"]) * int(t["head_dim"]) * 2
    drafted = target + 2 * hc.num_hidden_layers * hc.num_key_value_heads * hc.head_dim * 2
    return {"bf16": ModelBytes(bf16, target, target), "fp8": ModelBytes(fp8, target, target),
            "bf16-dflash2": ModelBytes(bf16 + draft, drafted, target),
            "fp8-dflash2": ModelBytes(fp8 + fp8_draft, drafted, target)}


def plan_table(shape: str, fraction: float = 0.90, batch: int = 8) -> str:
    models = profile_bytes(shape)
    lines = [f"### Memory plan ({shape}, ALPAMAYO_GPU_MEMORY_FRACTION={fraction:g}, bf16 KV cache)", "",
             f"| profile | GPU | K | weights | scenes at {CAPACITIES[0]} columns | scenes at {CAPACITIES[1]} columns "
             f"| longest row for batch {batch} | batch >= {batch} at {CAPACITIES[0]} |", "|---|---|---|---|---|---|---|---|"]
    for profile in PROFILES:
        m = models[profile]
        for gpu, total in GPUS.items():
            for k in (1, 2, 3):
                fits = [scenes_that_fit(total, fraction, m, c, k) for c in CAPACITIES]
                longest = longest_rows_for(total, fraction, m, batch, k)
                lines.append(f"| {profile} | {gpu} | {k} | {m.weights / GIB:.1f} GiB | {fits[0]} | {fits[1]} | "
                             f"{longest} | {'met' if fits[0] >= batch else 'missed'} |")
    lines += ["", f"{CAPACITIES[1]} columns (NIM_ALPAMAYO_MAX_MODEL_LEN={CAPACITIES[1]}) hold a 24-frame 1920x1080 "
              "trajectory scene (24 x 182 image tokens + ~150 text and history + 256 reasoning + 64 action columns); "
              "text tasks with max_tokens 1024 need ~5,700."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.load_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="32b")
    ap.add_argument("--layers", type=int, default=16, help="text (and expert) layers written (default 16)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/alpamayo-load-bench"), help="where the checkpoint goes")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", default="1,2,3", help="K values warmed (default 1,2,3)")
    ap.add_argument("--reasoning", type=int, default=None, help="warm-up reasoning tokens (default: the release's 256)")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    ap.add_argument("--plan-only", action="store_true", help="only the memory plan (no files, no loading)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    k_values = tuple(int(k) for k in args.k.split(","))
    if args.child:
        print(json.dumps(load_and_warm(args.child, args.device, k_values, args.reasoning)))
        return 0
    full_layers = SHAPES[args.shape].get("layers", Dims().layers)
    layers = min(args.layers, full_layers)
    text = ""
    if not args.plan_only:
        _, full = shape_config(args.shape)
        full_bytes = _bytes(expected_shapes(AlpamayoConfig.from_dict(full)))
        info = write_checkpoint(args.dir, args.shape, layers, full_bytes)
        print(f"# wrote {info['bytes'] / 1e9:.1f} GB in {info['shards']} shards to {args.dir} in {info['write_s']:.1f} s",
              flush=True)
        drop = drop_page_cache(args.dir)
        cold = measure(args.dir, args.device, k_values, args.reasoning)
        warm = measure(args.dir, args.device, k_values, args.reasoning)
        text = loading_table(info, cold, warm, drop, layers, full_layers, full_bytes) + "\n"
        text += f"raw: {json.dumps({'write': info, 'cold': cold, 'warm': warm, 'device': args.device})}\n\n"
    text += plan_table(args.shape)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
