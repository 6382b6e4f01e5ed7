"""Drafters compared on the same held-out blocks: DFlash, DSpark, the control head and DFlash in
DSpark's block layout (``anchor-layout``: ``[anchor, mask x (gamma-1)]``, no head; it separates the
layout's share of DSpark's gain from the head's) at block size 7, DFlash and DSpark at block size 16, and DFlash and DSpark trained from an fp8 cache.

Reads a finished demo run (``make demo`` writes ``runs/tiny``: its cache, generated chats and the
block-7 DFlash and DSpark), trains the other five with the same recipe and steps in run folders
beside it (``-ablations``: the control head and the block-16 pair, on the same cache; ``-fp8``
caches the same generated chats with ``cache.feature_dtype=fp8_e4m3``), then runs the paired
block-level evaluation
(:func:`training.block_runner.evaluate_blocks`) of all seven on the same held-out samples,
anchors and random numbers (the fp8 drafters read the same samples from their own cache), and
prints tau ± SE at T=0 and T=1, the paired ratios ± SE and the per-slot acceptance.

    python bench/bench_drafters.py [--run runs/tiny] [--samples 256] [--skip-fp8] [--variants control ...]

One of four decoding benches, each for one question: this one the ablation drafters trained and
compared; bench_decoding tau in the decoding loop; bench_draft draft time; bench_specdec tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import REPO

PAIRS = [("dspark", "dflash"), ("control", "dflash"), ("dspark", "control"),
         ("anchor-layout", "dflash"), ("control", "anchor-layout"), ("dspark", "anchor-layout"),
         ("dflash16", "dflash"), ("dspark16", "dflash16"), ("dspark16", "dspark"),
         ("dflash-fp8", "dflash"), ("dspark-fp8", "dspark"), ("dspark-fp8", "dflash-fp8")]
VARIANTS = {  # name: (block size, DSpark layout, head); everything else is the demo's DSpark spec
    "control": (7, True, "control"), "anchor-layout": (7, True, "none"),
    "dflash16": (16, False, "none"), "dspark16": (16, True, "markov")}


def ablations(base, variants: list[str]) -> list[str]:
    """Config overrides that train the ablation drafters in place of the demo's two: each is the
    demo's ``dspark`` spec (layers, mask token, initialisation, confidence head, Markov rank) with its
    own block size, layout and head (rank 0 without a head), two at a time.

    Args:
        base: the demo run's loaded config (:func:`pipeline.run.load_config`).
        variants: names of :data:`VARIANTS` to train.
    Returns:
        Hydra override strings for ``python -m pipeline.run +stage=train``.
    Raises:
        SystemExit: the config trains no drafter named ``dspark`` (the spec the ablations copy).
    """
    if "dspark" not in base.train.drafters:
        sys.exit(f"the run's config trains no 'dspark' drafter ({sorted(base.train.drafters)}): the ablations "
                 "copy its spec; pass --run of a demo run")
    spec = base.train.drafters["dspark"]
    shared = (f"num_layers: {spec.num_layers}, mask_token_id: {spec.mask_token_id}, "
              f"confidence_head: {str(spec.confidence_head).lower()}, init: {spec.init.value}")
    out = [f"~train.drafters.{n}" for n in base.train.drafters] + ["train.concurrent_drafters=2"]
    for name in variants:
        block, anchor, head = VARIANTS[name]
        rank = spec.markov_rank if head != "none" else 0
        out.append(f"++train.drafters.{name}={{{shared}, block_size: {block}, "
                   f"sample_from_anchor: {str(anchor).lower()}, head: {head}, markov_rank: {rank}}}")
    return out


def _stage(stage: str, run_dir: Path, *overrides: str) -> None:
    from pipeline.run import DEFAULT_CONFIG

    if (run_dir / stage / "summary.json").exists():
        return
    subprocess.run([sys.executable, "-m", "pipeline.run", f"+stage={stage}", str(DEFAULT_CONFIG),
                    f"run_dir={run_dir}", *overrides], check=True,
                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def _batches(cfg, target_dir: str, samples: int):
    from cache_schema import CacheReader
    from pipeline.stages.cache import cache_url
    from pipeline.stages.train import expected_fingerprint
    from training.data import sample_batches, split_shards

    reader = CacheReader(cache_url(cfg), expected_fingerprint(cfg, target_dir))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards,
                         cfg.train.validation_shards)
    return sample_batches(reader, split.heldout, cfg.train.micro_batch_samples, samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(REPO / "runs" / "tiny"), help="a finished demo run")
    ap.add_argument("--samples", type=int, default=128, help="held-out samples (x evaluate.block_anchors blocks)")
    ap.add_argument("--skip-fp8", action="store_true", help="leave out the fp8 cache and its two drafters")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the ablation drafters to train, two at a time (a subset gets its own run folder)")
    args = ap.parse_args()
    from pipeline.run import DEFAULT_CONFIG, load_config
    from pipeline.target_model.loader import resolve_target_path
    from training.block_eval import format_table, summarise
    from training.block_runner import evaluate_blocks
    from pipeline.drafters import load_trained_drafter

    run = Path(args.run).resolve()
    if not (run / "train").exists():
        sys.exit(f"{run} holds no trained drafters: run `make demo` first (or pass --run)")
    subset = "" if args.variants == list(VARIANTS) else "-" + "-".join(args.variants)
    abl, fp8 = run.parent / f"{run.name}-ablations{subset}", run.parent / f"{run.name}-fp8"
    for folder, link in ((abl, "cache"), (fp8, "generate")):
        folder.mkdir(exist_ok=True)
        if not (folder / link).exists():
            (folder / link).symlink_to(run / link)
    base = load_config(DEFAULT_CONFIG, [f"run_dir={run}"])
    overrides = ablations(base, args.variants)
    _stage("train", abl, *overrides)
    if not args.skip_fp8:
        _stage("cache", fp8, "cache.feature_dtype=fp8_e4m3")
        _stage("train", fp8, "cache.feature_dtype=fp8_e4m3")

    cfgs = {"": base, "abl": load_config(DEFAULT_CONFIG, [f"run_dir={abl}", *overrides]),
            "-fp8": load_config(DEFAULT_CONFIG, [f"run_dir={fp8}", "cache.feature_dtype=fp8_e4m3"])}
    target_dir = resolve_target_path(cfgs[""].target.path)
    bf16_drafters = {n: load_trained_drafter(c, n, target_dir) for key in ("", "abl") for c in [cfgs[key]]
                     for n in c.train.drafters}
    if args.skip_fp8:
        del cfgs["-fp8"]
    fp8_drafters = {} if args.skip_fp8 else {f"{n}-fp8": load_trained_drafter(cfgs["-fp8"], n, target_dir)
                                             for n in cfgs["-fp8"].train.drafters}
    cfg = cfgs[""]
    common = {"temperatures": [0.0, 1.0], "num_anchors": cfg.evaluate.block_anchors}
    tally = evaluate_blocks(bf16_drafters, _batches(cfg, target_dir, args.samples), **common)
    if fp8_drafters:
        tally = evaluate_blocks(fp8_drafters, _batches(cfgs["-fp8"], target_dir, args.samples), tally=tally, **common)
    trained = {*bf16_drafters, *fp8_drafters}
    summary = summarise(tally, pairs=[p for p in PAIRS if {*p} <= trained])
    print("\n" + format_table(summary))
    held = {}
    for key, c in cfgs.items():
        for name in c.train.drafters:
            r = json.loads((Path(c.run_dir) / "train" / name / "result.json").read_text())
            held[name + ("-fp8" if key == "-fp8" else "")] = r["validation"]["last"]
    print("| drafter | steps | validation tau_expected | slot-1 acceptance |\n|---|---:|---:|---:|")
    for name, v in held.items():
        print(f"| {name} | {v['step']} | {v['tau_expected']:.4f} | {v['slot1_acceptance']:.4f} |")
    out = run / "bench_drafters.json"
    summary["pairs"] = {f"{a}/{b}": v for (a, b), v in summary["pairs"].items()}
    out.write_text(json.dumps({"blocks": summary, "validation": held}, indent=1))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
