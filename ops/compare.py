"""``diff``: two caches compared by sample id and content hash, and shard by shard by data checksum.

The tool that proves a resume exact: a killed-and-rerun cache and an uninterrupted one must hold
the same sample ids with the same content hashes, each once, and (shard contents being a
deterministic function of inputs and config) the same array checksums in every shard. Reads only
commit records and shard group metadata (one small object per shard), never the arrays.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from cache_schema import CacheRoot, ShardRecord
from cache_schema.layout import ATTR_CONTENT_HASHES, ATTR_SAMPLE_IDS, shard_group_key
from ops.common import open_root
from ops.report import key_values, preview

DIFF_KEYS = ("fingerprint", "only_in_a", "only_in_b", "content_differs", "duplicates_a", "duplicates_b",
             "shards_only_in_a", "shards_only_in_b", "shard_data_differs", "unreadable_a", "unreadable_b")


def sample_hashes(root: CacheRoot, records: dict[int, ShardRecord]) -> tuple[dict[str, str], list[str], list[int]]:
    """Sample id -> content hash over the committed shards (one batched read of the groups'
    ``zarr.json``), the ids seen more than once, and the shards whose metadata is unreadable."""
    paths = {f"{root.path}/{shard_group_key(i)}/zarr.json": i for i in records}
    texts = root.fs.cat(list(paths), on_error="return") if paths else {}
    hashes, counts, unreadable = {}, Counter(), []
    for path, i in paths.items():
        try:
            attrs = json.loads(texts[path])["attributes"]
            ids, content = attrs[ATTR_SAMPLE_IDS], attrs[ATTR_CONTENT_HASHES]
        except (KeyError, TypeError, ValueError):  # missing object (an exception value) or bad JSON
            unreadable.append(i)
            continue
        hashes.update(zip(ids, content))
        counts.update(ids)
    return hashes, sorted(k for k, n in counts.items() if n > 1), sorted(unreadable)


def diff(url_a: str, url_b: str) -> tuple[dict[str, Any], int]:
    """Compare caches A and B.

    Returns:
        (payload, 0 when identical else 1). ``payload``: fingerprint differences
        [[field, a, b]], sample counts, ids only in A / only in B, ids whose content hash
        differs, ids duplicated within A or B, shards committed in one only, shards committed in
        both whose array checksums differ, shards whose metadata is unreadable, ``differences``
        (the names of the non-empty ones) and ``identical``.
    """
    root_a, root_b = open_root(url_a), open_root(url_b)
    rec_a, rec_b = root_a.committed_records(), root_b.committed_records()
    (hash_a, dup_a, bad_a), (hash_b, dup_b, bad_b) = sample_hashes(root_a, rec_a), sample_hashes(root_b, rec_b)
    both = sorted(set(rec_a) & set(rec_b))
    payload = {
        "a": root_a.url, "b": root_b.url,
        "fingerprint": [list(d) for d in root_a.fingerprint.diff(root_b.fingerprint)],
        "samples_a": sum(r.num_samples for r in rec_a.values()),
        "samples_b": sum(r.num_samples for r in rec_b.values()),
        "only_in_a": sorted(set(hash_a) - set(hash_b)), "only_in_b": sorted(set(hash_b) - set(hash_a)),
        "content_differs": sorted(k for k in set(hash_a) & set(hash_b) if hash_a[k] != hash_b[k]),
        "duplicates_a": dup_a, "duplicates_b": dup_b,
        "shards_only_in_a": sorted(set(rec_a) - set(rec_b)), "shards_only_in_b": sorted(set(rec_b) - set(rec_a)),
        "shard_data_differs": [i for i in both if rec_a[i].checksums != rec_b[i].checksums],
        "unreadable_a": bad_a, "unreadable_b": bad_b}
    payload["differences"] = [k for k in DIFF_KEYS if payload[k]]
    payload["identical"] = not payload["differences"]
    return payload, int(not payload["identical"])


def render_diff(p: dict[str, Any]) -> str:
    """Human view of :func:`diff`."""
    lines = [f"A {p['a']}: {p['samples_a']:,} samples", f"B {p['b']}: {p['samples_b']:,} samples"]
    if p["identical"]:
        return "\n".join(lines + ["identical: same sample ids, content hashes and shard checksums"])
    fields = [f"{name} ({a!r} vs {b!r})" for name, a, b in p["fingerprint"]]
    shown = {"fingerprint": fields, **{k: p[k] for k in DIFF_KEYS[1:]}}
    return "\n".join(lines + [key_values([(k.replace("_", " "), f"{len(shown[k]):,}: {preview(shown[k])}")
                                          for k in p["differences"]])])
