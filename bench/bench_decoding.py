"""Decoding-loop tau precise enough to compare with the block-level tau: the evaluate stage of a
finished demo run again, on many more held-out prompts, side by side with its block-level figures.

Reads a finished demo run (``make demo`` writes ``runs/tiny``), links its cache and trained drafters
into a run folder beside it (``-decoding``), calibrates them there and runs ``+stage=evaluate`` with
``evaluate.num_prompts`` raised (400: every prompt of the embedded held-out file) and no threshold
runs (the realised-outcome calibration tables come with it). Prints, for each temperature and drafter, the decoding-loop tau with its prompt-clustered SE
and the block-level tau with its SE, the difference and its z-score
(``(a - b) / sqrt(se_a^2 + se_b^2)``; the two estimates use disjoint data, so they are independent).

    python bench/bench_decoding.py [--run runs/tiny] [--prompts 400]

One of four decoding benches, each for one question: this one tau in the decoding loop beside the
block-level tau; bench_draft the draft time per block; bench_specdec tokens/s over plain decoding;
bench_drafters the ablation drafters trained and compared.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from common import REPO


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(REPO / "runs" / "tiny"), help="a finished demo run")
    ap.add_argument("--prompts", type=int, default=400)
    args = ap.parse_args()
    run = Path(args.run).resolve()
    if not (run / "train").exists():
        sys.exit(f"{run} holds no trained drafters: run `make demo` first (or pass --run)")
    out = run.parent / f"{run.name}-decoding"
    out.mkdir(exist_ok=True)
    for part in ("cache", "train"):
        if not (out / part).exists():
            (out / part).symlink_to(run / part)
    from pipeline.run import DEFAULT_CONFIG

    for stage in ("calibrate", "evaluate"):
        if not (out / stage / "summary.json").exists():
            subprocess.run([sys.executable, "-m", "pipeline.run", f"+stage={stage}", str(DEFAULT_CONFIG),
                            f"run_dir={out}", f"evaluate.num_prompts={args.prompts}", "evaluate.thresholds=[]"],
                           check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    s = json.loads((out / "evaluate" / "summary.json").read_text())
    print(f"\n{s['prompts']} prompts; block level: {s['blocks']['drafters'][next(iter(s['blocks']['drafters']))]['0.0']['n']} "
          "paired held-out blocks\n")
    print("| T | drafter | decoding-loop tau | block-level tau | difference | z |")
    print("|---|---|---:|---:|---:|---:|")
    for key, res in s["results"].items():
        t = key.removeprefix("T=")
        for name, r in res["drafters"].items():
            d = r["overall"]
            b = s["blocks"]["drafters"][name][f"{float(t):.1f}"]
            diff = d["tau"] - b["tau"]
            z = diff / math.sqrt(d["tau_se"] ** 2 + b["tau_se"] ** 2)
            print(f"| {t} | {name} | {d['tau']:.3f} ± {d['tau_se']:.3f} | {b['tau']:.3f} ± {b['tau_se']:.3f} | "
                  f"{diff:+.3f} | {z:+.1f} |")


if __name__ == "__main__":
    main()
