"""Draft time per block: DSpark vs DFlash, block sizes 7 and 16, same backbone, side by side.

Three drafters share one backbone (the same fc, decoder layers, norms and frozen embed/lm_head
weights) and differ only in what the issue compares:

- DFlash: ``[anchor, mask x gamma]`` (gamma + 1 slots), no sequential head, no confidence head;
- DSpark: ``[anchor, mask x (gamma-1)]`` (gamma slots), Markov head (rank r) + confidence head;
- DSpark without head: the DSpark layout with neither head, to isolate the sequential head's cost.

Each variant drafts blocks after the same cached context (``Drafter.draft_block``, temperature 1.0)
in one process, round robin (one block of each variant per round), and the table gives the median
time per block, the medians of the per-round ratios (robust to load changes on a shared machine) and,
for reference, the ratio of multiply-accumulates DSpark / DFlash.

Usage: ``python bench/bench_draft.py [--preset tiny|small|qwen3-4b] [--reps N] [--device cpu|cuda]``
(default: ``qwen3-4b`` in bf16 on CUDA, ``small`` in fp32 on CPU).

One of four decoding benches, each for one question: this one the draft time per block;
bench_decoding tau in the decoding loop; bench_specdec tokens/s over plain decoding; bench_drafters the ablations.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from transformers import Qwen3Config

from training.drafter import Drafter, DrafterConfig

PRESETS = {  # target shapes; the drafter has 5 layers of the target's width (recipe, docs/design.md sec. 2)
    "tiny": dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, vocab_size=2048, num_hidden_layers=4),
    "small": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=64, vocab_size=32768, num_hidden_layers=16),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, num_hidden_layers=36),
}


def _drafters(preset: str, rank: int, device: str, dtype: torch.dtype) -> tuple[dict[str, Drafter], Qwen3Config]:
    """The three drafters over one backbone (weights random: timing does not depend on values)."""
    target = Qwen3Config(**PRESETS[preset], max_position_embeddings=8192, tie_word_embeddings=False)
    n = target.num_hidden_layers
    layer_ids = tuple(sorted({min(i, n - 2) for i in (1, n // 4, n // 2, 3 * n // 4, n - 3)}))
    V, H = target.vocab_size, target.hidden_size
    embed = torch.randn(V, H, device=device, dtype=dtype) * 0.02
    lm_head = torch.randn(V, H, device=device, dtype=dtype) * 0.02
    base = dict(target_layer_ids=layer_ids, mask_token_id=V - 1, num_layers=5)
    dspark = Drafter(DrafterConfig(**base, markov_rank=rank), target, embed, lm_head)
    dspark = dspark.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        dspark.markov_head.markov_w2.weight.normal_(std=0.02)
    dflash = Drafter(DrafterConfig(**base, markov_rank=0, sample_from_anchor=False, confidence_head=False),
                     target, embed, lm_head).to(device=device, dtype=dtype).eval()
    dflash.load_state_dict(dspark.state_dict(), strict=False)  # same backbone
    return {"DFlash": dflash, "DSpark": dspark, "no-head": dflash}, target


def _macs_per_block(t: Qwen3Config, slots: int, drafted: int, context: int, rank: int) -> int:
    """Multiply-accumulates of one ``draft_block`` (5 layers over ``slots``, lm_head and the Markov
    bias over the ``drafted`` predicting slots): a load-independent reference for the ratios."""
    H, hd, nh, nkv = t.hidden_size, t.head_dim, t.num_attention_heads, t.num_key_value_heads
    layer = H * hd * (2 * nh + 2 * nkv) + 3 * H * t.intermediate_size + 2 * nh * hd * (context + slots)
    return 5 * slots * layer + drafted * (H + rank) * t.vocab_size


def _draft_seconds(d: Drafter, cfg: DrafterConfig, ctx, g: torch.Generator, device: str) -> float:
    """Seconds of one ``draft_block`` call of drafter ``d`` run with config ``cfg``."""
    d.config = cfg
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    d.draft_block(ctx, 7, temperature=1.0, generator=g)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, time the three drafters at gamma 7 and 16, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS))
    ap.add_argument("--rank", type=int, default=256, help="Markov rank r (recipe: 256)")
    ap.add_argument("--context", type=int, default=512, help="cached context length in tokens")
    ap.add_argument("--reps", type=int, default=None, help="timed blocks per cell")
    args = ap.parse_args(argv)
    preset = args.preset or ("qwen3-4b" if args.device == "cuda" else "small")
    reps = args.reps or (50 if args.device == "cuda" else 10)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    drafters, target = _drafters(preset, args.rank, args.device, dtype)
    feats = torch.randn(args.context, drafters["DSpark"].fc.in_features, device=args.device, dtype=dtype)
    ctx = drafters["DSpark"].encode_context(feats)
    print(f"preset {preset}: hidden {target.hidden_size}, 5 draft layers, vocab {target.vocab_size}, "
          f"Markov rank {args.rank}, context {args.context} tokens, {args.device} {str(dtype)[6:]}, "
          f"T = 1.0, median of {reps} blocks")
    print(f"{'gamma':>5} | {'DFlash ms':>9} | {'DSpark ms':>9} | {'DSpark/DFlash':>13} | "
          f"{'no-head ms':>10} | {'seq. head share':>15} | {'MAC ratio':>9}")
    for gamma in (7, 16):
        cfgs = {
            "DFlash": dataclasses.replace(drafters["DFlash"].config, block_size=gamma, sample_from_anchor=False),
            "DSpark": dataclasses.replace(drafters["DSpark"].config, block_size=gamma),
            "no-head": dataclasses.replace(drafters["DFlash"].config, block_size=gamma, sample_from_anchor=True),
        }
        g = torch.Generator(device=args.device).manual_seed(0)
        runs = {name: [] for name in cfgs}
        for i in range(reps + 3):  # round robin, so load changes hit every variant alike
            for name, cfg in cfgs.items():
                dt = _draft_seconds(drafters[name], cfg, ctx, g, args.device)
                if i >= 3:  # 3 warm-up rounds
                    runs[name].append(dt)
        t = {name: statistics.median(v) for name, v in runs.items()}
        ratio = statistics.median(a / b for a, b in zip(runs["DSpark"], runs["DFlash"]))
        share = statistics.median(1 - b / a for a, b in zip(runs["DSpark"], runs["no-head"]))
        macs = (_macs_per_block(target, gamma, gamma, args.context, args.rank)
                / _macs_per_block(target, gamma + 1, gamma, args.context, 0))
        print(f"{gamma:>5} | {t['DFlash'] * 1e3:9.2f} | {t['DSpark'] * 1e3:9.2f} | {ratio:13.3f} | "
              f"{t['no-head'] * 1e3:10.2f} | {share:15.1%} | {macs:9.3f}")


if __name__ == "__main__":
    main()
