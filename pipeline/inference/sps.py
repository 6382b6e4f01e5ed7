"""Profile the target's verification speed: steps per second SPS(B) at B tokens per step.

``python -m pipeline.inference.sps conf/tiny.yaml --out sps.json [key=value ...]`` measures this machine's
curve; the evaluate stage loads a saved table (e.g. measured on a GPU) from ``evaluate.sps_table``
or profiles the target itself.
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

import torch

from pipeline.inference.scheduler import SPSCurve

DEFAULT_BATCH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@torch.inference_mode()
def profile_sps(model, batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, *, context: int = 128,
                repeats: int = 5) -> SPSCurve:
    """Median time of one target forward over B new tokens on a KV cache of ``context`` tokens.

    Returns:
        :class:`SPSCurve` of (B tokens per step, steps per second).
    """
    from transformers import DynamicCache

    from pipeline.inference.speculate import cache_keyword

    dev, kw = model.device, cache_keyword(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=gen).to(dev)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, use_cache=True, **{kw: cache})
    sps = []
    for b in batch_tokens:
        x = torch.randint(0, vocab, (1, b), generator=gen).to(dev)
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            t0 = time.perf_counter()
            model(input_ids=x, use_cache=True, logits_to_keep=b, **{kw: cache})
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            cache.crop(-b)  # drop the B new tokens again
        sps.append(1.0 / sorted(times[1:])[len(times[1:]) // 2])
    return SPSCurve(list(batch_tokens), sps)


def main(argv: Sequence[str] | None = None) -> None:
    from pipeline.run import load_config
    from pipeline.target_model.loader import load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--out", required=True, help="where to save the curve (JSON, any fsspec URL)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    model, _, _ = load_target(cfg.target, "cuda" if torch.cuda.is_available() else "cpu")
    curve = profile_sps(model)
    curve.save(args.out)
    for b, s in zip(curve.batch_tokens, curve.steps_per_s):
        print(f"B={int(b):5d}  {s:9.1f} steps/s  {b * s:11.0f} tokens/s")


if __name__ == "__main__":
    main()
