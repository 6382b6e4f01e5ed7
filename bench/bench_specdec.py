"""Speculative decoding tokens/s over plain target decoding for the tiny target, side by side.

Needs a run whose drafters are trained (``make demo`` writes runs/tiny):

    python bench/bench_specdec.py [--run-dir runs/tiny --prompts 16]

One of four decoding benches, each for one question: this one tokens/s over plain decoding;
bench_decoding tau in the decoding loop; bench_draft the draft time per block; bench_drafters the ablations.
"""
from __future__ import annotations

import argparse

import torch

from common import tiny_config


def main() -> None:
    from pipeline.stages.evaluate import eval_prompts
    from pipeline.target_model.prefill import LayerTap
    from pipeline.inference.speculate import plain_decode, speculative_decode
    from pipeline.target_model.loader import load_target
    from pipeline.drafters import load_trained_drafter

    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    cfg = tiny_config(args.run_dir, f"evaluate.num_prompts={args.prompts}")
    model, tok, target_dir = load_target(cfg.target)
    prompts = [p for _, p in eval_prompts(cfg, tok)]
    tap = LayerTap(model, cfg.target.target_layer_ids)
    stop = {tok.eos_token_id}
    for T in (0.0, 1.0):
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=T, stop_ids=stop)
        plain = [plain_decode(model, p, generator=torch.Generator().manual_seed(i), **kw) for i, p in enumerate(prompts)]
        base = sum(len(d.tokens) for d in plain) / sum(d.seconds for d in plain)
        print(f"T={T:g}: target alone {base:,.1f} tokens/s")
        for name in cfg.train.drafters:
            drafter = load_trained_drafter(cfg, name, target_dir)
            runs = [speculative_decode(model, drafter, p, tap=tap, generator=torch.Generator().manual_seed(i), **kw)
                    for i, p in enumerate(prompts)]
            tps = sum(len(d.tokens) for d in runs) / sum(d.seconds for d in runs)
            tau = sum(r.accepted + 1 for d in runs for r in d.rounds) / max(1, sum(len(d.rounds) for d in runs))
            print(f"  {name:7s}: {tps:,.1f} tokens/s, tau {tau:.2f}, speed-up {tps / base:.2f}x")


if __name__ == "__main__":
    main()
