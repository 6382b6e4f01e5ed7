"""What a CPU training step costs, and what each of the worker's step settings buys, side by side.

Reads the cache of a finished demo run (``make demo`` writes ``runs/tiny``) and runs the train
worker's own loop (:func:`training.loop.train_worker`, DeepSpeed ZeRO-2 on a one-rank gloo group)
in-process, one torch thread, each variant in a fresh process: in the main thread, in a worker thread
as Ray Train runs it, with glibc's default malloc (``keep_freed_memory`` replaced by a no-op: the
setting is process-wide, so only a fresh process shows its absence) and with the loss checkpointing
every chunk (``checkpoint_min_bytes=0``). Prints the median training tokens/s of each (steps after
the first 20), its ratio to the worker's default, and whether the per-step losses are the same bits.

    python bench/bench_step.py [--run runs/tiny] [--drafter dflash] [--steps 300]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from common import REPO

VARIANTS = {  # name: (worker thread, glibc keeps freed memory, loss checkpointing threshold or None)
    "worker thread (the train stage's settings)": (True, True, None),
    "main thread": (False, True, None),
    "worker thread, glibc malloc defaults": (True, False, None),
    "worker thread, every loss chunk checkpointed": (True, True, 0),
}


def run_variant(run: str, drafter: str, steps: int, out: str, thread: bool, keep: bool, ckpt: int | None) -> None:
    """One variant in this process: train ``steps`` steps of ``drafter`` into ``out``."""
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import training.loop as loop
    from pipeline.run import DEFAULT_CONFIG, load_config
    from pipeline.stages.train import expected_fingerprint, train_job
    from pipeline.target.loader import resolve_target_path

    if not keep:
        loop.keep_freed_memory = lambda *a: False
    cfg = load_config(DEFAULT_CONFIG, [f"run_dir={run}", f"train.max_steps={steps}",
                                       f"train.validate_every_steps={10 * steps}",
                                       f"train.checkpoint_every_steps={10 * steps}"])
    target = resolve_target_path(cfg.target.path)
    job = dataclasses.replace(train_job(cfg, drafter, expected_fingerprint(cfg, target).to_json(), target),
                              output_url=out)
    if ckpt is not None:
        job = dataclasses.replace(job, loss=dataclasses.replace(job.loss, checkpoint_min_bytes=ckpt))
    from pipeline.cluster import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo")
    if thread:
        t = threading.Thread(target=loop.train_worker, args=({"job": job},))
        t.start()
        t.join()
    else:
        loop.train_worker({"job": job})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(REPO / "runs" / "tiny"), help="a finished demo run (its cache)")
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        run_variant(args.run, args.drafter, args.steps, args.out, *VARIANTS[args.variant])
        return
    if not (Path(args.run) / "cache").exists():
        sys.exit(f"{args.run} holds no cache: run `make demo` first (or pass --run)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(VARIANTS):
            out = f"{tmp}/v{i}"
            subprocess.run([sys.executable, __file__, "--run", args.run, "--drafter", args.drafter, "--steps",
                            str(args.steps), "--variant", name, "--out", out], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[name] = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
    base = next(iter(results))
    ref = statistics.median(r["tokens_per_s"] for r in results[base][20:])
    print(f"\n{args.drafter}, {args.steps} steps each, one torch thread, {args.run}\n")
    print("| variant | training tokens/s (median) | vs the train stage's settings | same losses |")
    print("|---|---:|---:|---|")
    for name, rows in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rows[20:])
        same = [r["loss"] for r in rows] == [r["loss"] for r in results[base]]
        print(f"| {name} | {tps:,.0f} | {tps / ref:.3f} | {'bit-identical' if same else 'DIFFERENT'} |")


if __name__ == "__main__":
    main()
