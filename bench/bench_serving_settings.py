"""Issue #36 items 1 and 4 in one run: the evaluate stage's figures per sampling setting, side by side.

Reads ``<run_dir>/evaluate/confidence.json`` (written by ``+stage=evaluate``; ``--evaluate`` runs that
stage first on the run's trained drafters) and prints, per setting (T / top-p / top-k):

- decoding-loop tau against block-level tau of the shipped drafter (difference in combined SEs);
- AUC and equal-mass ECE of survival per position k on decoding rounds of held-out prompts, per
  estimator (``export`` = what vLLM gets, ``max_q`` = the free estimator);
- the scheduler's tokens/s over the best fixed block per R, on the measured SPS curve (``cpu``) and
  the H200 roofline model of Qwen3-4B (``h200_model``): with the fixed-block fallback (the policy),
  its two-step-lag production variant, and DSpark Algorithm 1 alone (before the fallback), for the
  shipped estimator and for max-q;

then the H200 model's regime per R (speed spread ``SPS(R) / SPS(8 R)``, where adaptive verification
can pay). Example (the figures of the report, on a shared 2-core machine):

    python -m pipeline.run +stage=generate conf/tiny.yaml run_dir=/tmp/d-run generate.max_rows=512  # ... cache, train
    python bench/bench_serving_settings.py /tmp/d-run --evaluate
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pipeline.inference.roofline import ROOFLINE_CONTEXT, qwen3_4b_h200_curves
from pipeline.inference.scheduler import MIN_SPEEDUP, adaptive_can_pay

REPO = Path(__file__).resolve().parents[1]


def _fmt(xs) -> str:
    return " ".join("  n/a" if x is None else f"{x:5.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:5.3f}" for x in xs)


def print_setting(s: dict) -> None:
    """One sampling setting of confidence.json as plain-text tables."""
    print(f"\n=== T={s['temperature']:g} top_p={s['top_p']:g} top_k={s['top_k']}  (shipped estimator: "
          f"{s['shipped']}, {s['rounds']} decoding rounds)")
    t = s["tau"]
    if t["block"] is not None and t["decoding_se"] is not None:
        se = (t["decoding_se"] ** 2 + t["block_se"] ** 2) ** 0.5
        print(f"tau: decoding loop {t['decoding']:.3f} ± {t['decoding_se']:.3f}, block level {t['block']:.3f} ± "
              f"{t['block_se']:.3f}: difference {(t['decoding'] - t['block']) / se:+.1f} SE")
    g = len(next(iter(s["estimators"].values()))["auc"])
    print(f"{'estimator':10s} | AUC k=1..{g}" + " " * (6 * g - 10) + f" | ECE (equal mass) k=1..{g}")
    for name, m in s["estimators"].items():
        print(f"{name:10s} | {_fmt(m['auc'])} | {_fmt(m['ece'])}")
    for curve in ("cpu", "h200_model"):
        rs = list(s["scheduler"].get(curve, {}))
        if not rs:
            continue
        print(f"scheduler / best fixed block, {curve}:  R = " + " ".join(f"{r:>6s}" for r in rs))
        rows = {f"{s['shipped']} (policy)": s["scheduler"][curve],
                f"{s['shipped']} production": s["scheduler_production"][curve],
                f"{s['shipped']} Alg. 1 alone": s["scheduler_algorithm1"][curve],
                "max_q (policy)": s["scheduler_by_estimator"].get("max_q", {}).get(curve, {})}
        for label, ratios in rows.items():
            print(f"  {label:32s} " + " ".join(f"{ratios.get(r, float('nan')):6.3f}" for r in rs))


def print_h200(concurrency: list[int], block_size: int = 7) -> None:
    """The H200 model's speed spread per R and whether adaptive verification can pay there."""
    curves = qwen3_4b_h200_curves(concurrency, block_size=block_size)
    print(f"\nH200 roofline model, Qwen3-4B + 5-layer drafter, context {ROOFLINE_CONTEXT}, block {block_size}:")
    print("   R | SPS l=1 | SPS l=8 | spread | adaptive can pay (spread >= " f"{1 + MIN_SPEEDUP:.2f})")
    for R, c in curves.items():
        lo, hi = float(c(R)), float(c(R * (block_size + 1)))
        print(f"{R:4d} | {lo:7.1f} | {hi:7.1f} | {lo / hi:6.3f} | {adaptive_can_pay(c, R, block_size)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--evaluate", action="store_true", help="run +stage=evaluate on the run first")
    ap.add_argument("--config", default=str(REPO / "conf" / "tiny.yaml"))
    ap.add_argument("overrides", nargs="*", help="key=value overrides for --evaluate")
    args = ap.parse_args()
    if args.evaluate:
        subprocess.run([sys.executable, "-m", "pipeline.run", "+stage=evaluate", args.config,
                        f"run_dir={args.run_dir}", *args.overrides], check=True, cwd=REPO)
    conf = json.loads((Path(args.run_dir) / "evaluate" / "confidence.json").read_text())
    print(f"shipped drafter: {conf['drafter']}; scored on {conf['scored_on']}")
    for s in conf["settings"]:
        print_setting(s)
    rs = [int(r) for r in conf["settings"][0]["scheduler"].get("h200_model", {})] or [1, 4, 16, 64, 128, 256, 512]
    print_h200(rs)


if __name__ == "__main__":
    main()
