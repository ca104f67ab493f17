"""Does the worker's intake slow its engine? The engine alone against the engine while intake works
in the same process, no Kafka (issue 17): `python -m producer_tools.contention_bench [--batch 16]
[--image-size 1080x1920] [--nonstop]`, with the worker's environment (NIM_MODEL_PROFILE,
NIM_FT_CHECKPOINT, ALPAMAYO_LOAD_FORMAT=dummy, ALPAMAYO_MAX_REASONING_TOKENS, ...).

1. the engine loaded and warmed as `worker serve` does; 3 x `--batch` synthetic trajectory
   requests through the worker's intake (untimed);
2. three batches of the engine alone;
3. three batches while intake processes `--batch` more records on `INTAKE_THREADS` threads,
   started with each batch, as the worker's intake does when a finished batch's records are
   committed and the next ones fetched;
4. (`--nonstop`) three batches while intake processes records without pause;
5. the table: engine seconds per batch (median) and the ratio to the engine alone, with each
   batch's seconds outside the timed stages (prefill, decode, diffusion) printed on the way.
Measured on the H200 (docs/benchmarks.md): 0.843x with intake decoding images on threads of the
worker's process, 0.978x with the decoder processes of worker/frames.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from producer_tools.serve_bench import build_requests, in_process


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m producer_tools.contention_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image-size", default="1080x1920", help="HxW of every frame")
    ap.add_argument("--nonstop", action="store_true", help="also with intake processing records without pause")
    args = ap.parse_args(argv)
    from worker.service import INTAKE_THREADS

    h, w = (int(x) for x in args.image_size.lower().split("x"))
    b = args.batch
    engine, intake, raws, jobs = in_process({}, build_requests("contention", 3 * b, 4, (h, w), 1))
    pool = ThreadPoolExecutor(INTAKE_THREADS)

    def batches(tag: str, burst: bool = False, count: int = 3) -> float:
        walls = []
        for n in range(count):
            part = jobs[n * b:(n + 1) * b]
            side = [pool.submit(intake.process, raws[i]) for i in range(b)] if burst else []
            t0 = time.perf_counter()
            res = engine.infer([j.scene for j in part])
            wall = time.perf_counter() - t0
            for f in side:
                f.result()
            st = {k: statistics.fmean(r.timings_ms[k] for r in res) for k in ("prefill", "decode", "diffusion")}
            untimed = wall - (b * st["prefill"] + st["decode"] + st["diffusion"]) / 1e3
            print(f"{tag}, batch {n}: {wall:.2f} s, {untimed:.2f} s outside the timed stages", flush=True)
            walls.append(wall)
        return statistics.median(walls)

    batches("warm-up", count=1)
    alone = batches("engine alone")
    rows = [("engine alone", alone), (f"intake starting {b} records with each batch ({INTAKE_THREADS} threads)",
                                      batches("intake burst", burst=True))]
    if args.nonstop:
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                intake.process(raws[i % len(raws)])
                i += 1
        threads = [threading.Thread(target=load, daemon=True) for _ in range(INTAKE_THREADS)]
        for t in threads:
            t.start()
        rows.append((f"intake processing records nonstop ({INTAKE_THREADS} threads)", batches("intake nonstop")))
        stop.set()
    print("| engine | s per batch (median of 3) | vs alone |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.2f} | {alone / s:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
