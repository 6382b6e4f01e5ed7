"""``estimate``: bytes and object count of a cache before the cache stage runs (CPU only).

Plans the shards and renders every input row exactly as the cache stage does
(``pipeline.cache.plan`` and ``render_shard``: same chat template, truncation, skips), with no
Ray and no target forward pass, then sizes the result with ``cache_schema.estimate_cache_bytes``
and counts the objects the schema-1 layout will hold. Needs the target's tokenizer and config
(local files) but not its weights.
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

from cache_schema import StorageConfig, estimate_cache_bytes, shard_overhead_bytes
from ops.report import human_bytes, key_values, table
from ops.verify import array_specs

ROOT_OBJECTS = 2  # fingerprint.json, and summary.json that the cache stage writes into the root


def shard_objects(num_samples: int, num_tokens: int, num_hidden_rows: int, *, feature_width: int,
                  hidden_size: int, feature_dtype: str, storage: StorageConfig) -> int:
    """Objects one shard will hold: group and array ``zarr.json`` files, one object per zarr
    shard of each array (``StorageConfig.grid``; none for an empty array), and the commit record."""
    specs = array_specs(num_samples, num_tokens, num_hidden_rows, feature_width=feature_width,
                        hidden_size=hidden_size, feature_dtype=feature_dtype)
    count = 2  # group zarr.json + commit record
    for dtype, shape in specs.values():
        _, shard_shape = storage.grid(shape, dtype.itemsize)
        count += 1 + (math.ceil(shape[0] / shard_shape[0]) if shape[0] else 0)
    return count


def render_counts(item: tuple[int, Any], cfg, local_dir: str) -> dict[str, Any]:
    """Counts of one planned shard, rendered by ``pipeline.cache.render_shard`` (a process task)."""
    from pipeline.cache import render_shard

    shard, span = item
    r = render_shard(span, shard, cfg, local_dir)
    return {"shard": shard, "rows": span.row_end - span.row_start, "samples": r["num_samples"],
            "tokens": r["num_tokens"], "supervised": r["num_supervised"], "hidden_rows": r["num_hidden_rows"],
            "skipped": r["skipped"], "quarantined": r["bad"] != "[]"}


def estimate(config: str, overrides: list[str], *, workers: int = 1,
             progress: bool = True) -> tuple[dict[str, Any], int]:
    """Size of the cache that ``+stage=cache config overrides...`` would write.

    Args:
        config: the run's YAML file; overrides: ``key=value`` overrides as on the pipeline CLI.
        workers: render processes.
    Returns:
        (payload, 1 when the estimate exceeds ``cache.storage_budget_bytes``, else 0).
    Raises:
        ConfigError, TargetNotFoundError, BadInputFileError: as the cache stage would.
    """
    from tqdm import tqdm
    from transformers import AutoConfig

    from ops.common import UsageError
    from pipeline.cache import cache_url, plan, storage_config
    from pipeline.chats import RowCounts
    from pipeline.run import load_config
    from pipeline.target import resolve_target_path

    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    cfg = load_config(config, overrides)
    local_dir = resolve_target_path(cfg.target.path)
    model_config = AutoConfig.from_pretrained(local_dir, local_files_only=True)
    hidden, layers = int(model_config.hidden_size), len(cfg.target.target_layer_ids)
    dtype, storage = cfg.cache.feature_dtype.value, storage_config(cfg)
    shards = plan(cfg)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        counts = list(tqdm(pool.map(render_counts, shards, [cfg] * len(shards), [local_dir] * len(shards)),
                           total=len(shards), unit="shard", desc="render", disable=None if progress else True))
    skipped = RowCounts()
    for c in counts:
        skipped.merge(RowCounts(0, json.loads(c["skipped"])))
    tokens, samples = sum(c["tokens"] for c in counts), sum(c["samples"] for c in counts)
    hidden_rows = sum(c["hidden_rows"] for c in counts)
    est = estimate_cache_bytes(tokens, hidden_size=hidden, num_target_layers=layers, feature_dtype=dtype,
                               supervised_fraction=hidden_rows / max(tokens, 1), num_samples=samples)
    total = est.total_bytes + len(counts) * shard_overhead_bytes(
        hidden_size=hidden, target_layer_ids=tuple(cfg.target.target_layer_ids), feature_dtype=dtype, storage=storage)
    objects = ROOT_OBJECTS + sum(c["quarantined"] for c in counts) + sum(
        shard_objects(c["samples"], c["tokens"], c["hidden_rows"], feature_width=layers * hidden,
                      hidden_size=hidden, feature_dtype=dtype, storage=storage) for c in counts)
    budget = cfg.cache.storage_budget_bytes
    payload = {"cache": cache_url(cfg), "target": cfg.target.path, "hidden_size": hidden,
               "target_layer_ids": list(cfg.target.target_layer_ids), "feature_dtype": dtype,
               "storage": asdict(storage), "shards": len(counts), "rows": sum(c["rows"] for c in counts),
               "samples": samples, "tokens": tokens, "supervised_tokens": sum(c["supervised"] for c in counts),
               "hidden_rows": hidden_rows, "skipped_rows": dict(sorted(skipped.skipped.items())),
               "bytes": total, "bytes_per_token": round(est.bytes_per_token, 2), "objects": objects,
               "budget_bytes": budget, "over_budget": budget is not None and total > budget}
    return payload, int(payload["over_budget"])


def render_estimate(p: dict[str, Any]) -> str:
    """Human view of :func:`estimate`."""
    budget = "-" if p["budget_bytes"] is None else (
        f"{human_bytes(p['budget_bytes'])} ({'OVER' if p['over_budget'] else 'within'})")
    return "\n".join([key_values([
        ("cache", p["cache"]), ("target", f"{p['target']} (hidden {p['hidden_size']}, layers "
                                          f"{p['target_layer_ids']}, features {p['feature_dtype']})"),
        ("shards", p["shards"]), ("input rows", p["rows"]), ("samples", p["samples"]), ("tokens", p["tokens"]),
        ("supervised tokens", p["supervised_tokens"]),
        ("bytes", f"{p['bytes']:,} ({human_bytes(p['bytes'])}), arrays and per-shard zarr metadata"),
        ("bytes/token", p["bytes_per_token"]),
        ("objects", p["objects"]), ("budget", budget)]), "", "skipped rows:",
        table([{"reason": k, "rows": v} for k, v in p["skipped_rows"].items()], ["reason", "rows"])])
