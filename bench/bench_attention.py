"""Block-mask build time and compiled flex-attention graph count, before / after static shapes.

Before: ``create_block_mask`` evaluates the attention rule on every (query, key) pair each
micro-step, and ``torch.compile(flex_attention)`` sees every batch's own (T, N). After:
:func:`training.blocks.flex_block_mask` builds the mask from the anchors (shape-only tiles cached)
and the forward pads (T, N) to :func:`training.blocks.static_shape`'s buckets for
:func:`training.drafter.compiled_flex_attention` (``dynamic=False``).

Both halves run on the CPU: the mask at the recipe's shape (B = 4, N = 512 anchors, S = 7 slots,
T = 4,096), the graph count with dynamo's ``eager`` backend (the graphs dynamo captures, without
inductor's CPU codegen) over 8 (T, N) shapes, on 1-head / 16-dim tensors (the count does not
depend on the width): before (automatic dynamic shapes: a static graph, then one with symbolic
T and N), static without padding (a graph per shape), and after (a graph per bucket).

Usage: ``python bench/bench_attention.py [--repeats 5]`` (prints one table; ~1-2 min, < 2 GiB).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from training.blocks import _slot_tiles, block_mask_mod, flex_block_mask, sample_anchors, static_shape
from training.drafter import compiled_flex_attention

SHAPES = [(640, 128), (1000, 200), (1024, 256), (1500, 300), (2048, 384), (2600, 400), (3072, 448), (4000, 512)]
"""(T, N) of 8 micro-batches: context lengths and anchor counts as a run meets them."""


def _anchors(B: int, T: int, N: int, seed: int) -> torch.Tensor:
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    return sample_anchors(loss_mask, N, torch.Generator().manual_seed(seed))[0]


def _old_mask(anchors: torch.Tensor, T: int, S: int):
    B, N = anchors.shape
    return create_block_mask(block_mask_mod(anchors, T, S), B=B, H=None, Q_LEN=N * S, KV_LEN=T + N * S, device="cpu")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def mask_build(repeats: int, B: int = 4, N: int = 512, S: int = 7, T: int = 4096) -> dict[str, float]:
    """Seconds per mask build: torch's create_block_mask vs the direct build (first, then cached tiles)."""
    anchors = [_anchors(B, T, N, seed) for seed in range(repeats)]
    _slot_tiles.cache_clear()
    rss0 = _peak_rss_gb()
    first = _timed(lambda: flex_block_mask(anchors[0], T, S))
    cached = [_timed(lambda a=a: flex_block_mask(a, T, S)) for a in anchors]
    rss1 = _peak_rss_gb()
    old = [_timed(lambda a=a: _old_mask(a, T, S)) for a in anchors]
    rss2 = _peak_rss_gb()
    return {"old_s": statistics.median(old), "new_first_s": first, "new_cached_s": statistics.median(cached),
            "new_peak_rss_growth_gb": rss1 - rss0, "old_peak_rss_growth_gb": rss2 - rss1}


def _graphs(call) -> tuple[int, float]:
    """Unique dynamo graphs and seconds of ``call`` over :data:`SHAPES`, from a fresh dynamo."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    t = time.perf_counter()
    for i, (T, N) in enumerate(SHAPES):
        call(T, N, i)
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"]), time.perf_counter() - t


def graph_counts(S: int = 7, num_anchors: int = 512, d: int = 16) -> dict[str, float]:
    old_flex = torch.compile(flex_attention, backend="eager")  # before: dynamo's automatic dynamic shapes
    static_flex = torch.compile(flex_attention, backend="eager", dynamic=False)  # static, unpadded

    def qkv(T, N):
        g = torch.Generator().manual_seed(T)
        return (torch.randn(1, 1, N * S, d, generator=g), torch.randn(1, 1, T + N * S, d, generator=g),
                torch.randn(1, 1, T + N * S, d, generator=g))

    def raw(fn):
        def call(T, N, i):
            q, k, v = qkv(T, N)
            with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=len(SHAPES)):
                fn(q, k, v, block_mask=_old_mask(_anchors(1, T, N, i), T, S), scale=0.25, enable_gqa=True)
        return call

    def after(T, N, i):
        Tp, Np = static_shape(T, N, num_anchors)
        q, k, v = qkv(Tp, Np)
        anchors = torch.nn.functional.pad(_anchors(1, T, N, i), (0, Np - N))
        with torch.no_grad():
            compiled_flex_attention(q, k, v, flex_block_mask(anchors, Tp, S), 0.25, backend="eager")

    (g_old, s_old), (g_static, s_static), (g_new, s_new) = _graphs(raw(old_flex)), _graphs(raw(static_flex)), \
        _graphs(after)
    buckets = sorted({static_shape(T, N, num_anchors) for T, N in SHAPES})
    return {"old_graphs": g_old, "static_graphs": g_static, "new_graphs": g_new, "old_s": s_old,
            "static_s": s_static, "new_s": s_new, "buckets": buckets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    m = mask_build(args.repeats)
    old = m["old_s"]
    print(f"block mask, B=4 N=512 S=7 T=4096, {torch.get_num_threads()} CPU threads, median of {args.repeats}:")
    print(f"  create_block_mask (before)    {old * 1e3:8.1f} ms  peak RSS +{m['old_peak_rss_growth_gb']:.2f} GB")
    print(f"  direct, first build (after)   {m['new_first_s'] * 1e3:8.1f} ms  x{old / m['new_first_s']:.0f} faster")
    print(f"  direct, cached tiles (after)  {m['new_cached_s'] * 1e3:8.1f} ms  x{old / m['new_cached_s']:.0f} faster, "
          f"peak RSS +{m['new_peak_rss_growth_gb']:.2f} GB")
    c = graph_counts()
    print(f"compiled flex graphs over {len(SHAPES)} (T, N) shapes {SHAPES}, dynamo 'eager' backend:")
    print(f"  before: torch.compile(flex_attention), raw shapes  {c['old_graphs']} graphs ({c['old_s']:.1f} s; "
          "the 2nd graph with symbolic T, N)")
    print(f"  dynamic=False, raw shapes (no padding)  {c['static_graphs']} graphs ({c['static_s']:.1f} s)")
    print(f"  after:  dynamic=False, buckets {c['buckets']}  {c['new_graphs']} graphs ({c['new_s']:.1f} s)")

if __name__ == "__main__":
    main()
