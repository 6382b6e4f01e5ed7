"""Cache root access and the shard commit protocol (local disk or object storage, via fsspec).

Commit protocol for one shard (the unit of work and of ownership):

1. refuse if the shard's commit record exists (committed shards are immutable);
2. validate every sample (dtypes, shapes, provenance, finite values) before touching storage;
3. remove whatever objects an earlier, uncommitted attempt left in the shard group;
4. write the Zarr group and array metadata, then each zarr shard object whole, in ONE streamed PUT
   (never chunk by chunk, never from two writers);
5. list the written objects, confirm that every object the arrays need is there
   (:func:`expected_objects`), and write the commit record LAST, created only if absent (a retried
   commit PUT that finds its own, identical record counts as done: :func:`storage.create_exclusive`).

A storage failure left after the retry policy's attempts (``storage``) raises
StorageUnavailableError naming the URL and the last error, with nothing committed.

Two writers never touch one shard: the pipeline assigns each shard index to exactly one task at a
time. The exclusive create of the commit record makes a violation fail loudly at commit time, but
it cannot undo a concurrent writer's damage to the data objects, so the rule is the caller's to keep.
Every listing invalidates the fsspec listing cache first, so a stale cache never hides a commit.

Streaming (issue #35): a shard is held once, in a :class:`ShardBuffer` (preallocated arrays in the
stored encoding) that samples are copied into as they arrive (:meth:`CacheRoot.new_shard`, then
:meth:`CacheRoot.commit_shard`; :meth:`CacheRoot.write_shard` does both for a list). Finiteness is
checked on the stored bits, checksums are hashlib updates over pieces of the buffer, and each zarr
shard object is streamed from the buffer's rows (:func:`zarr_shard_pieces`), so writing adds no copy of
the shard. The stored bytes and the record are those zarr-python's own ``create_array(data=...)`` and
``sha256(tobytes())`` give (tests/unit/cache_schema/test_cache_writer_stream.py holds that reference writer).
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

import fsspec
import google_crc32c
import numpy as np
import zarr
from numcodecs import Zstd
from fsspec.utils import get_protocol
from zarr.codecs import ZstdCodec
from zarr.storage import FsspecStore

from storage import create_exclusive, read_or_none

from cache_schema.errors import (CacheNotFoundError, CorruptRecordError, FingerprintMismatchError,
                                 InvalidFingerprintError, InvalidRecordError, InvalidSampleError,
                                 SchemaVersionError, ShardAlreadyCommittedError, ShardNotCommittedError,
                                 StorageUnavailableError, storage_call)
from cache_schema.fingerprint import Fingerprint
from cache_schema.layout import (COMMITS_DIR, FINGERPRINT_OBJECT, LOSS_MASK, SCHEMA_VERSION, CacheSample,
                                 ShardBuffer, ShardRecord, StorageConfig, check_sample, commit_key, parse_shard_name,
                                 shard_group_key)

_NO_CHUNK = 2**64 - 1  # zarr sharding index entry of an absent chunk (offset and length)


def _fs_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """fsspec options for ``url``: local disk creates parent folders on write like object storage."""
    local = {"auto_mkdir": True} if get_protocol(url) in ("file", "local") else {}
    return {**local, **(storage_options or {})}


def expected_objects(arrays: dict[str, tuple[tuple[int, ...], int]], storage: StorageConfig) -> set[str]:
    """Keys (relative to the shard group) of every object that writing arrays of these
    ``{name: (shape, itemsize)}`` must leave: the group's and each array's ``zarr.json`` and one
    object per zarr shard of each non-empty array (``StorageConfig.grid``; zarr v3 default chunk
    keys ``name/c/i[/0...]``). The commit record is not among them."""
    keys = {"zarr.json"}
    for name, (shape, itemsize) in arrays.items():
        keys.add(f"{name}/zarr.json")
        _, shards = storage.grid(shape, itemsize)
        tail = "/0" * (len(shape) - 1)
        keys.update(f"{name}/c/{k}{tail}" for k in range(math.ceil(shape[0] / shards[0])))
    return keys


def zarr_shard_pieces(data: np.ndarray, shard: int, chunk_rows: int, shard_rows: int,
                      compress: Callable[[np.ndarray], bytes] | None) -> Iterator[memoryview | bytes]:
    """The bytes of zarr shard object ``shard`` of array ``data``, in order, as pieces to stream.

    The zarr v3 sharding codec's object as zarr-python 3.1 writes it with the codecs
    ``create_array(chunks=(chunk_rows, ...), shards=(shard_rows, ...), compressors=...)`` sets
    (inner codecs: bytes little-endian, then optional zstd; index at the end, encoded bytes + crc32c;
    chunks in morton order, which is row order for whole-row chunks; write_empty_chunks on): every inner
    chunk of the shard that holds rows of the array, the edge chunk zero-padded (fill value 0), then
    the index (absent chunks: offset and length 2^64 - 1) ``uint64 [chunks_per_shard, 2]`` of (offset, length) and its CRC-32C as little-endian
    uint32. Source: the zarr v3 sharding codec specification; byte equality with zarr's own writer is
    tested (tests/unit/cache_schema/test_cache_writer_stream.py).

    Args:
        data: a C-contiguous little-endian numpy array [rows, ...]; shard: the zarr shard index (>= 0).
        chunk_rows, shard_rows: the inner-chunk and shard row counts (:meth:`StorageConfig.grid`).
        compress: bytes -> bytes codec of each chunk (numcodecs Zstd's encode), or None.
    Yields:
        Views of ``data``'s rows (no copy) or encoded/padded chunk bytes, then the index.
    """
    index = np.full((shard_rows // chunk_rows, 2), _NO_CHUNK, dtype="<u8")
    offset = 0
    for j in range(len(index)):
        start = shard * shard_rows + j * chunk_rows
        if start >= len(data):  # zarr leaves chunks past the array's end out of the object
            break
        chunk = data[start:start + chunk_rows]
        if len(chunk) < chunk_rows:
            padded = np.zeros((chunk_rows, *data.shape[1:]), data.dtype)
            padded[:len(chunk)] = chunk
            chunk = padded
        raw = memoryview(chunk.reshape(-1).view(np.uint8))
        piece = raw if compress is None else compress(raw)
        index[j] = (offset, len(piece))
        offset += len(piece)
        yield piece
    encoded = index.tobytes()
    yield encoded + np.uint32(google_crc32c.value(encoded)).astype("<u4").tobytes()


class CacheRoot:
    """One cache root: its validated fingerprint, its committed-shard index and the shard writer.

    Create it with :func:`open_cache`. Picklable (fsspec filesystems pickle), so a Ray actor can
    receive one. ``fingerprint`` is always the one stored at the root.

    Attributes:
        url: the root as a protocol-qualified URL; fs, path: its fsspec filesystem and path.
        fingerprint: the stored Fingerprint; storage: the StorageConfig used for writes.
    """

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, path: str, fingerprint: Fingerprint,
                 storage: StorageConfig, fs_options: dict[str, Any]):
        self.url, self.fs, self.path = url, fs, path
        self.fingerprint, self.storage = fingerprint, storage
        self._fs_options = fs_options

    def __repr__(self) -> str:
        return f"CacheRoot({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.path}/{key}"

    def committed_shards(self) -> list[int]:
        """Ascending indices of the committed shards (one fresh listing of ``commits/``)."""
        folder = self._path(COMMITS_DIR)
        self.fs.invalidate_cache(folder)
        try:
            with storage_call(f"{self.url}/{COMMITS_DIR}", "listing"):
                names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        stems = (name.rsplit("/", 1)[-1] for name in names)
        indices = (parse_shard_name(s[:-len(".json")]) for s in stems if s.endswith(".json"))
        return sorted(i for i in indices if i is not None)

    def committed_records(self) -> dict[int, ShardRecord]:
        """The cache index: commit records of all committed shards, keyed and ordered by shard index.

        Raises:
            CorruptRecordError: a record is unreadable or belongs to another shard or fingerprint.
        """
        indices = self.committed_shards()
        if not indices:
            return {}
        with storage_call(f"{self.url}/{COMMITS_DIR}", f"reading {len(indices)} commit records under"):
            texts = self.fs.cat([self._path(commit_key(i)) for i in indices])
        by_name = {path.rsplit("/", 1)[-1]: text for path, text in texts.items()}
        return {i: self.parse_record(i, by_name[commit_key(i).rsplit("/", 1)[-1]]) for i in indices}

    def is_committed(self, shard_index: int) -> bool:
        """Whether the shard has a commit record (fresh check, no listing cache)."""
        path = self._path(commit_key(shard_index))
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def record(self, shard_index: int) -> ShardRecord:
        """The shard's commit record.

        Raises:
            ShardNotCommittedError: the shard has no commit record.
            CorruptRecordError: the record is unreadable or does not match this cache.
        """
        text = read_or_none(self.fs, self._path(commit_key(shard_index)))
        if text is None:
            raise ShardNotCommittedError(
                f"shard {shard_index} of {self.url} is not committed; list committed shards with "
                "committed_shards() or run the cache stage to write it")
        return self.parse_record(shard_index, text)

    def parse_record(self, shard_index: int, text: bytes) -> ShardRecord:
        """The commit record of ``shard_index`` from its stored bytes ``text``.

        Raises:
            CorruptRecordError: unparseable, or it names another shard or fingerprint.
        """
        where = self.fs.unstrip_protocol(self._path(commit_key(shard_index)))
        record = ShardRecord.from_json(text, where)
        if record.shard_index != shard_index or record.fingerprint_sha256 != self.fingerprint.digest():
            raise CorruptRecordError(
                f"commit record {where} names shard {record.shard_index} and fingerprint "
                f"{record.fingerprint_sha256[:12]}..., not shard {shard_index} of this cache "
                f"({self.fingerprint.digest()[:12]}...); it was copied from elsewhere: delete it and "
                "the shard group, then rerun the cache stage")
        return record

    def shard_objects(self, shard_index: int) -> dict[str, int]:
        """Sizes in bytes of the objects now under the shard group, keyed by path in the group."""
        group = self._path(shard_group_key(shard_index))
        self.fs.invalidate_cache(group)
        try:
            found = self.fs.find(group, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(group) + 1:]: int(info["size"]) for name, info in found.items()
                if info["type"] == "file"}

    def shard_store(self, shard_index: int, *, read_only: bool) -> FsspecStore:
        """Zarr store of the shard group. Read-only stores raise FileNotFoundError on a missing
        object instead of returning zarr's fill value."""
        url = self.fs.unstrip_protocol(self._path(shard_group_key(shard_index)))
        if read_only:
            # s3fs reads a whole object (zarr.json, a small array) with a HEAD first, to split objects
            # above its block size (50 MiB) into concurrent ranged GETs, unless max_concurrency is 1;
            # zarr reads large arrays by ranges anyway, so the HEAD only doubles the requests
            options = {**self._fs_options, "max_concurrency": 1} if get_protocol(url) == "s3" else self._fs_options
            return FsspecStore.from_url(url, storage_options=options, read_only=True, allowed_exceptions=())
        return FsspecStore.from_url(url, storage_options=self._fs_options)

    def new_shard(self, num_tokens: list[int], num_hidden_rows: list[int]) -> ShardBuffer:
        """An empty :class:`ShardBuffer` for samples of these T and T_sup (stored order), shaped by this
        cache's fingerprint: fill it with ``put`` as samples arrive, then :meth:`commit_shard` it.

        Raises:
            InvalidSampleError: counts differ, or a T outside 1..max_length or T_sup outside 0..T-1.
        """
        fp = self.fingerprint
        return ShardBuffer(num_tokens, num_hidden_rows, feature_dtype=fp.feature_dtype,
                           feature_width=fp.feature_width, hidden_size=fp.hidden_size, max_length=fp.max_length)

    def write_shard(self, shard_index: int, samples: list[CacheSample], *, writer_id: str,
                    extra: dict[str, Any] | None = None) -> ShardRecord:
        """Write one shard's samples and commit it (see the module docstring for the protocol).

        Writes every sample given, in order (skipping rows is the caller's job). An empty list
        writes an empty, committed shard (useful when every row of a shard was skipped). Holds the
        shard once more than ``samples`` (its :class:`ShardBuffer`); a producer that has the samples
        one batch at a time uses :meth:`new_shard` and :meth:`commit_shard` instead.

        Args:
            shard_index: the shard's index (>= 0), owned by this writer alone.
            samples: CacheSample list; features [T, L*H] and last_hidden [T_sup, H] must match
                the fingerprint (L = len(target_layer_ids), H = target["hidden_size"]).
            writer_id: non-empty id of the writing task (host, actor, attempt).
            extra: JSON-serialisable dict stored in the record (e.g. skipped rows by reason).
        Returns:
            The commit record written.
        Raises:
            ShardAlreadyCommittedError: the shard is committed (before writing, or by another
                writer during this one's write).
            InvalidSampleError / NonFiniteSampleError: a sample is invalid (message names its id).
            InvalidRecordError: writer_id empty or extra not JSON-serialisable.
        """
        extra = self._check_writable(shard_index, writer_id, extra)
        fp = self.fingerprint
        for sample in samples:  # every sample's own error before sizing the buffer from it
            check_sample(sample, feature_width=fp.feature_width, hidden_size=fp.hidden_size, max_length=fp.max_length)
        buffer = self.new_shard([s.num_tokens for s in samples], [s.num_hidden_rows for s in samples])
        for position, sample in enumerate(samples):
            buffer.put(position, sample)
        return self._commit(shard_index, buffer, writer_id, extra)

    def commit_shard(self, shard_index: int, buffer: ShardBuffer, *, writer_id: str,
                     extra: dict[str, Any] | None = None) -> ShardRecord:
        """Write a filled :class:`ShardBuffer` (from :meth:`new_shard`) as shard ``shard_index`` and
        commit it; same protocol, errors and record as :meth:`write_shard`. Adds no copy of the shard:
        the finiteness check and the checksums read the buffer in pieces, each zarr shard object is
        streamed from its rows.

        Raises:
            InvalidSampleError: a position was never filled, or sample ids repeat; and the errors of
                :meth:`write_shard`.
        """
        extra = self._check_writable(shard_index, writer_id, extra)
        return self._commit(shard_index, buffer, writer_id, extra)

    def _check_writable(self, shard_index: int, writer_id: str, extra: dict[str, Any] | None) -> dict[str, Any]:
        """Refuse a committed shard, an empty writer_id or a non-JSON extra; returns a copy of extra."""
        with storage_call(f"{self.url}/{commit_key(shard_index)}", "checking the commit record"):
            committed = self.is_committed(shard_index)
        if committed:
            raise ShardAlreadyCommittedError(
                f"shard {shard_index} of {self.url} is already committed; committed shards are "
                f"immutable: skip it, or delete {commit_key(shard_index)} and its group to rewrite it")
        if not isinstance(writer_id, str) or not writer_id:
            raise InvalidRecordError("writer_id must be a non-empty str naming the writing task")
        extra = dict(extra or {})
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise InvalidRecordError(
                f"extra must be JSON-serialisable (str keys, plain values): {exc}") from exc
        return extra

    def _commit(self, shard_index: int, buffer: ShardBuffer, writer_id: str, extra: dict[str, Any]) -> ShardRecord:
        """Steps 2-5 of the protocol for a filled buffer."""
        missing = buffer.missing()
        if missing:
            raise InvalidSampleError(f"shard {shard_index}: positions {missing[:10]} of {len(buffer)} were never "
                                     "filled; put every sample of the shard before committing it")
        repeated = sorted(i for i, n in Counter(buffer.sample_ids).items() if n > 1)
        if repeated:
            raise InvalidSampleError(f"sample ids {repeated} occur more than once in shard "
                                     f"{shard_index}; make sample ids unique")
        buffer.check_finite(f"on write to shard {shard_index}")
        checksums = buffer.checksums()
        group_url = f"{self.url}/{shard_group_key(shard_index)}"
        with storage_call(group_url, f"writing shard {shard_index} to"):
            self._write_group(shard_index, buffer)
            objects = self.shard_objects(shard_index)
        shapes = {name: (data.shape, data.itemsize) for name, data in buffer.arrays.items()}
        missing_objects = sorted(expected_objects(shapes, self.storage) - set(objects))
        if missing_objects:  # never commit a shard whose objects are not all confirmed
            raise StorageUnavailableError(
                f"writing shard {shard_index} to {group_url}: {len(missing_objects)} written objects are not "
                f"listed (first {missing_objects[0]}); nothing was committed: rerun the same command to rewrite "
                "the shard")
        arrays = buffer.arrays
        record = ShardRecord(
            schema_version=SCHEMA_VERSION, shard_index=shard_index, num_samples=len(buffer),
            num_tokens=int(buffer.offsets[-1]), num_supervised_tokens=int(arrays[LOSS_MASK].sum(dtype=np.int64)),
            num_hidden_rows=int(buffer.sup_offsets[-1]), object_bytes=objects, checksums=checksums,
            fingerprint_sha256=self.fingerprint.digest(), writer_id=writer_id,
            created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), extra=extra)
        try:
            with storage_call(f"{self.url}/{commit_key(shard_index)}", f"committing shard {shard_index} as"):
                create_exclusive(self.fs, self._path(commit_key(shard_index)), record.to_json().encode())
        except FileExistsError as exc:
            raise ShardAlreadyCommittedError(
                f"shard {shard_index} of {self.url} was committed by another writer while "
                f"{writer_id!r} wrote it: two writers must never share a shard; fix the shard "
                "assignment, then verify the shard (its data may be mixed)") from exc
        return record

    def _write_group(self, shard_index: int, buffer: ShardBuffer) -> None:
        """Replace the shard group: remove leftovers of an uncommitted attempt, write the group and
        array metadata with zarr, then stream each zarr shard object whole from the buffer
        (:func:`zarr_shard_pieces`; one writer per object: no lost updates). Adds the seconds to
        ``buffer.seconds["put"]``."""
        t0 = time.perf_counter()
        if self.shard_objects(shard_index):
            group = self._path(shard_group_key(shard_index))
            self.fs.rm(group, recursive=True)
            self.fs.invalidate_cache(group)
        store = self.shard_store(shard_index, read_only=False)
        zarr.create_group(store, attributes=buffer.group_attributes, zarr_format=3)
        level = self.storage.zstd_level
        codec = None if level is None else ZstdCodec(level=level)
        compress = None if codec is None else Zstd.from_config(codec.to_dict()["configuration"]).encode
        for name, data in buffer.arrays.items():
            chunks, shards = self.storage.grid(data.shape, data.itemsize)
            zarr.create_array(store, name=name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards,
                              compressors=codec, zarr_format=3, attributes=buffer.array_attributes.get(name, {}),
                              config={"write_empty_chunks": True})
            tail = "/0" * (data.ndim - 1)
            for k in range(math.ceil(data.shape[0] / shards[0])):
                with self.fs.open(self._path(f"{shard_group_key(shard_index)}/{name}/c/{k}{tail}"), "wb") as f:
                    for piece in zarr_shard_pieces(data, k, chunks[0], shards[0], compress):
                        f.write(piece)
        buffer.seconds["put"] += time.perf_counter() - t0


def _load_fingerprint(url: str, text: bytes) -> Fingerprint:
    where = f"{url}/{FINGERPRINT_OBJECT}"
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptRecordError(
            f"{where} is not JSON ({exc}); restore it or use a new cache root") from exc
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"cache at {url} has schema version {version!r}; this library reads version "
            f"{SCHEMA_VERSION}: use the matching code version or rebuild the cache at a new root")
    try:
        return Fingerprint.from_dict(data)
    except InvalidFingerprintError as exc:
        raise CorruptRecordError(f"{where} is not a valid fingerprint: {exc}") from exc


def open_cache(root_url: str, fingerprint: Fingerprint | None = None, *, create: bool = True,
               storage: StorageConfig | None = None,
               storage_options: dict[str, Any] | None = None) -> CacheRoot:
    """Open a cache root, creating it (writing its fingerprint) when absent and allowed.

    Args:
        root_url: fsspec URL or local path of the root (``s3://bucket/prefix``, ``/data/cache``).
        fingerprint: the expected fingerprint; None opens an existing cache as stored.
        create: create the root when no fingerprint is stored (needs ``fingerprint``).
        storage: chunk/shard sizes and compression for writes (default StorageConfig()).
        storage_options: extra fsspec options (credentials, endpoint); env vars work too.
    Returns:
        The CacheRoot. A non-empty root folder without a fingerprint is fine (never refused).
    Raises:
        CacheNotFoundError: no fingerprint stored and ``create`` is False or fingerprint is None.
        SchemaVersionError: stored or given schema version is not this library's.
        FingerprintMismatchError: stored fingerprint differs; lists (field, stored, expected).
        CorruptRecordError: the stored fingerprint is unreadable.
    """
    options = _fs_options(root_url, storage_options)
    fs, path = fsspec.core.url_to_fs(root_url, **options)
    path = path.rstrip("/")
    url = fs.unstrip_protocol(path)
    if fingerprint is not None and fingerprint.schema_version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"fingerprint has schema_version {fingerprint.schema_version}; this library writes "
            f"version {SCHEMA_VERSION}: build the fingerprint with the default schema_version")
    fp_path = f"{path}/{FINGERPRINT_OBJECT}"
    with storage_call(f"{url}/{FINGERPRINT_OBJECT}", "reading"):
        text = read_or_none(fs, fp_path)
    if text is None:
        if fingerprint is None or not create:
            raise CacheNotFoundError(
                f"no cache at {url} (no {FINGERPRINT_OBJECT}); check the URL or run the cache stage")
        try:
            with storage_call(f"{url}/{FINGERPRINT_OBJECT}", "creating"):
                create_exclusive(fs, fp_path, fingerprint.to_json().encode())
        except FileExistsError:  # another writer created the root at the same moment
            text = read_or_none(fs, fp_path)
    stored = fingerprint if text is None else _load_fingerprint(url, text)
    if fingerprint is not None:
        differences = stored.diff(fingerprint)
        if differences:
            raise FingerprintMismatchError(url, differences)
    return CacheRoot(url, fs, path, stored, storage or StorageConfig(), options)
