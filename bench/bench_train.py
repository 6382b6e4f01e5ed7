"""Training throughput and the fraction of step time spent waiting for data, reading the same cache
from local disk and from a local S3 server (moto), side by side in one run.

    python bench/bench_train.py [--rows 384 --steps 12]
"""
from __future__ import annotations

import argparse
import json
import tempfile

from common import s3_server, tiny_config


def train_figures(run_dir: str, rows: int, steps: int) -> dict:
    from pipeline.stages.cache import run_cache
    from storage import filesystem
    from pipeline.stages.train import run_train

    cfg = tiny_config(run_dir, f"cache.max_rows={rows}", "cache.rows_per_shard=64", f"train.max_steps={steps}",
                      "~train.drafters.dflash", "~train.drafters.eagle3", f"train.checkpoint_every_steps={10 * steps}")
    run_cache(cfg)
    run_train(cfg)
    fs, path = filesystem(f"{run_dir}/train/dspark/metrics.jsonl")
    rows_ = [json.loads(x) for x in fs.cat_file(path).decode().splitlines()][1:]  # step 1 warms up
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in rows_) / len(rows_),
            "data_wait_fraction": sum(r["data_wait_fraction"] for r in rows_) / len(rows_)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=384)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, s3_server() as bucket:
        local = train_figures(f"{tmp}/local", args.rows, args.steps)
        s3 = train_figures(f"{bucket}/bench-train", args.rows, args.steps)
    for name, f in (("local disk", local), ("S3 (moto)", s3)):
        print(f"{name:11s}: {f['tokens_per_s']:,.0f} training tokens/s, data wait {100 * f['data_wait_fraction']:.1f}% of step time")
    print(f"S3 / local tokens/s: {s3['tokens_per_s'] / local['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
