"""Read-only listings of a cache: ``ls`` (shards), ``stat`` (the whole cache), ``du`` (bytes).

Each command returns ``(payload, exit code)``; ``payload`` is the ``--json`` output and a
``render_*`` function turns it into the human view.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from cache_schema import ShardRecord
from cache_schema.layout import shard_name
from ops.common import GROUP_METADATA, UsageError, open_root, uncommitted_shards
from ops.report import cell, human_bytes, key_values, table

# ---- ls ---------------------------------------------------------------------------------------

def ls(url: str) -> tuple[dict[str, Any], int]:
    """Every shard with its state (committed/uncommitted), samples, tokens, bytes, writer and time.

    Uncommitted shards show only their bytes and object count (they have no record).
    Returns:
        (payload, 0). Raises: UsageError, CacheError (a corrupt commit record).
    """
    root = open_root(url)
    records = root.committed_records()
    rows = [{"shard": i, "state": "committed", "samples": r.num_samples, "tokens": r.num_tokens,
             "bytes": r.total_bytes, "objects": len(r.object_bytes), "writer": r.writer_id,
             "time": r.created_utc} for i, r in records.items()]
    for i in uncommitted_shards(root, set(records)):
        sizes = root.shard_objects(i)
        rows.append({"shard": i, "state": "uncommitted", "samples": None, "tokens": None,
                     "bytes": sum(sizes.values()), "objects": len(sizes), "writer": None, "time": None})
    rows.sort(key=lambda row: row["shard"])
    return {"url": root.url, "committed": len(records), "uncommitted": len(rows) - len(records),
            "samples": sum(r.num_samples for r in records.values()),
            "tokens": sum(r.num_tokens for r in records.values()), "shards": rows}, 0


def render_ls(p: dict[str, Any]) -> str:
    """Human view of :func:`ls`."""
    rows = [{**row, "shard": shard_name(row["shard"]), "size": human_bytes(row["bytes"])} for row in p["shards"]]
    cols = ["shard", "state", "samples", "tokens", "size", "objects", "writer", "time"]
    return (f"{table(rows, cols)}\n{p['committed']:,} committed, {p['uncommitted']:,} uncommitted; "
            f"{p['samples']:,} samples, {p['tokens']:,} tokens")


# ---- stat -------------------------------------------------------------------------------------

def plan_coverage(records: dict[int, ShardRecord], data_files: list[str],
                  rows_per_shard: int | None) -> dict[str, Any]:
    """What of the input dataset the committed shards cover, planned as the cache stage plans it.

    Shards are numbered across ``data_files`` in order (source index = position in the list, as
    in ``data.train_files``); a planned span is covered when a committed record's ``extra``
    holds the same ``source`` and ``rows`` [start, end).

    Args:
        rows_per_shard: the run's ``cache.rows_per_shard``; None infers it as the longest committed span.
    Returns:
        {files, rows, rows_per_shard, planned_shards, missing (list of {shard, source, file, rows}),
        missing_rows, unplanned (committed shards whose span is not in the plan)}.
    Raises:
        UsageError: rows_per_shard not given and no record holds a row range.
        BadInputFileError: a data file is missing or unreadable.
    """
    from pipeline.chats.ingest import plan_spans

    spans_of = {i: (r.extra["source"], tuple(r.extra["rows"])) for i, r in records.items()
                if "source" in r.extra and "rows" in r.extra}
    if rows_per_shard is None:
        if not spans_of:
            raise UsageError("the commit records hold no row ranges (extra.rows); pass "
                             "--rows-per-shard with the run's cache.rows_per_shard")
        rows_per_shard = max(end - start for _, (start, end) in spans_of.values())
    planned = [s for source, url in enumerate(data_files) for s in plan_spans(url, source, rows_per_shard)]
    covered = set(spans_of.values())
    missing = [{"shard": i, "source": s.source, "file": s.url, "rows": [s.row_start, s.row_end]}
               for i, s in enumerate(planned) if (s.source, (s.row_start, s.row_end)) not in covered]
    plan_keys = {(s.source, (s.row_start, s.row_end)) for s in planned}
    return {"files": len(data_files), "rows": sum(s.row_end - s.row_start for s in planned),
            "rows_per_shard": rows_per_shard, "planned_shards": len(planned), "missing": missing,
            "missing_rows": sum(m["rows"][1] - m["rows"][0] for m in missing),
            "unplanned": sorted(i for i, key in spans_of.items() if key not in plan_keys)}


def stat(url: str, data_files: list[str] | None = None,
         rows_per_shard: int | None = None) -> tuple[dict[str, Any], int]:
    """The cache as a whole: fingerprint, schema version, totals, skipped rows, and coverage.

    Args:
        data_files: the input dataset (``data.train_files`` in order); when given, reports the
            shards and row ranges not yet cached (see :func:`plan_coverage`).
    Returns:
        (payload, 1 when rows are missing or shards are unplanned, else 0).
    """
    from pipeline.stages.cache import cache_totals

    root = open_root(url)
    totals = cache_totals(root.url)
    fingerprint = totals.pop("fingerprint")
    payload = {"url": root.url, "schema_version": fingerprint["schema_version"],
               "fingerprint": fingerprint, "fingerprint_sha256": root.fingerprint.digest(),
               "totals": totals, "coverage": None}
    if not data_files:
        return payload, 0
    coverage = plan_coverage(root.committed_records(), data_files, rows_per_shard)
    payload["coverage"] = coverage
    return payload, int(bool(coverage["missing"] or coverage["unplanned"]))


def render_stat(p: dict[str, Any]) -> str:
    """Human view of :func:`stat`."""
    fp, t = p["fingerprint"], p["totals"]
    target = fp["target"]
    out = [key_values([
        ("cache", p["url"]), ("schema version", p["schema_version"]),
        ("fingerprint", p["fingerprint_sha256"][:16]),
        ("target", f"{target.get('model_type', '?')} hidden {target['hidden_size']}, "
                   f"{target.get('num_hidden_layers', '?')} layers, vocab {target.get('vocab_size', '?')}, "
                   f"config {str(target.get('config_sha256', '?'))[:12]}"),
        ("target layer ids", fp["target_layer_ids"]),
        ("dtypes", f"features {fp['feature_dtype']}, last_hidden {fp['hidden_dtype']}"),
        ("embed / lm_head", f"{fp['embed_hash'][:12]} / {fp['lm_head_hash'][:12]}"),
        ("tokenizer", fp["tokenizer_hash"][:12]), ("chat template", fp["chat_template_hash"][:12]),
        ("render options", json.dumps(fp["render_options"], sort_keys=True)),
        ("max length", fp["max_length"]), ("min loss tokens", fp["min_loss_tokens"]),
        ("shards", t["shards"]), ("samples", t["samples"]), ("tokens", t["tokens"]),
        ("supervised tokens", t["supervised_tokens"]),
        ("bytes", f"{t['bytes']:,} ({human_bytes(t['bytes'])})"), ("bytes/token", t["bytes_per_token"])])]
    skipped = [{"reason": k, "rows": v} for k, v in t["skipped_rows"].items()]
    out += ["", "skipped rows:", table(skipped, ["reason", "rows"])]
    cov = p["coverage"]
    if cov is not None:
        out += ["", f"input: {cov['files']} files, {cov['rows']:,} rows, {cov['planned_shards']:,} shards "
                    f"of {cov['rows_per_shard']} rows; missing {len(cov['missing']):,} shards "
                    f"({cov['missing_rows']:,} rows)"]
        if cov["missing"]:
            out.append(table([{**m, "rows": f"{m['rows'][0]}-{m['rows'][1]}"} for m in cov["missing"]],
                             ["shard", "source", "file", "rows"]))
        if cov["unplanned"]:
            out.append(f"committed shards not in this plan (other inputs or rows_per_shard?): "
                       f"{cov['unplanned']}")
    return "\n".join(out)


# ---- du ---------------------------------------------------------------------------------------

def array_of(key: str) -> str:
    """The array an object of a shard group belongs to (``features/c/0/0`` -> ``features``)."""
    return key.split("/", 1)[0] if "/" in key else GROUP_METADATA


def du(url: str) -> tuple[dict[str, Any], int]:
    """Committed bytes by array and by shard, and per token (from the commit records).

    Returns:
        (payload, 0): ``arrays`` [{array, bytes, objects, bytes_per_token, share}], ``shards``
        [{shard, samples, tokens, bytes, bytes_per_token}], totals.
    """
    root = open_root(url)
    records = root.committed_records()
    tokens = sum(r.num_tokens for r in records.values())
    total = sum(r.total_bytes for r in records.values())
    nbytes, objects = Counter(), Counter()
    for r in records.values():
        for key, size in r.object_bytes.items():
            nbytes[array_of(key)] += size
            objects[array_of(key)] += 1
    arrays = [{"array": name, "bytes": n, "objects": objects[name], "bytes_per_token": per_token(n, tokens),
               "share": round(n / max(total, 1), 4)} for name, n in nbytes.most_common()]
    shards = [{"shard": i, "samples": r.num_samples, "tokens": r.num_tokens, "bytes": r.total_bytes,
               "bytes_per_token": per_token(r.total_bytes, r.num_tokens)} for i, r in records.items()]
    return {"url": root.url, "tokens": tokens, "bytes": total, "bytes_per_token": per_token(total, tokens),
            "arrays": arrays, "shards": shards}, 0


def per_token(nbytes: int, tokens: int) -> float | None:
    """Bytes per token rounded to 0.01; None for no tokens."""
    return round(nbytes / tokens, 2) if tokens else None


def render_du(p: dict[str, Any]) -> str:
    """Human view of :func:`du`."""
    arrays = [{**a, "size": human_bytes(a["bytes"]), "share": f"{100 * a['share']:.1f}%"} for a in p["arrays"]]
    shards = [{**s, "shard": shard_name(s["shard"]), "size": human_bytes(s["bytes"])} for s in p["shards"]]
    return "\n".join([
        table(arrays, ["array", "bytes", "size", "objects", "bytes_per_token", "share"]), "",
        table(shards, ["shard", "samples", "tokens", "bytes", "size", "bytes_per_token"]), "",
        f"total {p['bytes']:,} bytes ({human_bytes(p['bytes'])}) for {p['tokens']:,} tokens: "
        f"{cell(p['bytes_per_token'])} bytes/token"])
