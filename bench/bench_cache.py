"""Cache stage throughput against a bare batched forward of the same target on the same samples,
measured side by side in one run; and bytes per token for bf16 against fp8 features.

    python bench/bench_cache.py [--rows 2048] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from common import tiny_config


def bare_forward_tokens_per_s(cfg, rows: int) -> tuple[float, int]:
    """The target's base-model forward over the same rendered samples and length batches, no hooks,
    no writes (2 threads: the same cores the cache stage's actors share)."""
    import torch

    from pipeline.stages.cache import plan, render_shard
    from pipeline.target_model.prefill import length_batches
    from pipeline.target_model.loader import load_target, resolve_target_path

    torch.set_num_threads(2)
    local = resolve_target_path(cfg.target.path)
    samples = []
    for shard, span in plan(cfg):
        r = render_shard(span, shard, cfg, local)
        off = r["offsets"]
        samples += [r["ids"][a:b] for a, b in zip(off[:-1], off[1:])]
    model, _, _ = load_target(cfg.target)
    base = model.get_decoder()
    t0, tokens = time.perf_counter(), 0
    with torch.inference_mode():
        for batch in length_batches([len(s) for s in samples], cfg.cache.max_tokens_per_batch):
            width = max(len(samples[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, i in enumerate(batch):
                ids[j, :len(samples[i])] = torch.as_tensor(samples[i])
                mask[j, :len(samples[i])] = 1
            base(input_ids=ids, attention_mask=mask, use_cache=False)
            tokens += int(mask.sum())
    return tokens / (time.perf_counter() - t0), tokens


def main() -> None:
    from pipeline.stages.cache import run_cache

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. target.path=DIR")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("bf16", "fp8_e4m3"):
            cfg = tiny_config(f"{tmp}/{dtype}", f"cache.max_rows={args.rows}", f"cache.feature_dtype={dtype}",
                              "cache.rows_per_shard=64", *args.overrides)
            t0 = time.perf_counter()
            s = run_cache(cfg)
            out[dtype] = {**{k: s[k] for k in ("samples", "tokens", "bytes", "bytes_per_token", "estimate_bytes",
                                               "prefill_tokens_per_s", "steady_tokens_per_s")},
                          "stage_tokens_per_s": s["tokens"] / (time.perf_counter() - t0)}
        bare, tokens = bare_forward_tokens_per_s(tiny_config(f"{tmp}/bare", f"cache.max_rows={args.rows}",
                                                             "cache.rows_per_shard=64", *args.overrides), args.rows)
    b = out["bf16"]
    print(json.dumps(out, indent=1))
    print(f"bare batched forward: {bare:,.0f} tokens/s over {tokens:,} tokens")
    print(f"cache actors, steady state (prefill+write+commit, bf16): {b['steady_tokens_per_s']:,.0f} tokens/s -> "
          f"ratio {b['steady_tokens_per_s'] / bare:.2f}")
    print(f"cache actor pool incl. actor start-up (bf16): {b['prefill_tokens_per_s']:,.0f} tokens/s -> "
          f"ratio {b['prefill_tokens_per_s'] / bare:.2f}")
    print(f"cache stage end to end incl. Ray start and rendering: {b['stage_tokens_per_s']:,.0f} tokens/s -> "
          f"ratio {b['stage_tokens_per_s'] / bare:.2f}")
    print(f"bytes/token: bf16 {b['bytes_per_token']:.1f}, fp8 {out['fp8_e4m3']['bytes_per_token']:.1f}; "
          f"actual/estimate bf16 {b['bytes'] / b['estimate_bytes']:.3f}")


if __name__ == "__main__":
    main()
