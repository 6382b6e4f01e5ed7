"""The roofline model's serving cost curve for Qwen3-4B and the recipe's drafter on one H200: per
concurrency R, whether a verify step is memory- or compute-bound, its ridge point and the speculative
steps per second at 1 and 8 verified tokens per request (``pipeline/inference/roofline.py``).

    python bench/bench_roofline.py [--context 1024] [--concurrency 1 16 64 256 512]

A model, not a measurement: the constants and their sources are in the module; a curve measured on
the GPU (``evaluate.sps_table``) replaces it when one is at hand.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.inference.roofline import H200, DrafterShape, ModelShape, draft_step_seconds, regime, sps_curve

SHAPE = Path(__file__).resolve().parents[1] / "pipeline" / "target_model" / "shapes" / "qwen3_4b.json"


def rows(context: int, concurrency: list[int], block_size: int = 7) -> list[dict]:
    """One dict per R: bound at l = 1 and 8, ridge (tokens per step, per request), draft and verify ms, SPS."""
    target = ModelShape.from_config(json.loads(SHAPE.read_text()))
    drafter = DrafterShape.from_target(target)
    out = []
    for R in concurrency:
        one, eight = regime(target, H200, R, 1, context), regime(target, H200, R, 8, context)
        curve = sps_curve(target, drafter, H200, R, 8, context, block_size=block_size)
        out.append({"R": R, "bound_l1": one.bound, "bound_l8": eight.bound, "ridge_tokens": one.ridge_tokens,
                    "ridge_per_request": one.ridge_tokens_per_request, "fits": eight.fits,
                    "draft_ms": 1e3 * draft_step_seconds(drafter, H200, R, block_size, context),
                    "sps_l1": curve.steps_per_s[0], "sps_l8": curve.steps_per_s[-1]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024, help="tokens of context per request (default 1024)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    args = ap.parse_args()
    print(f"Qwen3-4B + 5-layer drafter (block 7) on one {H200.name}, context {args.context}")
    print("| R | verify bound, l=1 / l=8 | ridge: tokens per step (per request) | fits in HBM | draft ms | SPS l=1 | SPS l=8 |")
    print("|---:|---|---:|---|---:|---:|---:|")
    for r in rows(args.context, args.concurrency):
        print(f"| {r['R']} | {r['bound_l1']} / {r['bound_l8']} | {r['ridge_tokens']:.0f} ({r['ridge_per_request']:.1f}) "
              f"| {'yes' if r['fits'] else 'no'} | {r['draft_ms']:.2f} | {r['sps_l1']:.1f} | {r['sps_l8']:.1f} |")


if __name__ == "__main__":
    main()
