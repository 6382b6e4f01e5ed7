"""``ops sample``: one cached sample decoded (text, supervised spans, feature norms), optionally
beside the target's own top tokens recomputed from the local target (the one place ops loads a
model, lazily)."""
from __future__ import annotations

import json
from itertools import groupby
from operator import itemgetter
from typing import Any

import numpy as np

from cache_schema import CacheReader, CacheRoot, ShardRecord
from cache_schema.fingerprint import tokenizer_sha256
from cache_schema.layout import ROW, SOURCE, shard_name
from ops.common import QUARANTINE_DIR, UsageError, open_root, open_group, sample_starts
from ops.report import key_values, table

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
    payload["tokenizer_matches_cache"] = tokenizer_sha256(tok) == fp.tokenizer_hash
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
