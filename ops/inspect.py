"""Read-only views of a cache: ``ls`` (shards), ``stat`` (the whole cache), ``du`` (bytes), ``sample``.

Also the cache-access helpers the other commands share (:func:`open_root`, listings of shard
groups and uncommitted shards). Each command returns ``(payload, exit code)``; ``payload`` is the
``--json`` output and a ``render_*`` function turns it into the human view.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from itertools import groupby
from operator import itemgetter
from typing import Any

import fsspec
import numpy as np
import zarr

from cache_schema import CacheReader, CacheRoot, CorruptRecordError, ShardRecord, open_cache
from cache_schema.layout import (ROW, SHARDS_DIR, SOURCE, commit_key, parse_shard_name, shard_group_key,
                                 shard_name)
from ops.report import cell, human_bytes, key_values, table

GROUP_METADATA = "(group metadata)"
QUARANTINE_DIR = "quarantine"  # <cache>/quarantine/<shard>.jsonl, written by the cache stage


class UsageError(Exception):
    """A problem with what the user asked for (bad URL or argument, not a cache): exit code 2."""


def open_root(url: str) -> CacheRoot:
    """Open an existing cache read-only.

    Raises:
        UsageError: the URL's protocol is unknown or its backend is not installed.
        CacheNotFoundError: no ``fingerprint.json`` at the URL (not a cache).
    """
    try:
        fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as exc:
        raise UsageError(f"cannot open {url}: {exc}; use a path or an fsspec URL such as "
                         "s3://bucket/run/cache") from None
    return open_cache(url, create=False)


def shard_groups(root: CacheRoot) -> list[int]:
    """Ascending indices of the shard groups present under ``shards/`` (committed or not)."""
    folder = f"{root.path}/{SHARDS_DIR}"
    root.fs.invalidate_cache(folder)
    try:
        names = root.fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []
    indices = (parse_shard_name(name.rstrip("/").rsplit("/", 1)[-1]) for name in names)
    return sorted(i for i in indices if i is not None)


def uncommitted_shards(root: CacheRoot, committed: set[int]) -> list[int]:
    """Shard groups that have objects but no commit record (left by a crashed or running writer)."""
    return [i for i in shard_groups(root) if i not in committed]


def group_objects(root: CacheRoot, shard_index: int) -> dict[str, dict[str, Any]]:
    """fsspec info of every object under a shard group, keyed by full backend path."""
    group = f"{root.path}/{shard_group_key(shard_index)}"
    root.fs.invalidate_cache(group)
    try:
        return {k: v for k, v in root.fs.find(group, detail=True).items() if v["type"] == "file"}
    except FileNotFoundError:
        return {}


def open_group(root: CacheRoot, shard_index: int) -> zarr.Group:
    """A shard's Zarr group, read-only (a missing object raises FileNotFoundError, not fill values).

    Raises:
        CorruptRecordError: the shard's Zarr metadata cannot be parsed (names the fix).
    """
    try:
        return zarr.open_group(root.shard_store(shard_index, read_only=True), mode="r", zarr_format=3)
    except ValueError as exc:  # json.JSONDecodeError and zarr's metadata errors
        raise CorruptRecordError(
            f"shard {shard_index}: its zarr metadata is unreadable ({type(exc).__name__}: {exc}); the shard is "
            f"damaged: delete {commit_key(shard_index)} under {root.url} and rerun the cache stage") from exc


def sample_starts(records: dict[int, ShardRecord]) -> dict[int, int]:
    """Global index of each committed shard's first sample (shards in ascending order)."""
    starts = np.cumsum([0] + [records[i].num_samples for i in sorted(records)])
    return {i: int(s) for i, s in zip(sorted(records), starts)}


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
    from pipeline.chats import plan_spans

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
    from pipeline.cache import cache_totals

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


# ---- sample -----------------------------------------------------------------------------------

def find_row(root: CacheRoot, records: dict[int, ShardRecord], source: int, row: int) -> tuple[int, int]:
    """(shard, position in shard) of the sample cached from input ``source``, ``row``.

    Looks only in shards whose record's row range holds the row (all shards when records carry
    no ranges). Raises UsageError naming the quarantine reason when the row was skipped.
    """
    ranged = {i: r.extra for i, r in records.items() if "rows" in r.extra}
    hits = [i for i, e in ranged.items() if e.get("source") == source and e["rows"][0] <= row < e["rows"][1]]
    for i in hits if ranged else list(records):
        group = open_group(root, i)
        found = np.flatnonzero((group[SOURCE][:] == source) & (group[ROW][:] == row))
        if found.size:
            return i, int(found[0])
    reason = next((q for i in hits for q in _quarantine(root, i) if q.get("row") == row), None)
    why = (f"it was skipped: {reason['reason']} ({reason.get('detail', '')})" if reason else
           "it is not in a committed shard")
    raise UsageError(f"no sample from source {source} row {row} in {root.url}: {why}")


def _quarantine(root: CacheRoot, shard_index: int) -> list[dict[str, Any]]:
    path = f"{root.path}/{QUARANTINE_DIR}/{shard_name(shard_index)}.jsonl"
    try:
        return [json.loads(line) for line in root.fs.cat_file(path).decode().splitlines() if line]
    except FileNotFoundError:
        return []


def segments(ids: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """Runs of equal loss-mask value: ``[(supervised, token ids), ...]`` in order."""
    return [(bool(m), [token for token, _ in run]) for m, run in groupby(zip(ids, mask), key=itemgetter(1))]


def feature_norms(features, last_hidden, layer_ids: list[int]) -> list[dict[str, Any]]:
    """Mean and max L2 norm per token of each captured layer (features [T, L*H] bf16) and of
    last_hidden [T_sup, H]."""
    t, width = features.shape
    per_layer = features.float().reshape(t, len(layer_ids), width // len(layer_ids)).norm(dim=-1)
    rows = [{"layer": str(k), "mean_norm": float(per_layer[:, j].mean()), "max_norm": float(per_layer[:, j].max())}
            for j, k in enumerate(layer_ids)]
    last = last_hidden.float().norm(dim=-1)
    rows.append({"layer": "last_hidden", "mean_norm": float(last.mean()) if len(last) else None,
                 "max_norm": float(last.max()) if len(last) else None})
    return rows


def load_target_model(target_dir: str, dtype: str, hidden_size: int):
    """The target model from local files, in the cache's prefill dtype.

    Raises:
        UsageError: its hidden size is not the cache's (another target).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch_dtype, local_files_only=True).eval()
    if model.config.hidden_size != hidden_size:
        raise UsageError(f"--target {target_dir} has hidden size {model.config.hidden_size}, the cache's target "
                         f"has {hidden_size}: point --target at the model the cache was built from")
    return model


def target_top_tokens(model, sample, tokenizer, positions: list[int],
                      top_k: int) -> tuple[list[dict[str, Any]], float | None]:
    """The target's top-k next tokens at ``positions`` (a forward pass over the sample's tokens),
    and the max abs difference between its final hidden state and the cached ``last_hidden``."""
    import torch

    ids = sample.input_ids.long()
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
    probs = out.logits[0].float().softmax(-1)
    rows = []
    for pos in positions:
        p, top = probs[pos], probs[pos].topk(top_k)
        nxt = int(ids[pos + 1]) if pos + 1 < len(ids) else None
        rows.append({"position": pos, "next_token": nxt,
                     "next_prob": None if nxt is None else float(p[nxt]),
                     "top": [{"id": int(i), "text": tokenizer.decode([int(i)]), "prob": float(v)}
                             for v, i in zip(top.values, top.indices)]})
    sup_positions = torch.nonzero(sample.loss_mask[1:] == 1).flatten()
    final = out.hidden_states[-1][0, sup_positions].float()
    diff = float((final - sample.last_hidden.float()).abs().max()) if len(sup_positions) else None
    return rows, diff


def sample(url: str, index: int | None = None, source_row: tuple[int, int] | None = None,
           target: str | None = None, positions: list[int] | None = None,
           top_k: int = 5) -> tuple[dict[str, Any], int]:
    """One sample by global index or by (source, row): provenance, text with the supervised span
    marked (needs ``target``, a local folder with the tokenizer), feature norms per layer, and
    with the target the top-k next tokens at ``positions`` (default: the first 3 positions
    whose next token is supervised).

    Raises:
        UsageError: index out of range, row not cached, position outside the sample.
        NonFiniteSampleError / MissingObjectError: the sample is damaged (run verify).
    """
    if target is None and positions is not None:
        raise UsageError("--positions needs --target (the target model computes the top tokens)")
    if top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    root = open_root(url)
    reader = CacheReader(root.url)
    if source_row is not None:
        shard, k = find_row(root, reader.records, *source_row)
        index = sample_starts(reader.records)[shard] + k
    if index is None or not 0 <= index < len(reader):
        raise UsageError(f"sample index {index} is outside [0, {len(reader)}) of {root.url}")
    shard, k = reader.locate(index)
    s = reader.sample(index)
    ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
    fp = reader.fingerprint
    payload: dict[str, Any] = {
        "url": root.url, "index": index, "shard": shard, "position": k, "sample_id": s.sample_id,
        "source": s.source, "row": s.row, "content_hash": s.content_hash, "tokens": s.num_tokens,
        "supervised_tokens": s.num_supervised_tokens,
        "norms": feature_norms(s.features, s.last_hidden, list(fp.target_layer_ids)),
        "segments": [{"supervised": sup, "ids": run} for sup, run in segments(ids, mask)],
        "tokenizer_matches_cache": None, "top_tokens": None, "last_hidden_max_abs_diff": None}
    if target is None:
        return payload, 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    state = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else repr(tok)
    payload["tokenizer_matches_cache"] = hashlib.sha256(state.encode()).hexdigest() == fp.tokenizer_hash
    for seg in payload["segments"]:
        seg["text"] = tok.decode(seg["ids"])
    if positions is None:
        positions = [i for i in range(len(ids) - 1) if mask[i + 1]][:3]
    bad = [p for p in positions if not 0 <= p < len(ids)]
    if bad:
        raise UsageError(f"positions {bad} are outside the sample's {len(ids)} tokens")
    model = load_target_model(target, fp.target.get("prefill_dtype", "float32"), fp.hidden_size)
    payload["top_tokens"], payload["last_hidden_max_abs_diff"] = target_top_tokens(
        model, s, tok, positions, min(top_k, model.config.vocab_size))
    return payload, 0


def render_sample(p: dict[str, Any]) -> str:
    """Human view of :func:`sample`: the supervised span is shown between ``<<`` and ``>>``."""
    out = [key_values([("sample", f"{p['index']} (shard {p['shard']} position {p['position']})"),
                       ("id", p["sample_id"]), ("source / row", f"{p['source']} / {p['row']}"),
                       ("content hash", p["content_hash"]),
                       ("tokens", f"{p['tokens']:,} ({p['supervised_tokens']:,} supervised)")])]
    if p["tokenizer_matches_cache"] is False:
        out.append("warning: this tokenizer's hash differs from the cache fingerprint's; the text may be wrong")
    glue = "" if p["segments"] and "text" in p["segments"][0] else " "  # token ids need separating
    parts = [seg.get("text", " ".join(map(str, seg["ids"]))) for seg in p["segments"]]
    out += ["", glue.join(f"<<{t}>>" if seg["supervised"] else t for seg, t in zip(p["segments"], parts)), "",
            table(p["norms"], ["layer", "mean_norm", "max_norm"])]
    for row in p["top_tokens"] or []:
        top = ", ".join(f"{t['text']!r} {t['prob']:.3f}" for t in row["top"])
        out.append(f"position {row['position']} (next {row['next_token']}, p={_prob(row['next_prob'])}): {top}")
    if p["last_hidden_max_abs_diff"] is not None:
        out.append(f"cached last_hidden vs target: max abs diff {p['last_hidden_max_abs_diff']:.4g}")
    return "\n".join(out)


def _prob(p: float | None) -> str:
    """A probability with 3 decimals, ``-`` for None."""
    return "-" if p is None else f"{p:.3f}"
