"""Layout of a target cache (schema version 1): object names, array encodings, the commit record.

A cache root holds::

    fingerprint.json            the Fingerprint (JSON), written once when the cache is created
    shards/s000042/             one Zarr v3 group per shard (sharding codec; arrays below)
    commits/s000042.json        the shard's commit record (ShardRecord JSON), written LAST

Arrays of one shard group (n samples, N tokens, N_sup last-hidden rows, W = L*H feature width):

    input_ids     int32   [N]          token ids, samples concatenated token-major
    loss_mask     uint8   [N]          1 = supervised token
    features      uint16  [N, W]       raw bits of bf16 target-layer features (attribute ``encoding``)
                  uint8   [N, W]       or raw bits of float8_e4m3fn, when feature_dtype is fp8_e4m3
    feature_scale float32 [N]          fp8 only: per-token scale, absmax(row) / 448
    last_hidden   uint16  [N_sup, H]   raw bits of the bf16 final (post-norm) hidden state at the
                                       positions t whose next token is supervised (loss_mask[t+1] == 1)
    offsets       int64   [n+1]        sample k owns tokens offsets[k]:offsets[k+1]
    sup_offsets   int64   [n+1]        sample k owns last_hidden rows sup_offsets[k]:sup_offsets[k+1]
    source        int32   [n]          input file index
    row           int64   [n]          row index in that file

The group attributes hold ``schema_version``, ``sample_ids`` and ``content_hashes`` (lists of str).
Zarr 3.1 has no bfloat16 dtype, so bf16 is stored bit-exactly as uint16 with an ``encoding``
attribute; every zarr shard object (``write_empty_chunks`` semantics: padding chunks included) is
written whole, once, so each exists exactly once and can be checked against the commit record.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from storage import indexed_name

from cache_schema.errors import (CorruptRecordError, InvalidSampleError, InvalidStorageConfigError,
                                 NonFiniteSampleError)

SCHEMA_VERSION = 1

FINGERPRINT_OBJECT = "fingerprint.json"
SHARDS_DIR = "shards"
COMMITS_DIR = "commits"

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
FEATURES = "features"
FEATURE_SCALE = "feature_scale"
LAST_HIDDEN = "last_hidden"
OFFSETS = "offsets"
SUP_OFFSETS = "sup_offsets"
SOURCE = "source"
ROW = "row"

ATTR_ENCODING = "encoding"
BF16_BITS = "bfloat16_bits_as_uint16"
FP8_E4M3_BITS = "float8_e4m3fn_bits_as_uint8"
ATTR_SAMPLE_IDS = "sample_ids"
ATTR_CONTENT_HASHES = "content_hashes"

FEATURE_DTYPES = ("bf16", "fp8_e4m3")
HIDDEN_DTYPES = ("bf16",)
FP8_E4M3_MAX = 448.0

_SHARD_NAME = re.compile(r"^s(\d+)$")
_HEX = re.compile(r"^[0-9a-fA-F]+$")
MiB = 2**20
HASH_PIECE_BYTES = 4 * MiB  # piece of the hash and finiteness passes (bounds their temporaries)


def shard_name(shard_index: int) -> str:
    """Object-name stem of a shard, e.g. ``s000042``; raises ValueError for a negative index."""
    if shard_index < 0:
        raise ValueError(f"shard index must be >= 0, got {shard_index}")
    return indexed_name("s", shard_index)


def parse_shard_name(stem: str) -> int | None:
    """Inverse of :func:`shard_name` (any zero padding); None when ``stem`` is not a shard name."""
    match = _SHARD_NAME.match(stem)
    return int(match.group(1)) if match else None


def shard_group_key(shard_index: int) -> str:
    """Path of a shard's Zarr group relative to the cache root."""
    return f"{SHARDS_DIR}/{shard_name(shard_index)}"


def commit_key(shard_index: int) -> str:
    """Path of a shard's commit record relative to the cache root."""
    return f"{COMMITS_DIR}/{shard_name(shard_index)}.json"


@dataclass(frozen=True)
class StorageConfig:
    """How arrays are cut into objects; does not change the stored values (not fingerprinted).

    Args:
        chunk_bytes: target inner-chunk size in bytes along tokens (recipe: 1-4 MiB).
        shard_bytes: target zarr shard-object size in bytes (recipe: 64-512 MiB), >= chunk_bytes.
        zstd_level: zstd level for inner chunks, or None (default) for no compression.

    Raises:
        InvalidStorageConfigError: on non-positive sizes or shard_bytes < chunk_bytes.
    """

    chunk_bytes: int = 2 * MiB
    shard_bytes: int = 256 * MiB
    zstd_level: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.shard_bytes < self.chunk_bytes:
            raise InvalidStorageConfigError(
                f"need 0 < chunk_bytes <= shard_bytes, got {self.chunk_bytes} and {self.shard_bytes}")

    def grid(self, shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Inner-chunk and shard shapes for an array of ``shape`` (rows = tokens or samples).

        Chunks hold whole rows, at most ``chunk_bytes`` (at least one row), and are balanced: the
        rows are split into the fewest chunks that fit, of equal size, so zarr's padding of the
        last chunk is under one row per chunk. A shard holds as many whole chunks as fit in
        ``shard_bytes`` (at least one), never more than the array needs.
        """
        rows = shape[0]
        row_bytes = itemsize * math.prod(shape[1:])
        num_chunks = max(1, math.ceil(rows / max(1, self.chunk_bytes // row_bytes)))
        chunk_rows = max(1, math.ceil(rows / num_chunks))
        chunks_per_shard = max(1, min(self.shard_bytes // (chunk_rows * row_bytes), num_chunks))
        return (chunk_rows, *shape[1:]), (chunk_rows * chunks_per_shard, *shape[1:])


@dataclass(eq=False)
class CacheSample:
    """One cached sample: what the writer takes and the reader returns.

    Attributes:
        input_ids: torch.int32 [T] token ids.
        loss_mask: torch.uint8 [T], 1 = supervised token.
        features: torch.bfloat16 [T, L*H], target hidden states at target_layer_ids, concatenated.
        last_hidden: torch.bfloat16 [T_sup, H], final post-norm hidden state at the positions t
            with ``loss_mask[t+1] == 1`` (so ``T_sup = loss_mask[1:].sum()``).
        sample_id: non-empty id string.
        source: input file index (>= 0).
        row: row index in that file (>= 0).
        content_hash: hex string hash of the sample's content.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor
    sample_id: str
    source: int
    row: int
    content_hash: str

    @property
    def num_tokens(self) -> int:
        """T, the sample length in tokens."""
        return int(self.input_ids.shape[0])

    @property
    def num_supervised_tokens(self) -> int:
        """Number of tokens with ``loss_mask == 1``."""
        return int(self.loss_mask.sum())

    @property
    def num_hidden_rows(self) -> int:
        """T_sup, the number of positions t with ``loss_mask[t+1] == 1``."""
        return int(self.loss_mask[1:].sum())


def _fail(sample: CacheSample, what: str) -> InvalidSampleError:
    return InvalidSampleError(f"sample {sample.sample_id!r} (source {sample.source}, row {sample.row}): "
                              f"{what}")


def check_finite(sample: CacheSample, where: str) -> None:
    """Raise NonFiniteSampleError naming the sample when features or last_hidden hold NaN/inf.

    ``where`` says where the check runs (e.g. "on write to shard 3"), for the message.
    """
    for name in (FEATURES, LAST_HIDDEN):
        if not bool(torch.isfinite(getattr(sample, name)).all()):
            raise NonFiniteSampleError(
                f"sample {sample.sample_id!r} (source {sample.source}, row {sample.row}) has NaN or inf "
                f"in {name} {where}; recompute it (check the target's dtype and inputs) or skip the row")


def check_sample(sample: CacheSample, *, feature_width: int, hidden_size: int, max_length: int) -> None:
    """Validate dtypes, shapes, mask values and provenance of one sample (finiteness is checked on the
    stored bits by :meth:`ShardBuffer.check_finite`, without a float copy).

    Args:
        feature_width: expected L*H; hidden_size: expected H; max_length: longest allowed T.
    Raises:
        InvalidSampleError: wrong dtype, shape, mask value, T_sup or provenance (message names it).
    """
    expected = {"input_ids": torch.int32, "loss_mask": torch.uint8,
                "features": torch.bfloat16, "last_hidden": torch.bfloat16}
    for name, dtype in expected.items():
        tensor = getattr(sample, name)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise _fail(sample, f"{name} must be a {dtype} tensor (use .to({dtype})), got {got}")
    t = sample.num_tokens
    if sample.input_ids.dim() != 1 or not 0 < t <= max_length:
        raise _fail(sample, f"input_ids must be 1-D with 1..{max_length} tokens, "
                            f"got shape {tuple(sample.input_ids.shape)}")
    if tuple(sample.loss_mask.shape) != (t,) or bool((sample.loss_mask > 1).any()):
        raise _fail(sample, f"loss_mask must be [{t}] of 0/1, got shape {tuple(sample.loss_mask.shape)}")
    if tuple(sample.features.shape) != (t, feature_width):
        raise _fail(sample, f"features must be [{t}, {feature_width}] (T, L*H), "
                            f"got {tuple(sample.features.shape)}")
    t_sup = sample.num_hidden_rows
    if tuple(sample.last_hidden.shape) != (t_sup, hidden_size):
        raise _fail(sample, f"last_hidden must be [{t_sup}, {hidden_size}] (one row per t with "
                            f"loss_mask[t+1]==1), got {tuple(sample.last_hidden.shape)}")
    if not isinstance(sample.sample_id, str) or not sample.sample_id:
        raise _fail(sample, "sample_id must be a non-empty str")
    for name in ("source", "row"):
        value = getattr(sample, name)
        if not isinstance(value, int) or value < 0:
            raise _fail(sample, f"{name} must be an int >= 0, got {value!r}")
    if not isinstance(sample.content_hash, str) or not _HEX.match(sample.content_hash):
        raise _fail(sample, f"content_hash must be a non-empty hex str, got {sample.content_hash!r}")


def bf16_to_bits(t: torch.Tensor) -> np.ndarray:
    """Raw bits of a torch.bfloat16 tensor as a numpy uint16 array of the same shape."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    """Inverse of :func:`bf16_to_bits`: numpy uint16 bits -> torch.bfloat16 (bit-exact)."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def quantize_fp8(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-token fp8 (e4m3fn) quantisation of bf16 features.

    Args:
        x: torch.bfloat16 [N, W].
    Returns:
        (bits uint8 [N, W], scale float32 [N]) with ``scale = absmax(row) / 448``; an all-zero row
        gets scale 0 and zero bits. Dequantised value = e4m3(bits) * scale.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=1) / FP8_E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / safe[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scale.numpy().astype(np.float32)


def dequantize_fp8(bits: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: uint8 [N, W] bits and float32 [N] scale -> bfloat16 [N, W]."""
    q = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float()
    return (q * torch.from_numpy(np.ascontiguousarray(scale))[:, None]).to(torch.bfloat16)


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def array_specs(num_samples: int, num_tokens: int, num_hidden_rows: int, *, feature_width: int,
                hidden_size: int, feature_dtype: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Stored dtype and shape of every array of one shard group: the schema-1 layout's one statement
    (:func:`encode_shard` writes it, ``ops verify`` checks it, :mod:`cache_schema.estimate` sizes it).

    Args:
        num_samples, num_tokens, num_hidden_rows: n samples, T tokens, T_sup last-hidden rows.
        feature_width, hidden_size: W = L*H and H. feature_dtype: "bf16" or "fp8_e4m3".
    Returns:
        array name -> (numpy dtype, shape).
    """
    n, t, t_sup = num_samples, num_tokens, num_hidden_rows
    fp8 = feature_dtype == "fp8_e4m3"
    out = {INPUT_IDS: (np.int32, (t,)), LOSS_MASK: (np.uint8, (t,)),
           FEATURES: (np.uint8 if fp8 else np.uint16, (t, feature_width)),
           LAST_HIDDEN: (np.uint16, (t_sup, hidden_size)), OFFSETS: (np.int64, (n + 1,)),
           SUP_OFFSETS: (np.int64, (n + 1,)), SOURCE: (np.int32, (n,)), ROW: (np.int64, (n,))}
    if fp8:
        out[FEATURE_SCALE] = (np.float32, (t,))
    return {k: (np.dtype(d), s) for k, (d, s) in out.items()}


class ShardBuffer:
    """One shard's arrays in their stored encoding (:func:`array_specs`), preallocated and filled
    sample by sample: the streaming writer's only copy of a shard.

    Each sample is copied once into its rows as it arrives (in any order, e.g. a prefill batch's
    length-sorted samples), so a shard is held once instead of as per-sample tensors plus their
    concatenation plus a ``tobytes`` copy for the checksum. :meth:`check_finite` and
    :meth:`checksums` then read the stored bits in pieces, without copies;
    :meth:`cache_schema.writer.CacheRoot.commit_shard` writes and commits the buffer.

    Args:
        num_tokens: T of each sample, in stored order; num_hidden_rows: its T_sup (``loss_mask[1:].sum()``).
        feature_dtype: "bf16" or "fp8_e4m3"; feature_width: L*H; hidden_size: H; max_length: longest T
            (the fingerprint's values).
    Attributes:
        arrays: array name -> numpy array; array_attributes; group_attributes (filled by :meth:`put`).
        seconds: wall seconds of put (``copy``), check_finite (``check``), checksums (``hash``) and
            the storage write of :meth:`~cache_schema.writer.CacheRoot.commit_shard` (``put``).
    Raises:
        InvalidSampleError: lengths of different counts, or a T or T_sup out of range.
    """

    def __init__(self, num_tokens: list[int], num_hidden_rows: list[int], *, feature_dtype: str,
                 feature_width: int, hidden_size: int, max_length: int):
        num_tokens, num_hidden_rows = [int(t) for t in num_tokens], [int(t) for t in num_hidden_rows]
        if len(num_tokens) != len(num_hidden_rows) or any(
                not 0 < t <= max_length or not 0 <= s < t for t, s in zip(num_tokens, num_hidden_rows)):
            raise InvalidSampleError(
                f"a shard needs one T in 1..{max_length} and one T_sup in 0..T-1 per sample, got "
                f"{len(num_tokens)} T and {len(num_hidden_rows)} T_sup values; pass each sample's input_ids "
                "length and loss_mask[1:].sum()")
        self.feature_dtype, self.feature_width, self.hidden_size = feature_dtype, feature_width, hidden_size
        self.max_length = max_length
        self.offsets, self.sup_offsets = _offsets(num_tokens), _offsets(num_hidden_rows)
        n = len(num_tokens)
        specs = array_specs(n, int(self.offsets[-1]), int(self.sup_offsets[-1]), feature_width=feature_width,
                            hidden_size=hidden_size, feature_dtype=feature_dtype)
        self.arrays = {name: np.empty(shape, dtype) for name, (dtype, shape) in specs.items()}
        self.arrays[OFFSETS][:], self.arrays[SUP_OFFSETS][:] = self.offsets, self.sup_offsets
        encoding = FP8_E4M3_BITS if feature_dtype == "fp8_e4m3" else BF16_BITS
        self.array_attributes = {LAST_HIDDEN: {ATTR_ENCODING: BF16_BITS}, FEATURES: {ATTR_ENCODING: encoding}}
        self._ids: list[str | None] = [None] * n
        self._hashes: list[str | None] = [None] * n
        self.seconds = {"copy": 0.0, "check": 0.0, "hash": 0.0, "put": 0.0}

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays (the shard's stored, uncompressed size)."""
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def sample_ids(self) -> list[str | None]:
        """Sample id per position (None where nothing was put yet)."""
        return list(self._ids)

    @property
    def group_attributes(self) -> dict[str, Any]:
        """The shard group's attributes (schema version, sample ids, content hashes)."""
        return {"schema_version": SCHEMA_VERSION, ATTR_SAMPLE_IDS: list(self._ids),
                ATTR_CONTENT_HASHES: list(self._hashes)}

    def missing(self) -> list[int]:
        """Positions no sample was put at yet."""
        return [k for k, i in enumerate(self._ids) if i is None]

    def put(self, position: int, sample: CacheSample) -> None:
        """Validate ``sample`` (:func:`check_sample`) and copy it into its rows (one copy; bf16 bits
        as they are, fp8 quantised per token by :func:`quantize_fp8`).

        Args:
            position: the sample's index in the shard (stored order), each put once.
            sample: a CacheSample on the CPU whose T and T_sup are the ones given for ``position``.
        Raises:
            InvalidSampleError: bad position, a position put twice, another T or T_sup, or any
                :func:`check_sample` failure.
        """
        t0 = time.perf_counter()
        if not 0 <= position < len(self) or self._ids[position] is not None:
            raise _fail(sample, f"position {position} is outside 0..{len(self) - 1} or was already put; "
                                "put each sample of the shard once")
        check_sample(sample, feature_width=self.feature_width, hidden_size=self.hidden_size,
                     max_length=self.max_length)
        a, b = (int(x) for x in self.offsets[position:position + 2])
        c, d = (int(x) for x in self.sup_offsets[position:position + 2])
        if (sample.num_tokens, sample.num_hidden_rows) != (b - a, d - c):
            raise _fail(sample, f"has T={sample.num_tokens}, T_sup={sample.num_hidden_rows} but position {position} "
                                f"was sized for T={b - a}, T_sup={d - c}; size the shard from the samples' own lengths")
        arrays = self.arrays
        _as_torch(arrays[INPUT_IDS][a:b]).copy_(sample.input_ids)
        _as_torch(arrays[LOSS_MASK][a:b]).copy_(sample.loss_mask)
        _as_torch(arrays[LAST_HIDDEN][c:d]).copy_(sample.last_hidden)
        if self.feature_dtype == "fp8_e4m3":
            arrays[FEATURES][a:b], arrays[FEATURE_SCALE][a:b] = quantize_fp8(sample.features)
        else:
            _as_torch(arrays[FEATURES][a:b]).copy_(sample.features)
        arrays[SOURCE][position], arrays[ROW][position] = sample.source, sample.row
        self._ids[position], self._hashes[position] = sample.sample_id, sample.content_hash
        self.seconds["copy"] += time.perf_counter() - t0

    def check_finite(self, where: str) -> None:
        """Raise NonFiniteSampleError naming the first sample whose features or last_hidden hold NaN
        or inf, read from the stored bits in pieces (bf16: :func:`nonfinite_bf16_bits`; fp8: a NaN or
        inf input makes its token's scale non-finite, :func:`quantize_fp8`). ``where`` is for the message."""
        t0 = time.perf_counter()
        fp8 = self.feature_dtype == "fp8_e4m3"
        for k in range(len(self)):
            a, b = self.offsets[k:k + 2]
            c, d = self.sup_offsets[k:k + 2]
            bad = [FEATURES] if (not bool(np.isfinite(self.arrays[FEATURE_SCALE][a:b]).all()) if fp8
                                 else _any_nonfinite(self.arrays[FEATURES][a:b])) else []
            bad += [LAST_HIDDEN] if _any_nonfinite(self.arrays[LAST_HIDDEN][c:d]) else []
            if bad:
                raise NonFiniteSampleError(
                    f"sample {self._ids[k]!r} (source {int(self.arrays[SOURCE][k])}, row {int(self.arrays[ROW][k])}) "
                    f"has NaN or inf in {bad[0]} {where}; recompute it (check the target's dtype and inputs) "
                    "or skip the row")
        self.seconds["check"] += time.perf_counter() - t0

    def checksums(self) -> dict[str, str]:
        """SHA-256 of each array's stored bytes (:func:`array_sha256`), keyed by array name."""
        t0 = time.perf_counter()
        out = {name: array_sha256(a) for name, a in self.arrays.items()}
        self.seconds["hash"] += time.perf_counter() - t0
        return out


def _as_torch(a: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array (uint16 bits as bfloat16), for a copy_ that converts nothing."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)


def _any_nonfinite(bits: np.ndarray) -> bool:
    return any(nonfinite_bf16_bits(p) for p in row_pieces(bits, HASH_PIECE_BYTES))

def decode_sample(parts: dict[str, np.ndarray], *, feature_encoding: str, sample_id: str,
                  content_hash: str, source: int, row: int) -> CacheSample:
    """Build a CacheSample from one sample's slices of the shard arrays.

    Args:
        parts: ``input_ids`` [T], ``loss_mask`` [T], ``features`` [T, W] bits, ``last_hidden``
            [T_sup, H] bits and, for fp8, ``feature_scale`` [T].
        feature_encoding: the ``encoding`` attribute of the features array.
    Raises:
        CorruptRecordError: unknown feature encoding.
    """
    if feature_encoding == BF16_BITS:
        features = bits_to_bf16(parts[FEATURES])
    elif feature_encoding == FP8_E4M3_BITS:
        features = dequantize_fp8(parts[FEATURES], parts[FEATURE_SCALE])
    else:
        raise CorruptRecordError(f"unknown features encoding {feature_encoding!r}: the shard was "
                                 "written by another schema version; rebuild it")
    return CacheSample(input_ids=torch.from_numpy(np.ascontiguousarray(parts[INPUT_IDS])),
                       loss_mask=torch.from_numpy(np.ascontiguousarray(parts[LOSS_MASK])),
                       features=features, last_hidden=bits_to_bf16(parts[LAST_HIDDEN]),
                       sample_id=sample_id, source=source, row=row, content_hash=content_hash)


def array_sha256(a: np.ndarray) -> str:
    """SHA-256 hex digest of an array's C-order bytes (the stored encoding, e.g. bf16 bits).

    Hashes row pieces of at most ``HASH_PIECE_BYTES`` in order (hashlib ``update``, no ``tobytes``
    copy of a contiguous array): the digest equals ``sha256(a.tobytes())``.
    """
    a = np.ascontiguousarray(a)
    digest = hashlib.sha256()
    for piece in row_pieces(a, HASH_PIECE_BYTES):
        digest.update(piece)
    return digest.hexdigest()


def row_pieces(a: np.ndarray, piece_bytes: int) -> list[np.ndarray]:
    """Views of consecutive whole-row pieces of ``a`` (C order), each at most ``piece_bytes`` (at least
    one row); a 0-d or empty array gives ``[a]`` or ``[]``."""
    if a.ndim == 0:
        return [a]
    step = max(1, piece_bytes // max(1, a[:1].nbytes))
    return [a[i:i + step] for i in range(0, len(a), step)]


def nonfinite_bf16_bits(bits: np.ndarray) -> bool:
    """Whether any bf16 value stored as uint16 ``bits`` is NaN or inf: its exponent bits are all ones,
    ``bits & 0x7FFF >= 0x7F80`` (bfloat16 = sign 1, exponent 8, mantissa 7 bits; IEEE 754). One
    integer pass over the stored bits, no float copy."""
    return bits.size > 0 and int(np.bitwise_and(bits, 0x7FFF).max()) >= 0x7F80


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """A shard's commit record; its presence is what makes the shard part of the cache.

    Attributes:
        schema_version: layout version the shard was written with.
        shard_index: the shard's index (>= 0).
        num_samples, num_tokens, num_supervised_tokens, num_hidden_rows: counts (tokens: total T,
            supervised: sum of loss_mask, hidden rows: rows of last_hidden).
        object_bytes: size in bytes of every object of the shard group, keyed by path relative
            to the group (``zarr.json``, ``features/c/0/0``, ...).
        checksums: SHA-256 hex of each array's stored bytes, keyed by array name.
        fingerprint_sha256: ``Fingerprint.digest()`` of the cache the shard was written for.
        writer_id: who wrote it; created_utc: ISO-8601 UTC time of the commit.
        extra: JSON dict passed by the pipeline (e.g. skipped rows by reason).
    """

    schema_version: int
    shard_index: int
    num_samples: int
    num_tokens: int
    num_supervised_tokens: int
    num_hidden_rows: int
    object_bytes: dict[str, int]
    checksums: dict[str, str]
    fingerprint_sha256: str
    writer_id: str
    created_utc: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Bytes of all data and metadata objects of the shard group (the record excluded)."""
        return sum(self.object_bytes.values())

    def to_json(self) -> str:
        """JSON text of the record (sorted keys)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ShardRecord:
        """Parse a record; ``where`` names its location for the error message.

        Raises:
            CorruptRecordError: not JSON, or missing/unknown fields.
        """
        try:
            return cls(**json.loads(text))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise CorruptRecordError(
                f"commit record {where} is unreadable ({exc}); delete it and the shard group, then "
                "rerun the cache stage to rewrite the shard") from exc
