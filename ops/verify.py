"""``verify``: a full check of every committed shard, parallel over threads, resumable via a cursor.

Per shard: the commit record parses and belongs to this cache; every object it names exists with
the recorded size (and no unrecorded object sits in the group); arrays have the dtypes and
shapes the record and fingerprint imply; offsets are consistent with each other and with the
loss mask; every array matches its SHA-256 checksum; features, feature scales and last_hidden
are finite. Across shards: sample ids and (source, row) provenance are unique.

Each problem is ``{shard, sample, sample_id, check, detail}`` (``sample`` = position in the shard,
None for whole-shard problems). Arrays are streamed in blocks of about 64 MiB, so memory stays
bounded by the worker count, not by the shard size.

The cursor is a local JSON-lines file: a header line (cursor version, URL, fingerprint digest), then
one line per finished shard with its problems, sample ids and provenance (so uniqueness is still
checked across shards without re-reading finished ones), the SHA-256 of its commit record (a shard
rewritten since is verified again) and ``objects``, the listing of its group taken before its content
was read: ``{path in the group: [size in bytes, change token]}`` (the token is the backend's: the S3
ETag, GCS generation, or local ``mtime/ctime/inode``; see :func:`change_token`), or null for a shard
whose commit record is unreadable. Each line is appended and fsynced when its shard finishes; on
load a torn last line is dropped and the file is rewritten whole (temp file + rename).

A verify that completes keeps its cursor. The next one reads in full only the shards committed or
rewritten since, and re-lists every other shard (one listing per shard, no per-object request):
a shard whose objects are all there with the same sizes and tokens keeps its cursor verdict; any
object missing, added, resized or replaced makes that shard read again in full now, so it is
reported with the usual checks (``missing_object``, ``truncated_object``, ``extra_object``,
``checksum``, ...), plus ``changed_object`` for each same-size object replaced since the cursor
when the re-read finds the shard damaged (a replaced object whose bytes still verify is no problem).
Cursor entries without a listing (cursor version 1) are read once again, which records it.
``--restart`` re-reads every shard (damage that keeps an object's size and token, e.g. bit rot
under the same local mtime, is found only by a re-read).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cache_schema import (CacheError, CacheRoot, CorruptRecordError, Fingerprint, ShardNotCommittedError,
                          ShardRecord)
from cache_schema.layout import (ATTR_CONTENT_HASHES, ATTR_ENCODING, ATTR_SAMPLE_IDS, BF16_BITS,
                                 FEATURE_SCALE, FEATURES, FP8_E4M3_BITS, LAST_HIDDEN,
                                 LOSS_MASK, OFFSETS, ROW, SOURCE, SUP_OFFSETS, array_specs, bits_to_bf16,
                                 commit_key, shard_group_key)
from ops.common import group_objects, open_group, open_root
from ops.report import preview, table
from storage import local_home

BLOCK_BYTES = 64 * 2**20
CURSOR_VERSION = 2
READABLE_CURSOR_VERSIONS = (1, 2)  # version 1 entries carry no object listing: such shards are read again
TOKEN_KEYS = ("ETag", "etag", "generation", "md5Hash")  # S3 / Azure, GCS: changes when an object is replaced
LOCAL_TOKEN_KEYS = ("mtime", "created", "ino")  # local files (``created`` is st_ctime): rewrite or rename
READ_ERRORS = (FileNotFoundError, KeyError, ValueError, IndexError, TypeError, RuntimeError, CacheError)


class VerifyInterrupted(Exception):
    """Verify stopped before the last shard (Ctrl-C); its progress is in the cursor file."""


def problem(shard: int, check: str, detail: str, sample: int | None = None,
            sample_id: str | None = None) -> dict[str, Any]:
    """One finding: shard index, position in the shard (or None), sample id, check name, detail."""
    return {"shard": shard, "sample": sample, "sample_id": sample_id, "check": check, "detail": detail}


def default_cursor(url: str) -> Path:
    """Default cursor file of a cache URL: ``<local home>/verify/<sha256(url)[:16]>.jsonl``, the local home
    being ``$DSPARK_HOME`` or ``~/.cache/dspark`` (:func:`storage.local_home`)."""
    return local_home() / "verify" / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.jsonl"


# ---- per-shard checks (pure functions over what was read) -------------------------------------

def object_problems(shard: int, recorded: dict[str, int], actual: dict[str, int]) -> list[dict[str, Any]]:
    """Objects named in the record that are missing or of another size, and unrecorded objects."""
    out = []
    for key, size in sorted(recorded.items()):
        if key not in actual:
            out.append(problem(shard, "missing_object", f"object {key} ({size:,} bytes) is missing"))
        elif actual[key] != size:
            out.append(problem(shard, "truncated_object", f"object {key} has {actual[key]:,} bytes, "
                                                          f"its record says {size:,}"))
    out += [problem(shard, "extra_object", f"object {key} is not in the commit record (a second writer?)")
            for key in sorted(set(actual) - set(recorded))]
    return out


def structure_problems(shard: int, expected: dict[str, tuple[np.dtype, tuple[int, ...]]],
                       found: dict[str, tuple[np.dtype, tuple[int, ...]] | None],
                       attrs: dict[str, Any], num_samples: int) -> list[dict[str, Any]]:
    """Arrays missing or of the wrong dtype/shape (``found[name]`` None = absent), and per-sample
    attribute lists of the wrong length."""
    out = []
    for name, (dtype, shape) in expected.items():
        got = found.get(name)
        if got is None:
            out.append(problem(shard, "shape", f"array {name} is missing from the group"))
        elif got != (dtype, shape):
            out.append(problem(shard, "shape", f"array {name} is {got[0]} {list(got[1])}, expected "
                                               f"{dtype} {list(shape)}"))
    for key in (ATTR_SAMPLE_IDS, ATTR_CONTENT_HASHES):
        if len(attrs.get(key, [])) != num_samples:
            out.append(problem(shard, "shape", f"group attribute {key} has {len(attrs.get(key, []))} "
                                               f"entries for {num_samples} samples"))
    return out


def offset_problems(shard: int, offsets: np.ndarray, sup_offsets: np.ndarray, loss_mask: np.ndarray,
                    record: ShardRecord, ids: list[str]) -> list[dict[str, Any]]:
    """Offsets that do not start at 0 and end at the record's counts, samples of no tokens, loss
    masks outside 0/1 or off the record's count, and per-sample last_hidden row counts that differ
    from ``loss_mask[a+1:b].sum()`` (shapes already checked)."""
    out = []
    for name, arr, end in (("offsets", offsets, record.num_tokens), ("sup_offsets", sup_offsets,
                                                                      record.num_hidden_rows)):
        if arr[0] != 0 or arr[-1] != end:
            out.append(problem(shard, "offsets", f"{name} run {arr[0]}..{arr[-1]}, expected 0..{end}"))
    lengths = np.diff(offsets)
    out += [problem(shard, "offsets", f"sample has {lengths[k]} tokens (offsets must increase)", int(k), ids[k])
            for k in np.flatnonzero(lengths < 1)]
    if out:
        return out
    if loss_mask.size and loss_mask.max() > 1:
        out.append(problem(shard, "offsets", f"loss_mask holds {int(loss_mask.max())}; only 0/1 are allowed"))
    if int(loss_mask.sum()) != record.num_supervised_tokens:
        out.append(problem(shard, "offsets", f"loss_mask sums to {int(loss_mask.sum())}, the record "
                                             f"says {record.num_supervised_tokens} supervised tokens"))
    csum = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])
    need = csum[offsets[1:]] - csum[offsets[:-1] + 1]
    got = np.diff(sup_offsets)
    out += [problem(shard, "offsets", f"sample has {got[k]} last_hidden rows, its loss mask needs {need[k]}",
                    int(k), ids[k]) for k in np.flatnonzero(got != need)]
    return out


def nonfinite_rows(block: np.ndarray, encoding: str | None) -> np.ndarray:
    """bool per row of ``block``: the row holds NaN or inf once decoded (bf16 bits, fp8 bits, float)."""
    if encoding == BF16_BITS:
        values = bits_to_bf16(block)
    elif encoding == FP8_E4M3_BITS:
        values = torch.from_numpy(np.ascontiguousarray(block)).view(torch.float8_e4m3fn).float()
    else:
        values = torch.from_numpy(np.ascontiguousarray(block))
    return (~torch.isfinite(values)).reshape(len(block), -1).any(dim=1).numpy()


def scan_array(array, offsets: np.ndarray | None, encoding: str | None) -> tuple[str, set[int], int]:
    """Stream one array in blocks: (SHA-256 of its bytes, positions of samples with a non-finite
    row when ``offsets`` maps rows to samples, bytes read)."""
    digest, bad = hashlib.sha256(), set()
    rows = array.shape[0]
    row_bytes = max(1, array.dtype.itemsize * int(np.prod(array.shape[1:])))
    step = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, rows, step):
        block = np.ascontiguousarray(array[start:start + step])
        digest.update(block.tobytes())
        if offsets is not None:
            rows_bad = np.flatnonzero(nonfinite_rows(block, encoding)) + start
            bad.update(int(k) for k in np.searchsorted(offsets, rows_bad, side="right") - 1)
    return digest.hexdigest(), bad, rows * row_bytes


def content_problems(shard: int, members: dict[str, Any], record: ShardRecord, ids: list[str],
                     offsets: np.ndarray, sup_offsets: np.ndarray) -> tuple[list[dict[str, Any]], int]:
    """Checksums of every recorded array (``members``: the shard group's arrays by name) and
    finiteness per sample; returns (problems, bytes read)."""
    out, nbytes = [], 0
    row_map = {FEATURES: offsets, FEATURE_SCALE: offsets, LAST_HIDDEN: sup_offsets}
    for name, expected in sorted(record.checksums.items()):
        array = members[name]
        sha, bad, n = scan_array(array, row_map.get(name), array.attrs.get(ATTR_ENCODING))
        nbytes += n
        if sha != expected:
            out.append(problem(shard, "checksum", f"array {name} does not match its checksum"))
        out += [problem(shard, "non_finite", f"NaN or inf in {name}", k, ids[k]) for k in sorted(bad)]
    return out, nbytes


# ---- object listings (the cheap re-check of shards verified before) -----------------------------

def change_token(info: dict[str, Any]) -> str:
    """What in an fsspec ``info`` entry changes when the object is replaced: the ETag (s3fs, Azure) or
    generation / MD5 (GCS); else ``mtime/ctime/inode`` (local files: a rewrite moves mtime and ctime,
    a rename-over moves the inode; ctime cannot be set back by a copy that keeps mtime). "" when the
    backend gives none of these (then only sizes are compared)."""
    for key in TOKEN_KEYS:
        if info.get(key) not in (None, ""):
            return str(info[key]).strip('"')
    return "/".join(repr(info[k]) for k in LOCAL_TOKEN_KEYS if info.get(k) is not None)


def shard_listing(root: CacheRoot, shard_index: int) -> dict[str, list[Any]]:
    """``{path in the group: [size, change token]}`` of every object now under the shard group (one
    fresh listing: one LIST request per 1,000 objects on S3)."""
    group = f"{root.path}/{shard_group_key(shard_index)}"
    return {name[len(group) + 1:]: [int(info["size"]), change_token(info)]
            for name, info in sorted(group_objects(root, shard_index).items())}


def listing_changes(before: dict[str, list[Any]], now: dict[str, list[Any]]) -> dict[str, list[str]]:
    """Objects of a shard's group that differ from the listing recorded in the cursor: ``{"missing",
    "added", "resized", "replaced" (same size, another token): [paths]}``, only the non-empty kinds
    ({} = unchanged)."""
    out = {"missing": sorted(set(before) - set(now)), "added": sorted(set(now) - set(before)),
           "resized": sorted(k for k in set(before) & set(now) if before[k][0] != now[k][0]),
           "replaced": sorted(k for k in set(before) & set(now)
                              if before[k][0] == now[k][0] and before[k][1] != now[k][1])}
    return {kind: keys for kind, keys in out.items() if keys}


def changed_object_problems(shard: int, changes: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One ``changed_object`` problem per object replaced (same size, another change token) since the
    cursor's listing of the shard (missing and resized objects are reported against the commit record)."""
    return [problem(shard, "changed_object", f"object {key} was replaced since verify last read the shard "
                                             "(same size, another ETag/mtime)") for key in changes.get("replaced", [])]


# ---- one shard --------------------------------------------------------------------------------

def verify_shard(root: CacheRoot, shard_index: int) -> dict[str, Any]:
    """Every per-shard check of one committed shard (reads all of it).

    Returns:
        {shard, record_sha256, problems, ids, provenance [[source, row], ...], samples, tokens,
        bytes (read), objects (:func:`shard_listing` taken before any content read; None when the
        commit record is unreadable)}. Damage is reported in ``problems``, never raised.
    Raises:
        OSError and storage errors other than a missing object (e.g. the network), unchanged.
    """
    result: dict[str, Any] = {"shard": shard_index, "record_sha256": None, "problems": [], "ids": [],
                              "provenance": [], "samples": 0, "tokens": 0, "bytes": 0, "objects": None}
    try:
        text = root.fs.cat_file(f"{root.path}/{commit_key(shard_index)}")
        result["record_sha256"] = hashlib.sha256(text).hexdigest()
        record = root.parse_record(shard_index, text)
    except (CorruptRecordError, ShardNotCommittedError, FileNotFoundError) as exc:
        result["problems"].append(problem(shard_index, "record", str(exc)))
        return result
    result.update(samples=record.num_samples, tokens=record.num_tokens)
    listing = result["objects"] = shard_listing(root, shard_index)  # what the next verify re-lists against
    problems = object_problems(shard_index, record.object_bytes, {k: v[0] for k, v in listing.items()})
    damaged = bool(problems)
    try:
        group = open_group(root, shard_index)
        attrs = group.attrs.asdict()
        members = dict(group.arrays())  # each array's metadata read once (one request each on S3)
        ids = list(attrs.get(ATTR_SAMPLE_IDS, []))
        result["ids"] = ids
        source, row = members[SOURCE][:], members[ROW][:]
        if len(source) == len(row) == len(ids):
            result["provenance"] = [[int(s), int(r)] for s, r in zip(source, row)]
        if not damaged:
            problems += _read_checks(shard_index, root.fingerprint, record, members, attrs, ids, result)
    except READ_ERRORS as exc:
        if not damaged:  # a damaged object already explains a failed read
            problems.append(problem(shard_index, "unreadable", f"{type(exc).__name__}: {exc}"))
    result["problems"] = problems
    return result


def _read_checks(shard: int, fp: Fingerprint, record: ShardRecord, members: dict[str, Any], attrs: dict[str, Any],
                 ids: list[str], result: dict[str, Any]) -> list[dict[str, Any]]:
    expected = array_specs(record.num_samples, record.num_tokens, record.num_hidden_rows,
                           feature_width=fp.feature_width, hidden_size=fp.hidden_size,
                           feature_dtype=fp.feature_dtype)
    found = {name: (members[name].dtype, tuple(members[name].shape)) if name in members else None
             for name in expected}
    out = structure_problems(shard, expected, found, attrs, record.num_samples)
    encoding = members[FEATURES].attrs.get(ATTR_ENCODING) if FEATURES in members else None
    want = FP8_E4M3_BITS if fp.feature_dtype == "fp8_e4m3" else BF16_BITS
    if encoding != want:
        out.append(problem(shard, "shape", f"features encoding is {encoding!r}, expected {want!r}"))
    if out:
        return out
    offsets, sup_offsets = members[OFFSETS][:], members[SUP_OFFSETS][:]
    out = offset_problems(shard, offsets, sup_offsets, members[LOSS_MASK][:], record, ids)
    if out:
        return out
    found_problems, result["bytes"] = content_problems(shard, members, record, ids, offsets, sup_offsets)
    return found_problems


# ---- across shards ----------------------------------------------------------------------------

def duplicate_problems(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Sample ids and (source, row) pairs that occur more than once, one problem per occurrence
    naming the other places."""
    out = []
    for check, key, label in (("duplicate_sample_id", "ids", "sample id"),
                              ("duplicate_provenance", "provenance", "source/row")):
        places: dict[Any, list[tuple[int, int]]] = defaultdict(list)
        for shard in sorted(results):
            for k, value in enumerate(results[shard][key]):
                places[tuple(value) if isinstance(value, list) else value].append((shard, k))
        for value, where in places.items():
            for shard, k in where if len(where) > 1 else []:
                others = ", ".join(f"shard {s} sample {m}" for s, m in where if (s, m) != (shard, k))
                ids = results[shard]["ids"]
                out.append(problem(shard, check, f"{label} {value} also at {others}", k,
                                   ids[k] if k < len(ids) else None))
    return out


# ---- the cursor -------------------------------------------------------------------------------

def load_cursor(path: Path, header: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Finished shards recorded in ``path`` for this ``header`` (URL + fingerprint); empty when the
    file is absent or belongs to another cache. Unparseable lines (a torn last write) are dropped.
    A cursor of an older readable version (:data:`READABLE_CURSOR_VERSIONS`) loads too: its entries
    lack ``objects``, so :func:`verify` reads those shards again."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    head = parsed[0] if parsed and isinstance(parsed[0], dict) else {}
    same_cache = {**head, "cursor_version": header["cursor_version"]} == header  # URL and fingerprint
    if head.get("cursor_version") not in READABLE_CURSOR_VERSIONS or not same_cache:
        return {}
    return {entry["shard"]: entry for entry in parsed[1:] if isinstance(entry, dict) and "shard" in entry}


def write_cursor(path: Path, header: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    """Replace the cursor file atomically (temp file + rename) with the header and ``entries``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in [header, *entries]))
    os.replace(tmp, path)


def record_digests(root: CacheRoot, shards: list[int]) -> dict[int, str]:
    """SHA-256 of each committed shard's commit record bytes (one batched read)."""
    paths = {f"{root.path}/{commit_key(i)}": i for i in shards}
    texts = root.fs.cat(list(paths), on_error="omit") if paths else {}
    by_name = {p.rsplit("/", 1)[-1]: t for p, t in texts.items()}
    return {i: hashlib.sha256(by_name[p.rsplit("/", 1)[-1]]).hexdigest()
            for p, i in paths.items() if p.rsplit("/", 1)[-1] in by_name}


# ---- the command ------------------------------------------------------------------------------

def verify(url: str, *, workers: int = 4, cursor: str | None = None, restart: bool = False,
           progress: bool = True) -> tuple[dict[str, Any], int]:
    """Verify every committed shard; resume from the cursor unless ``restart``.

    Shards committed or rewritten since the cursor (or absent from it, or recorded there without an
    object listing) are read in full. Every other shard is re-listed (:func:`shard_listing`) and
    compared with the listing the cursor holds: unchanged, it keeps the cursor's verdict; changed
    (an object missing, added, resized or replaced), it is read in full now.

    Args:
        workers: threads verifying (and re-listing) shards at once (>= 1).
        cursor: cursor file path (default :func:`default_cursor`); restart: ignore and rewrite it.
        progress: show a progress bar (on a terminal).
    Returns:
        (report, 1 when problems were found else 0). The report lists problems by shard;
        ``verified_now``: shards read in full now; ``resumed``: shards whose cursor verdict was kept
        (their listing matched the cursor's, or their commit record is unreadable and unchanged);
        ``relisted``: shards listed against the cursor this run; ``changed_since_cursor``: those whose
        listing differed (read now, counted in ``verified_now``).
    Raises:
        UsageError: workers < 1, or the cursor cannot be written.
        VerifyInterrupted: Ctrl-C; rerunning continues from the cursor.
    """
    from tqdm import tqdm

    from ops.common import UsageError

    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    root = open_root(url)
    shards = root.committed_shards()
    digests = record_digests(root, shards)
    path = Path(cursor).expanduser() if cursor else default_cursor(root.url)
    header = {"cursor_version": CURSOR_VERSION, "url": root.url, "fingerprint_sha256": root.fingerprint.digest()}
    done = {} if restart else load_cursor(path, header)
    # an entry without a listing (cursor version 1) is read again, which records its listing
    done = {i: e for i, e in done.items() if e.get("record_sha256") == digests.get(i) and "objects" in e}
    try:
        write_cursor(path, header, [done[i] for i in sorted(done)])
    except OSError as exc:
        raise UsageError(f"cannot write the verify cursor {path} ({exc}); pass --cursor PATH") from None
    changes: dict[int, dict[str, list[str]]] = {}
    nbytes, finished = 0, 0  # finished: shards whose verdict is settled in this run
    with tqdm(total=len(shards), unit="shard", desc="verify", disable=None if progress else True) as bar, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        def interrupted() -> VerifyInterrupted:
            pool.shutdown(wait=False, cancel_futures=True)
            return VerifyInterrupted(f"interrupted after {finished:,} of {len(shards):,} shards; rerun the same "
                                     f"command to continue (progress in {path}), or pass --restart")

        # 1. re-list the shards the cursor holds: one listing each, no content read
        listed = {pool.submit(shard_listing, root, i): i for i in sorted(done) if done[i]["objects"] is not None}
        finished = len(done) - len(listed)  # unreadable records: their verdict follows the record's digest
        bar.update(finished)
        try:
            for future in as_completed(listed):
                i = listed[future]
                changed = listing_changes(done[i]["objects"], future.result())
                if changed:
                    changes[i] = changed
                else:
                    finished += 1
                    bar.update(1)
        except KeyboardInterrupt:
            raise interrupted() from None
        if changes:  # read again below; dropped first, so an interrupted run reads them again too
            done = {i: e for i, e in done.items() if i not in changes}
            write_cursor(path, header, [done[i] for i in sorted(done)])
        resumed, pending = len(done), [i for i in shards if i not in done]
        found = sum(len(e["problems"]) for e in done.values())
        bar.set_postfix(problems=found)
        # 2. read in full the new, rewritten and changed shards
        with path.open("a") as log:
            futures = [pool.submit(verify_shard, root, i) for i in pending]
            try:
                for future in as_completed(futures):
                    entry = future.result()
                    if entry["problems"] and entry["shard"] in changes:  # name what was replaced
                        entry["problems"] += changed_object_problems(entry["shard"], changes[entry["shard"]])
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
                    os.fsync(log.fileno())
                    done[entry["shard"]] = entry
                    nbytes, found = nbytes + entry["bytes"], found + len(entry["problems"])
                    finished += 1
                    bar.update(1)
                    bar.set_postfix(problems=found)
            except KeyboardInterrupt:
                raise interrupted() from None
    problems = [p for i in sorted(done) for p in done[i]["problems"]] + duplicate_problems(done)
    bad = sorted({p["shard"] for p in problems})
    return {"url": root.url, "shards": len(shards), "verified_now": len(pending), "resumed": resumed,
            "relisted": len(listed), "changed_since_cursor": sorted(changes),
            "samples": sum(e["samples"] for e in done.values()), "bytes_read_now": nbytes,
            "shards_with_problems": bad, "problems": problems, "ok": not problems}, int(bool(problems))


def render_verify(p: dict[str, Any]) -> str:
    """Human view of :func:`verify`."""
    changed = p.get("changed_since_cursor", [])
    note = (f"; shard{'s' if len(changed) != 1 else ''} {preview(changed)} read again: "
            f"{'their' if len(changed) != 1 else 'its'} objects changed since the cursor") if changed else ""
    head = (f"verified {p['shards']:,} shards ({p['verified_now']:,} read now, {p['resumed']:,} re-listed "
            f"against the cursor{note}), {p['samples']:,} samples")
    if p["ok"]:
        return f"{head}: no problems"
    return "\n".join([table(p["problems"], ["shard", "sample", "sample_id", "check", "detail"]),
                      f"{head}: {len(p['problems']):,} problem{'s' if len(p['problems']) != 1 else ''} in shard"
                      f"{'s' if len(p['shards_with_problems']) != 1 else ''} {preview(p['shards_with_problems'])}"])
