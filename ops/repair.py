"""``gc``: find (and with ``--yes`` delete) what crashed writers left: uncommitted shard objects.

A shard is garbage when it has objects (its Zarr group, or its quarantine file) but no commit
record. The cache stage rewrites such shards on its next run anyway, so deleting them loses
nothing; it only frees space. Committed shards are never touched. A shard whose newest object is
younger than ``min_age_s`` is kept, since a writer may still be writing it, and each shard is
checked for a commit record again right before its deletion.
"""
from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from cache_schema import CacheRoot
from cache_schema.layout import parse_shard_name, shard_group_key, shard_name
from ops.common import QUARANTINE_DIR, group_objects, open_root, shard_groups
from ops.report import human_bytes, table

DEFAULT_MIN_AGE_S = 3600.0


def mtime(info: dict[str, Any]) -> float | None:
    """Last-modified time (POSIX seconds) from an fsspec info dict (local ``mtime``, S3
    ``LastModified``, GCS ``updated``); None when the backend gives none."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


def quarantine_files(root: CacheRoot) -> dict[int, dict[str, Any]]:
    """Quarantine files by shard index, with their fsspec info."""
    folder = f"{root.path}/{QUARANTINE_DIR}"
    root.fs.invalidate_cache(folder)
    try:
        found = root.fs.ls(folder, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for info in found:
        stem = info["name"].rsplit("/", 1)[-1].removesuffix(".jsonl")
        index = parse_shard_name(stem)
        if index is not None and info["type"] == "file":
            out[index] = info
    return out


def garbage(root: CacheRoot) -> dict[int, dict[str, dict[str, Any]]]:
    """Objects of every uncommitted shard, by shard index: {full path: fsspec info}."""
    committed = set(root.committed_shards())
    quarantine = quarantine_files(root)
    out = {}
    for i in sorted((set(shard_groups(root)) | set(quarantine)) - committed):
        objects = group_objects(root, i)
        if i in quarantine:
            objects[quarantine[i]["name"]] = quarantine[i]
        if objects:
            out[i] = objects
    return out


def _delete(root: CacheRoot, shard_index: int, objects: dict[str, dict[str, Any]]) -> None:
    group = f"{root.path}/{shard_group_key(shard_index)}"
    root.fs.rm(list(objects))
    if root.fs.exists(group):  # local disk keeps empty folders
        root.fs.rm(group, recursive=True)
    root.fs.invalidate_cache(group)


def gc(url: str, *, yes: bool = False, min_age_s: float = DEFAULT_MIN_AGE_S,
       now: float | None = None) -> tuple[dict[str, Any], int]:
    """List uncommitted shards' objects; delete them when ``yes``.

    Args:
        yes: delete (otherwise only list). min_age_s: keep shards written less than this many
            seconds ago (a writer may be running). now: the current time (tests).
    Returns:
        (payload, 1 when garbage was found and left in place without ``yes``, else 0).
    """
    root = open_root(url)
    now = time.time() if now is None else now
    rows = []
    for i, objects in garbage(root).items():
        times = [t for t in (mtime(info) for info in objects.values()) if t is not None]
        age = now - max(times) if times else None
        row = {"shard": i, "objects": len(objects), "bytes": sum(int(o["size"]) for o in objects.values()),
               "age_s": None if age is None else round(age, 1), "paths": sorted(objects)}
        if age is not None and age < min_age_s:
            row["action"] = f"kept: written {age:.0f} s ago, a writer may be running (--min-age)"
        elif not yes:
            row["action"] = "would delete (pass --yes)"
        elif root.is_committed(i):
            row["action"] = "kept: committed meanwhile"
        else:
            _delete(root, i, objects)
            row["action"] = "deleted"
        rows.append(row)
    pending = [r for r in rows if r["action"].startswith("would")]
    return {"url": root.url, "shards": rows, "objects": sum(r["objects"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows),
            "deleted": sum(r["action"] == "deleted" for r in rows)}, int(bool(pending))


def render_gc(p: dict[str, Any]) -> str:
    """Human view of :func:`gc`."""
    rows = [{**r, "shard": shard_name(r["shard"]), "size": human_bytes(r["bytes"])} for r in p["shards"]]
    return (f"{table(rows, ['shard', 'objects', 'size', 'age_s', 'action'])}\n"
            f"{len(rows):,} uncommitted shards, {p['objects']:,} objects, {human_bytes(p['bytes'])}; "
            f"{p['deleted']:,} deleted")
