"""Has the demo's training recipe converged? The same recipe trained 4x longer, side by side.

Reads the cache of a finished demo run (``make demo`` writes ``runs/tiny``), trains the chosen
drafters again with ``train.epochs`` multiplied by ``--factor`` (the learning-rate schedule
stretches with it: same warm-up fraction, cosine to 0 at the new end) in a run folder beside it,
and prints the held-out (validation-shard) ``tau_expected`` and slot-1 expected acceptance at the
end of both runs, with their ratio. Converged means the longer run gains less than 5%.

    python bench/bench_recipe.py [--run runs/tiny] [--factor 4] [--drafters dflash dspark]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import REPO


def _result(run: Path, name: str) -> dict:
    return json.loads((run / "train" / name / "result.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(REPO / "runs" / "tiny"), help="a finished demo run (its cache and train)")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--drafters", nargs="+", default=["dflash", "dspark"])
    args = ap.parse_args()
    run = Path(args.run).resolve()
    if not (run / "train").exists():
        sys.exit(f"{run} holds no trained drafters: run `make demo` first (or pass --run)")
    longer = run.parent / f"{run.name}-x{args.factor}"
    longer.mkdir(exist_ok=True)
    if not (longer / "cache").exists():
        (longer / "cache").symlink_to(run / "cache")
    from pipeline.run import DEFAULT_CONFIG, load_config

    base = load_config(DEFAULT_CONFIG, [f"run_dir={run}"])
    drop = [f"~train.drafters.{n}" for n in base.train.drafters if n not in args.drafters]
    cmd = [sys.executable, "-m", "pipeline.run", "+stage=train", str(DEFAULT_CONFIG), f"run_dir={longer}",
           f"train.epochs={base.train.epochs * args.factor}", *drop]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    seconds = time.perf_counter() - t0
    print(f"\n{args.factor}x longer training: {seconds:.0f} s ({' '.join(cmd[3:])})\n")
    print("| drafter | steps | held-out tau_expected | slot-1 acceptance | best (step) |")
    print("|---|---:|---:|---:|---:|")
    for name in args.drafters:
        for label, r in (("demo", _result(run, name)), (f"x{args.factor}", _result(longer, name))):
            v = r["validation"]
            print(f"| {name} ({label}) | {r['steps']} | {v['last']['tau_expected']:.4f} | "
                  f"{v['last']['slot1_acceptance']:.4f} | {v['best']['tau_expected']:.4f} ({v['best']['step']}) |")
    print()
    for name in args.drafters:
        a, b = _result(run, name)["validation"]["last"], _result(longer, name)["validation"]["last"]
        gain = b["tau_expected"] / a["tau_expected"]
        print(f"{name}: x{args.factor} / demo held-out tau_expected = {gain:.4f} "
              f"({'within' if gain < 1.05 else 'NOT within'} 5%)")


if __name__ == "__main__":
    main()
