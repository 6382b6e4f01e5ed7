"""Feature modes side by side on the embedded default: cache (the cache stage, then train on it),
online (prefill streams into the trainer, nothing stored) and hybrid (epoch 0 streams while the cache
is committed, later epochs read it), same seed and data order.

Prints, per mode: wall time (cache: stage + train back to back), held-out ``tau_expected`` at the
last step, per-step losses against cache mode (exactly equal steps, max |diff|), bytes written
under the run (cache and train separately), the stream's rows and peak in-flight bytes, and whether
hybrid's cache equals the cache stage's (``ops diff``). Writes ``<out>/bench_features.json``.

    python bench/bench_features.py [--out runs/bench-features] [--generated runs/tiny/generate]
                                   [--epochs 2] [key=value ...]

``--generated``: the demo's generate output (``make demo``), linked into each run so every mode
caches the same target-written chats; without it (or when absent) the raw stdlib chats are used.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from common import REPO, tiny_config


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()) if root.exists() else 0


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "train/dspark/metrics.jsonl").read_text().splitlines()]


def main() -> None:
    from ops.compare import diff
    from pipeline.stages.cache import run_cache
    from pipeline.stages.train import run_train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-features"))
    ap.add_argument("--generated", default=str(REPO / "runs" / "tiny" / "generate"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    generated = Path(a.generated)
    base = ["~train.drafters.dflash", "~train.drafters.eagle3", "train.concurrent_drafters=1", f"train.epochs={a.epochs}", *a.overrides]

    def cfg(mode: str):
        run_dir = out / mode
        run_dir.mkdir(parents=True, exist_ok=True)
        gen = []
        if generated.is_dir():
            (run_dir / "generate").symlink_to(generated.resolve())
            gen = ["generate.enabled=true"]
        return tiny_config(str(run_dir), *gen, f"train.features={mode}", *base)

    results = {}
    for mode in ("cache", "online", "hybrid"):
        c = cfg(mode)
        t0 = time.perf_counter()
        stage = None
        if mode == "cache":
            run_cache(c)
            stage = time.perf_counter() - t0
        s = run_train(c)
        wall = time.perf_counter() - t0
        run_dir = Path(c.run_dir)
        rows = _rows(run_dir)
        val = [r for r in rows if "val_tau_expected" in r]
        res = s["drafters"]["dspark"]
        results[mode] = {"wall_s": round(wall, 1), "cache_stage_s": None if stage is None else round(stage, 1),
                         "steps": len(rows), "val_tau_expected": val[-1]["val_tau_expected"] if val else None,
                         "val_step": val[-1]["step"] if val else None,
                         "cache_bytes": _bytes(run_dir / "cache"), "train_bytes": _bytes(run_dir / "train"),
                         "stream": res.get("stream"), "consumed_sha256": res["consumed"]["sha256"],
                         "data_wait_fraction": sum(r["data_wait_fraction"] for r in rows) / len(rows),
                         "losses": [r["loss"] for r in rows]}
        print(f"{mode}: {wall:.1f} s, {len(rows)} steps", flush=True)
    ref = results["cache"]["losses"]
    for mode, r in results.items():
        got = r.pop("losses")
        r["equal_steps"] = sum(x == y for x, y in zip(got, ref))
        r["max_abs_loss_diff"] = max((abs(x - y) for x, y in zip(got, ref)), default=0.0)
        r["same_samples"] = r["consumed_sha256"] == results["cache"]["consumed_sha256"]
    payload, code = diff(str(out / "cache" / "cache"), str(out / "hybrid" / "cache"))
    results["hybrid"]["ops_diff_clean"] = code == 0
    (out / "bench_features.json").write_text(json.dumps(results, indent=1))
    print("| mode | wall s | held-out tau_expected | steps equal to cache | max abs loss diff | cache bytes | "
          "train bytes | stream rows | peak in-flight MiB | data wait |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        st = r["stream"] or {}
        print(f"| {mode} | {r['wall_s']}" + (f" ({r['cache_stage_s']} cache stage)" if r["cache_stage_s"] else "")
              + f" | {r['val_tau_expected']:.4f} | {r['equal_steps']}/{r['steps']} | {r['max_abs_loss_diff']:.2e} | "
              f"{r['cache_bytes']:,} | {r['train_bytes']:,} | {st.get('rows', '-')} | "
              f"{st.get('max_ahead_bytes', 0) / 2**20:.1f} | {r['data_wait_fraction']:.3f} |")
    print(f"hybrid cache vs cache stage (ops diff): {'clean' if code == 0 else 'DIFFERS'}")


if __name__ == "__main__":
    main()
