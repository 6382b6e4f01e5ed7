"""Training checkpoints on any fsspec URL, committed only when every rank's part is written.

Layout under ``<train_dir>`` (e.g. ``<run_dir>/train/dspark``)::

    checkpoints/step-000100/engine/...        the engine's sharded state (every rank's files; no frozen
                                              target weights: they are rebuilt from the target)
    checkpoints/step-000100/parts/rank-0.json each rank's file list with sizes (written by that rank)
    checkpoints/step-000100/drafter.safetensors  the trainable drafter weights in the training dtype (rank 0)
    checkpoints/step-000100/COMMITTED.json    trainer state + parts, created last, only if absent
    latest                                    name of the newest committed checkpoint (moved last)

Nothing under a checkpoint folder without ``COMMITTED.json`` is ever read. :func:`prune_checkpoints`
(``train.keep_checkpoints``) deletes an old checkpoint's ``COMMITTED.json`` first and its objects
after, so a prune cut short leaves only such an ignored folder.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from storage import create_exclusive, filesystem, indexed_name, join


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or does not fit this run."""


COMMIT_RECORD = "COMMITTED.json"
"""The object whose presence makes a checkpoint folder committed (created last by :func:`commit`)."""

_STEP_PREFIX = "step-"


def step_name(step: int) -> str:
    """``step-000100``: the checkpoint folder of optimizer step ``step``."""
    return indexed_name(_STEP_PREFIX, step)


def upload_dir(local: str | Path, url: str) -> dict[str, int]:
    """Copy every file under ``local`` to ``url`` (same relative paths); returns {relpath: bytes}."""
    fs, root = filesystem(url)
    files = {}
    for p in sorted(Path(local).rglob("*")):
        if p.is_file():
            rel = p.relative_to(local).as_posix()
            fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(p), f"{root}/{rel}")
            files[rel] = p.stat().st_size
    return files


def download_files(url: str, files: dict[str, int], local: str | Path) -> None:
    """Copy the listed files under ``url`` into ``local``."""
    fs, root = filesystem(url)
    for rel in files:
        dest = Path(local) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root}/{rel}", str(dest))


def resume_dir(ckpt_url: str, holder: str) -> Path:
    """The local folder that ``holder`` (``node``: every rank of this machine; ``rank3``: one rank)
    downloads checkpoint ``ckpt_url``'s engine files into to resume:
    ``<tempdir>/dspark-resume-<sha1 of url and holder, 16 hex>``, the same path in every process
    of the machine."""
    digest = hashlib.sha1(f"{ckpt_url}\n{holder}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"dspark-resume-{digest}"


def write_part(ckpt_url: str, rank: int, files: dict[str, int]) -> None:
    """Record that ``rank`` wrote ``files`` (relative to ``<ckpt>/engine``)."""
    fs, path = filesystem(join(ckpt_url, "parts", f"rank-{rank}.json"))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, json.dumps({"rank": rank, "files": files}).encode())


def read_parts(ckpt_url: str, world: int) -> dict[int, dict[str, int]]:
    """Every rank's part record, checked against the objects present.

    Raises:
        CheckpointError: a rank's part record or one of its files is missing or of the wrong size.
    """
    fs, _ = filesystem(ckpt_url)
    parts = {}
    for rank in range(world):
        _, p = filesystem(join(ckpt_url, "parts", f"rank-{rank}.json"))
        fs.invalidate_cache(p.rsplit("/", 1)[0])
        if not fs.exists(p):
            raise CheckpointError(f"{ckpt_url}: rank {rank}'s part is missing; the checkpoint is incomplete: "
                                  "resume from an earlier one (edit 'latest') or start over")
        files = json.loads(fs.cat_file(p))["files"]
        for rel, size in files.items():
            _, fp = filesystem(join(ckpt_url, "engine", rel))
            if not fs.exists(fp) or fs.size(fp) != size:
                raise CheckpointError(f"{ckpt_url}: rank {rank}'s file engine/{rel} is missing or truncated; "
                                      "resume from an earlier checkpoint or start over")
        parts[rank] = files
    return parts


def commit(train_url: str, step: int, state: dict[str, Any]) -> str:
    """Commit checkpoint ``step`` (after every rank wrote its part) and move ``latest`` to it.

    Raises:
        CheckpointError: a part is missing (see :func:`read_parts`), or it is already committed.
    """
    ckpt = join(train_url, "checkpoints", step_name(step))
    read_parts(ckpt, state["world_size"])
    fs, path = filesystem(join(ckpt, COMMIT_RECORD))
    try:
        create_exclusive(fs, path, json.dumps(state, indent=1, sort_keys=True).encode())
    except FileExistsError:
        raise CheckpointError(f"{ckpt} is already committed") from None
    _, latest = filesystem(join(train_url, "latest"))
    fs.pipe_file(latest, step_name(step).encode())
    return ckpt


def latest_checkpoint(train_url: str) -> tuple[str, dict[str, Any]] | None:
    """``(checkpoint url, trainer state)`` of the newest committed checkpoint, or None.

    Raises:
        CheckpointError: ``latest`` names a checkpoint without its commit record.
    """
    fs, latest = filesystem(join(train_url, "latest"))
    fs.invalidate_cache(latest.rsplit("/", 1)[0])
    if not fs.exists(latest):
        return None
    ckpt = join(train_url, "checkpoints", fs.cat_file(latest).decode().strip())
    _, rec = filesystem(join(ckpt, COMMIT_RECORD))
    if not fs.exists(rec):
        raise CheckpointError(f"{train_url}/latest names {ckpt}, which is not committed; point 'latest' at a "
                              "committed checkpoint or delete it to start over")
    return ckpt, json.loads(fs.cat_file(rec))


def _step_of(name: str) -> int | None:
    """The step of a checkpoint folder name (``step-000100`` -> 100), None for any other name."""
    digits = name[len(_STEP_PREFIX):]
    return int(digits) if name.startswith(_STEP_PREFIX) and digits.isdigit() else None


def prune_checkpoints(train_url: str, keep: int | None) -> list[str]:
    """Delete the committed checkpoints under ``<train_url>/checkpoints`` older than the newest ``keep``
    (``train.keep_checkpoints``); rank 0 calls it after each commit.

    Only committed folders (with ``COMMITTED.json``) count towards ``keep``, ranked by their step. Never
    deleted: the ``keep`` newest committed checkpoints, the one ``latest`` names, and any folder without
    a commit record that is newer than the oldest kept checkpoint (one being written). A folder without
    a commit record older than every kept checkpoint is the remains of an earlier crash (mid-write or
    mid-prune) and is deleted too. Each old checkpoint loses its ``COMMITTED.json`` first, then its
    objects, so a crash mid-prune leaves an uncommitted folder that :func:`latest_checkpoint` and
    resume never read.

    Args:
        train_url: the training output URL (``<run_dir>/train/<drafter>``), any fsspec URL.
        keep: committed checkpoints to keep (>= 1), or None to keep all (nothing is deleted).
    Returns:
        the URLs of the checkpoint folders deleted, oldest first.
    Raises:
        ValueError: ``keep`` < 1 (set ``train.keep_checkpoints`` to >= 1, or leave it unset to keep all).
    """
    if keep is None:
        return []
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep_checkpoints must be an integer >= 1 (got {keep!r}): set train.keep_checkpoints "
                         "to the committed checkpoints to keep, or leave it unset to keep all")
    fs, root = filesystem(join(train_url, "checkpoints"))
    fs.invalidate_cache(root)
    if not fs.exists(root):
        return []
    folders = {}
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        step = _step_of(name)
        if step is not None:
            folders[step] = name
    committed = sorted(s for s, name in folders.items() if fs.exists(f"{root}/{name}/{COMMIT_RECORD}"))
    if not committed:
        return []
    kept = committed[-keep:]
    protected = set(kept)
    _, latest = filesystem(join(train_url, "latest"))
    fs.invalidate_cache(latest.rsplit("/", 1)[0])
    if fs.exists(latest):
        named = _step_of(fs.cat_file(latest).decode().strip())
        if named is not None:
            protected.add(named)
    old = [s for s in sorted(folders) if s < kept[0] and s not in protected]
    deleted = []
    for step in old:
        folder = f"{root}/{folders[step]}"
        if step in committed:  # uncommit first: from here on nothing reads the folder
            fs.rm_file(f"{folder}/{COMMIT_RECORD}")
        fs.rm(folder, recursive=True)
        fs.invalidate_cache(folder)
        deleted.append(join(train_url, "checkpoints", folders[step]))
    return deleted
