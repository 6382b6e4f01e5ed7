"""``estimate``: bytes, object count and storage requests of a cache before the cache stage runs (CPU only).

Plans the shards and renders every input row exactly as the cache stage does
(``pipeline.stages.cache.plan`` and ``render_shard``: same chat template, truncation, skips), with no
Ray and no target forward pass, then sizes the result with ``cache_schema.estimate_cache_bytes``
and counts the objects the schema-1 layout will hold. Needs the target's tokenizer and config
(local files) but not its weights.

Why two estimate modules: the byte arithmetic belongs to the cache contract
(:mod:`cache_schema.estimate`, used by the cache stage's storage budget); this tool renders the data to count it.
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from typing import Any

from cache_schema import StorageConfig, estimate_cache_bytes, shard_overhead_bytes
from cache_schema.layout import array_specs
from cache_schema.writer import expected_objects
from ops.report import human_bytes, key_values, table

ROOT_OBJECTS = 2  # fingerprint.json, and summary.json that the cache stage writes into the root

# Storage requests besides the data itself, measured on S3 (moto behind a counting proxy) by
# ``bench/bench_scale.py --cost`` (docs/object-storage.md), 20 shards of 1
# and of 8 four-token samples: a write_shard made 18 PUTs (its objects) + 35 HEAD + 21 LIST + 8 GET; a
# training epoch 1 LIST + 17 GET per shard of one sample, 4 GET per further sample (read-only stores
# read whole objects without s3fs's HEAD first: ``cache_schema.writer.CacheRoot.shard_store``).
WRITE_EXTRA_PER_SHARD = 64  # non-PUT requests of one CacheRoot.write_shard (zarr's existence checks, listings)
OPEN_PER_SHARD = 14  # requests to open one shard for reading (object listing, zarr metadata, small arrays)
LIST_PAGE = 1000  # keys per S3 listing page
PUT_PRICE_PER_1000 = 0.005  # USD, S3 Standard list price (us-east-1, 2026); GET/LIST below
GET_PRICE_PER_1000 = 0.0004


def sample_read_requests(tokens_per_sample: float, hidden_rows_per_sample: float, *, feature_width: int,
                         hidden_size: int, feature_dtype: str, chunk_bytes: int) -> float:
    """Expected requests to read one sample for training: per token array read (input_ids,
    loss_mask, features [+ feature_scale], last_hidden) a GET per inner chunk its rows
    touch (a span of b bytes over chunks of c bytes touches 1 + b/c chunks on average). Calibrated
    on one-chunk samples (``bench/bench_scale.py``); a sample spanning chunks may cost one more GET
    per array (the zarr shard index)."""
    feature_row = feature_width * (1 if feature_dtype == "fp8_e4m3" else 2)
    spans = [4 * tokens_per_sample, tokens_per_sample, feature_row * tokens_per_sample,
             2 * hidden_size * hidden_rows_per_sample]
    if feature_dtype == "fp8_e4m3":
        spans.append(4 * tokens_per_sample)
    return sum(1 + b / chunk_bytes for b in spans)


def request_costs(*, shards: int, samples: int, tokens: int, hidden_rows: int, objects: int, feature_width: int,
                  hidden_size: int, feature_dtype: str, chunk_bytes: int, epochs: int, drafters: int,
                  workers: int) -> dict[str, Any]:
    """The request bill of a cache: PUTs and other requests to write it once, GETs per training
    epoch (every shard opened once, every sample read once) and per full training run (each
    drafter reads every epoch; each worker lists and reads the commit records once), and their
    cost at S3 Standard list prices. Constants: see the module top."""
    per_sample = sample_read_requests(tokens / max(samples, 1), hidden_rows / max(samples, 1),
                                      feature_width=feature_width, hidden_size=hidden_size,
                                      feature_dtype=feature_dtype, chunk_bytes=chunk_bytes)
    epoch = shards * OPEN_PER_SHARD + samples * per_sample
    index = 1 + math.ceil(shards / LIST_PAGE) + shards  # fingerprint, commit listing, records
    run = drafters * (epochs * epoch + workers * index)
    put, write_other = objects, shards * WRITE_EXTRA_PER_SHARD
    return {"put_cache": put, "other_cache": write_other, "get_per_sample": round(per_sample, 2),
            "get_per_epoch": round(epoch), "get_per_run": round(run), "epochs": epochs, "drafters": drafters,
            "usd_cache": round((put * PUT_PRICE_PER_1000 + write_other * GET_PRICE_PER_1000) / 1000, 4),
            "usd_run": round(run * GET_PRICE_PER_1000 / 1000, 4)}


def shard_objects(num_samples: int, num_tokens: int, num_hidden_rows: int, *, feature_width: int,
                  hidden_size: int, feature_dtype: str, storage: StorageConfig) -> int:
    """Objects one shard will hold: group and array ``zarr.json`` files, one object per zarr
    shard of each array (``cache_schema.writer.expected_objects``), and the commit record."""
    specs = array_specs(num_samples, num_tokens, num_hidden_rows, feature_width=feature_width,
                        hidden_size=hidden_size, feature_dtype=feature_dtype)
    return 1 + len(expected_objects({name: (shape, dtype.itemsize) for name, (dtype, shape) in specs.items()},
                                    storage))


def render_counts(item: tuple[int, Any], cfg, local_dir: str) -> dict[str, Any]:
    """Counts of one planned shard, rendered by ``pipeline.stages.cache.render_shard`` (a process task)."""
    from pipeline.stages.cache import render_shard

    shard, span = item
    r = render_shard(span, shard, cfg, local_dir)
    return {"shard": shard, "rows": span.row_end - span.row_start, "samples": r["num_samples"],
            "tokens": r["num_tokens"], "supervised": r["num_supervised"], "hidden_rows": r["num_hidden_rows"],
            "skipped": r["skipped"], "quarantined": r["bad"] != "[]"}


def feature_modes(counts: list[dict[str, Any]], cfg, nbytes: int, objects: int) -> dict[str, dict[str, Any]]:
    """The trade-off of ``train.features`` for this run: storage and prefill work of each mode.

    Args:
        counts: per planned shard ``{"shard", "samples", "tokens"}`` (:func:`render_counts`).
        nbytes, objects: the cache's estimated bytes and objects.
    Returns:
        per mode: ``bytes`` and ``objects`` stored (checkpoints and metrics aside), and prefill
        token-passes (target forward tokens): ``prefill_tokens_before_training`` (cache stage),
        ``prefill_tokens_per_epoch`` (epoch by epoch, over all drafters: each drafter's run streams
        its own prefill), ``prefill_tokens_run`` and ``prefills`` (the run's token-passes over the
        cache's tokens). Online also prefills the validation shards once per drafter run; it never
        prefills the held-out shards (calibrate and evaluate read them from a cache).
    """
    from cache_schema.split import split_shards

    by = {c["shard"]: c for c in counts}
    tokens = sum(c["tokens"] for c in counts)
    drafters, epochs = len(cfg.train.drafters), cfg.train.epochs
    try:
        split = split_shards({s: c["samples"] for s, c in by.items()}, cfg.train.heldout_shards,
                             cfg.train.validation_shards)
        train = sum(by[s]["tokens"] for s in split.train)
        val = sum(by[s]["tokens"] for s in split.validation)
    except ValueError:
        train, val = tokens, 0
    online_epoch = train * drafters
    online = online_epoch * epochs + val * drafters
    hybrid_epochs = [tokens * drafters] + [0] * (epochs - 1)
    return {
        "cache": {"bytes": nbytes, "objects": objects, "prefill_tokens_before_training": tokens,
                  "prefill_tokens_per_epoch": [0] * epochs, "prefill_tokens_run": tokens,
                  "prefills": round(tokens / max(tokens, 1), 3)},
        "online": {"bytes": 0, "objects": 0, "prefill_tokens_before_training": val * drafters,
                   "prefill_tokens_per_epoch": [online_epoch] * epochs, "prefill_tokens_run": online,
                   "prefills": round(online / max(tokens, 1), 3)},
        "hybrid": {"bytes": nbytes, "objects": objects, "prefill_tokens_before_training": val * drafters,
                   "prefill_tokens_per_epoch": hybrid_epochs, "prefill_tokens_run": tokens * drafters,
                   "prefills": round(tokens * drafters / max(tokens, 1), 3)},
    }


BEFORE_GENERATE = ("generate has not run yet ({done} of {total} generate shards committed): these figures are of "
                   "the input chats' own assistant answers (the target's rewrites will differ in length, each at "
                   "most generate.max_new_tokens tokens; prompt-only rows count as skipped here); rerun after "
                   "+stage=generate for the real figures")


def _clip(spans: list, ends: dict[int, int], max_rows: int | None) -> list:
    """The spans cut to rows below ``ends[source]``, then the prefix of whole spans holding at least
    ``max_rows`` rows (as :func:`pipeline.chats.ingest.plan_shards` keeps one)."""
    kept, rows = [], 0
    for s in spans:
        if s.row_start >= ends.get(s.source, 0) or (max_rows is not None and rows >= max_rows):
            continue
        kept.append(replace(s, row_end=min(s.row_end, ends[s.source])))
        rows += kept[-1].row_end - kept[-1].row_start
    return kept


def input_plan(cfg, generate_plan: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Cache shards over the input rows the generate stage will rewrite, read as they are: the rows
    of ``generate_plan`` (``generate.max_rows``' prefix of whole generate spans of ``data.train_files``),
    cut by ``cache.rows_per_shard``, ``cache.max_rows`` applied.

    Raises:
        BadInputFileError: a missing or unreadable file.
    """
    from pipeline.chats.ingest import plan_shards
    from pipeline.paths import resolve_input

    ends: dict[int, int] = {}
    for _, span in generate_plan:
        ends[span.source] = max(ends.get(span.source, 0), span.row_end)
    files = [resolve_input(f) for f in cfg.data.train_files]
    spans = [span for _, span in plan_shards(files, cfg.cache.rows_per_shard)]
    return list(enumerate(_clip(spans, ends, cfg.cache.max_rows)))


def estimate_plan(cfg) -> tuple[list[tuple[int, Any]], str | None]:
    """``(planned cache shards, note)``: the cache stage's own plan, or, when ``generate.enabled`` and
    the generate stage has not committed every shard yet, :func:`input_plan` with the note
    :data:`BEFORE_GENERATE` (the documented use: sizing a run before any GPU work).

    Raises:
        PipelineError, GenerateSettingsMismatchError, BadInputFileError: as the cache stage's plan.
    """
    from pipeline.stages import generate
    from pipeline.stages.cache import plan

    if cfg.generate.enabled:
        shards, records = generate.plan(cfg), generate.committed_records(generate.generate_url(cfg))
        done = sum(i in records for i, _ in shards)
        if done < len(shards):
            return input_plan(cfg, shards), BEFORE_GENERATE.format(done=done, total=len(shards))
    return plan(cfg), None


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

    Before the generate stage has run (``generate.enabled`` and its shards not all committed) the
    input chats are sized as they are and ``payload["note"]`` says so (:func:`estimate_plan`).
    """
    from tqdm import tqdm
    from transformers import AutoConfig

    from ops.common import UsageError
    from pipeline.stages.cache import cache_url, storage_config
    from pipeline.chats.ingest import RowCounts
    from pipeline.run import load_config
    from pipeline.target_model.loader import resolve_target_path

    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    cfg = load_config(config, overrides)
    local_dir = resolve_target_path(cfg.target.path)
    model_config = AutoConfig.from_pretrained(local_dir, local_files_only=True)
    hidden, layers = int(model_config.hidden_size), len(cfg.target.target_layer_ids)
    dtype, storage = cfg.cache.feature_dtype.value, storage_config(cfg)
    shards, note = estimate_plan(cfg)
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
    requests = request_costs(shards=len(counts), samples=samples, tokens=tokens, hidden_rows=hidden_rows,
                             objects=objects, feature_width=layers * hidden, hidden_size=hidden, feature_dtype=dtype,
                             chunk_bytes=storage.chunk_bytes, epochs=cfg.train.epochs,
                             drafters=len(cfg.train.drafters), workers=cfg.train.num_workers)
    modes = feature_modes(counts, cfg, total, objects)
    payload = {"cache": cache_url(cfg), "note": note, "target": cfg.target.path, "features": cfg.train.features.value,
               "modes": modes, "hidden_size": hidden,
               "target_layer_ids": list(cfg.target.target_layer_ids), "feature_dtype": dtype,
               "storage": asdict(storage), "shards": len(counts), "rows": sum(c["rows"] for c in counts),
               "samples": samples, "tokens": tokens, "supervised_tokens": sum(c["supervised"] for c in counts),
               "hidden_rows": hidden_rows, "skipped_rows": dict(sorted(skipped.skipped.items())),
               "bytes": total, "bytes_per_token": round(est.bytes_per_token, 2), "objects": objects,
               "requests": requests, "budget_bytes": budget, "over_budget": budget is not None and total > budget}
    return payload, int(payload["over_budget"])


def render_estimate(p: dict[str, Any]) -> str:
    """Human view of :func:`estimate`."""
    r = p["requests"]
    budget = "-" if p["budget_bytes"] is None else (
        f"{human_bytes(p['budget_bytes'])} ({'OVER' if p['over_budget'] else 'within'})")
    return "\n".join([*([f"note: {p['note']}", ""] if p.get("note") else []), key_values([
        ("cache", p["cache"]), ("target", f"{p['target']} (hidden {p['hidden_size']}, layers "
                                          f"{p['target_layer_ids']}, features {p['feature_dtype']})"),
        ("shards", p["shards"]), ("input rows", p["rows"]), ("samples", p["samples"]), ("tokens", p["tokens"]),
        ("supervised tokens", p["supervised_tokens"]),
        ("bytes", f"{p['bytes']:,} ({human_bytes(p['bytes'])}), arrays and per-shard zarr metadata"),
        ("bytes/token", p["bytes_per_token"]),
        ("objects", p["objects"]), ("budget", budget),
        ("requests: cache", f"{r['put_cache']:,} PUT + {r['other_cache']:,} other (${r['usd_cache']:,.2f})"),
        ("requests: train", f"{r['get_per_epoch']:,} reads (GET/HEAD/LIST) per epoch ({r['get_per_sample']} "
                            f"per sample); {r['get_per_run']:,} per run of {r['epochs']} epochs x {r['drafters']} "
                            f"drafters (${r['usd_run']:,.2f} at the GET price)")]), "",
        f"train.features (configured: {p['features']}): storage and prefill token-passes of {r['epochs']} epochs x "
        f"{r['drafters']} drafters", table([{
            "mode": m, "stored": f"{human_bytes(v['bytes'])}, {v['objects']:,} objects" if v["bytes"] else "nothing",
            "prefill before training": f"{v['prefill_tokens_before_training']:,}",
            "prefill per epoch": " / ".join(f"{t:,}" for t in v["prefill_tokens_per_epoch"]),
            "prefill per run": f"{v['prefill_tokens_run']:,} ({v['prefills']:g} prefills)"}
            for m, v in p["modes"].items()],
            ["mode", "stored", "prefill before training", "prefill per epoch", "prefill per run"]),
        "", "skipped rows:",
        table([{"reason": k, "rows": v} for k, v in p["skipped_rows"].items()], ["reason", "rows"])])
