"""How well must a confidence estimator rank drafts for adaptive verification to pay on Qwen3-4B / H200?

    python bench/bench_scheduler_headroom.py [--rates 0.841 0.821 ...] [--blocks 20000] [--seed 0]

Synthetic blocks of gamma = 7 drafts, slot k accepted with probability ``--rates[k]`` given the slots
before it were (default: DSpark's per-slot acceptance on the demo's held-out blocks at the serving
setting, T = 0.7 / top-p 0.8 / top-k 20, docs/results.md; independent slots, a simplification: real
slots correlate, which helps an estimator). An estimator of separation d sees, per slot, the score
``d * 1[slot accepted] + N(0, 1)`` (the binormal model: a per-slot AUC of Phi(d / sqrt 2)), calibrated by
the max-q estimator's Platt fit per position on half of the blocks (``training.maxq``); the other half
is scored (AUC of the survival per position, ``pipeline.inference.realised.metrics``, as the evaluate
stage reports it) and replayed through DSpark Algorithm 1 on the roofline model of Qwen3-4B on one
H200 (``pipeline.inference.roofline``), beside the oracle (the best plan knowing the outcomes,
``pipeline.inference.scheduler``). The table says which survival AUC an estimator needs before adaptive
verification gains 10% over the best fixed block at R >= 64, the bar of issue #36, to compare with the
AUC the head and max q reach on decoding rounds (``<run_dir>/evaluate/confidence.json``).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.inference.realised import Outcomes, conditional, fit_estimators, metrics  # noqa: E402
from pipeline.inference.roofline import qwen3_4b_h200_curves  # noqa: E402
from pipeline.inference.scheduler import simulate  # noqa: E402

SERVING_RATES = (0.841, 0.821, 0.793, 0.770, 0.728, 0.748, 0.715)
CONCURRENCY = (16, 64, 128, 256, 512)


def headroom(rates, separations, n_blocks: int, seed: int, concurrency=CONCURRENCY) -> list[dict]:
    """Synthetic headroom of adaptive verification (module doc).

    Args:
        rates: per-slot conditional acceptance, gamma floats in (0, 1). separations: estimator separations d
            (>= 0; per-slot AUC Phi(d / sqrt 2)). n_blocks: synthetic blocks (half fit, half replayed).
        seed: numpy / scheduler seed. concurrency: R values of the H200 roofline model.
    Returns:
        one dict per d: ``{"d", "per_slot_auc", "survival_auc" (mean over positions of the replayed half),
        "ratio": {R: Algorithm 1 tokens/s over the best fixed block}, "oracle": {R: ratio},
        "best_fixed": {R: gamma}}``.
    """
    rng = np.random.default_rng(seed)
    gamma = len(rates)
    acc = rng.random((n_blocks, gamma)) < np.asarray(rates)
    y = np.cumprod(acc, axis=1).astype(np.int64)
    noise = rng.standard_normal((n_blocks, gamma))
    group = torch.arange(n_blocks) % 2
    curves = qwen3_4b_h200_curves(concurrency, block_size=gamma)
    out = []
    for d in separations:
        score = torch.from_numpy(d * acc + noise)
        data = Outcomes(score.clone(), torch.sigmoid(score), torch.from_numpy(y.sum(1)),
                        torch.full((n_blocks,), gamma), group)
        fit, report = data.split()
        c = conditional(fit_estimators(fit)["max-q"], report)
        auc = float(np.mean([m["auc"] for m in metrics(c, report)]))
        res = simulate(report.labels()[0].numpy().astype(np.int64), c.numpy(), curves, concurrency=concurrency,
                       seed=seed, min_speedup=None)["results"]
        out.append({"d": d, "per_slot_auc": 0.5 * math.erfc(-d / 2), "survival_auc": auc,
                    "ratio": {r["R"]: r["ratio_algorithm1"] for r in res},
                    "oracle": {r["R"]: r["ratio_oracle"] for r in res},
                    "best_fixed": {r["R"]: r["best_fixed_gamma"] for r in res}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=list(SERVING_RATES),
                    help="per-slot conditional acceptance (default: DSpark at the serving setting, the demo)")
    ap.add_argument("--blocks", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--separations", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    args = ap.parse_args()
    rows = headroom(args.rates, args.separations, args.blocks, args.seed)
    tau = 1 + float(np.sum(np.cumprod(args.rates)))
    print(f"gamma = {len(args.rates)}, expected tau {tau:.3f}; H200 roofline model of Qwen3-4B, context 1,024; "
          f"{args.blocks // 2} blocks replayed, Algorithm 1 alone (no fallback)")
    Rs = list(rows[0]["ratio"])
    print("| separation d | per-slot AUC | survival AUC (mean k) | " + " | ".join(f"R={R}" for R in Rs) + " |")
    print("|---:|---:|---:|" + "---:|" * len(Rs))
    for r in rows:
        print(f"| {r['d']:.1f} | {r['per_slot_auc']:.3f} | {r['survival_auc']:.3f} | "
              + " | ".join(f"{r['ratio'][R]:.3f}" for R in Rs) + " |")
    print("| oracle | 1 | 1 | " + " | ".join(f"{rows[0]['oracle'][R]:.3f}" for R in Rs) + " |")
    print("| best fixed gamma | | | " + " | ".join(str(rows[0]["best_fixed"][R]) for R in Rs) + " |")


if __name__ == "__main__":
    main()
