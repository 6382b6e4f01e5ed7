"""The target-cache contract: versioned layout, fingerprint, commit protocol, reader, size estimate.

Storage only; the pipeline computes the features and the fingerprint values. Layout and commit
record: see ``cache_schema.layout`` (SCHEMA_VERSION) and ``cache_schema.writer``.

Public API::

    Fingerprint(*, target, embed_hash, lm_head_hash, tokenizer_hash, chat_template_hash,
                render_options, target_layer_ids, feature_dtype="bf16", hidden_dtype="bf16",
                max_length, min_loss_tokens, schema_version=SCHEMA_VERSION)
        .diff(other) -> list[(field, mine, theirs)]   .to_json() / Fingerprint.from_json(text)
        .digest() -> str                               .hidden_size, .feature_width
    tensor_sha256(t: torch.Tensor) -> str              raw-byte SHA-256, any dtype (bf16 too)

    CacheSample(input_ids int32 [T], loss_mask uint8 [T], features bf16 [T, L*H],
                last_hidden bf16 [T_sup, H], sample_id, source, row, content_hash)
    StorageConfig(chunk_bytes=2 MiB, shard_bytes=256 MiB, zstd_level=None)
    ShardRecord                                        the commit record (counts, bytes, checksums)

    open_cache(root_url, fingerprint=None, *, create=True, storage=None,
               storage_options=None) -> CacheRoot      creates or validates the root
    CacheRoot.write_shard(shard_index, samples, *, writer_id, extra=None) -> ShardRecord
    CacheRoot.committed_shards() -> list[int]          CacheRoot.committed_records() -> {i: ShardRecord}
    CacheRoot.is_committed(i) -> bool                  CacheRoot.record(i) -> ShardRecord

    CacheReader(root_url, fingerprint=None, *, storage_options=None, max_open_shards=8)
        len(reader), reader.shards, reader.records, reader.sample(i) / reader[i] -> CacheSample,
        reader.locate(i) -> (shard, k), reader.iter_samples(shards=None), reader.verify_shard(i)

    estimate_cache_bytes(num_tokens, *, hidden_size, num_target_layers, feature_dtype="bf16",
                         supervised_fraction=1.0, num_samples=0) -> SizeEstimate
    shard_overhead_bytes(*, hidden_size, target_layer_ids, feature_dtype, storage) -> int
                                                       zarr metadata bytes of one shard, to add per shard

Errors (all subclass CacheError) live in ``cache_schema.errors``.
One writer per shard: the pipeline guarantees it; the library only detects a collision at commit.
"""
from cache_schema.errors import (CacheError, CacheNotFoundError, ChecksumMismatchError,
                                 CorruptRecordError, FingerprintMismatchError, InvalidFingerprintError,
                                 InvalidRecordError, InvalidSampleError, InvalidStorageConfigError,
                                 MissingObjectError, NonFiniteSampleError, SchemaVersionError,
                                 ShardAlreadyCommittedError, ShardNotCommittedError,
                                 StorageUnavailableError, TruncatedObjectError)
from cache_schema.estimate import SizeEstimate, estimate_cache_bytes, shard_overhead_bytes
from cache_schema.fingerprint import Fingerprint, tensor_sha256
from cache_schema.layout import SCHEMA_VERSION, CacheSample, ShardRecord, StorageConfig
from cache_schema.reader import CacheReader
from cache_schema.writer import CacheRoot, open_cache

__all__ = [
    "SCHEMA_VERSION", "CacheSample", "ShardRecord", "StorageConfig", "Fingerprint", "tensor_sha256",
    "open_cache", "CacheRoot", "CacheReader", "SizeEstimate", "estimate_cache_bytes", "shard_overhead_bytes",
    "CacheError", "CacheNotFoundError", "ChecksumMismatchError", "CorruptRecordError",
    "FingerprintMismatchError", "InvalidFingerprintError", "InvalidRecordError", "InvalidSampleError",
    "InvalidStorageConfigError", "MissingObjectError", "NonFiniteSampleError", "SchemaVersionError",
    "ShardAlreadyCommittedError", "ShardNotCommittedError", "StorageUnavailableError", "TruncatedObjectError",
]
