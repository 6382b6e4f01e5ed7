"""What the ops commands share: opening a cache read-only, the listings of shard groups and
uncommitted shards, a shard's objects and Zarr group, and the usage error (exit code 2)."""
from __future__ import annotations

from typing import Any

import fsspec
import numpy as np
import zarr

from cache_schema import CacheRoot, CorruptRecordError, ShardRecord, open_cache
from cache_schema.layout import SHARDS_DIR, commit_key, parse_shard_name, shard_group_key

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
