"""Cache contract on local disk: round trips, offsets, validation, damage detection, commit protocol."""
from __future__ import annotations

import hashlib
import json

import fsspec
import numpy as np
import pytest
import torch
import zarr
from fsspec.implementations.local import LocalFileSystem

from cache_schema import (SCHEMA_VERSION, CacheNotFoundError, CacheReader, CacheSample,
                          ChecksumMismatchError, Fingerprint, FingerprintMismatchError,
                          InvalidFingerprintError, InvalidSampleError, MissingObjectError,
                          NonFiniteSampleError, SchemaVersionError, ShardAlreadyCommittedError,
                          StorageConfig, TruncatedObjectError, estimate_cache_bytes, open_cache,
                          tensor_sha256)
from cache_schema.layout import FP8_E4M3_MAX, bf16_to_bits

H, LAYERS = 16, (0, 1, 2)
W = H * len(LAYERS)
SMALL = StorageConfig(chunk_bytes=512, shard_bytes=2048)  # several zarr shard objects per array


def make_fp(**changes) -> Fingerprint:
    fields = dict(target={"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 4,
                          "vocab_size": 512, "config_sha256": "c0ffee"},
                  embed_hash="e" * 64, lm_head_hash="f" * 64, tokenizer_hash="a" * 64,
                  chat_template_hash="b" * 64, render_options={"system_prompt": "keep", "thinking": False},
                  target_layer_ids=LAYERS, max_length=256, min_loss_tokens=2)
    fields.update(changes)
    return Fingerprint(**fields)


def make_sample(i: int, t: int, *, hidden: int = H, layers: int = len(LAYERS), seed: int = 0) -> CacheSample:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    mask = torch.zeros(t, dtype=torch.uint8)
    mask[t // 3:] = 1
    mask[t - 2] = 0  # a hole: T_sup is not simply a suffix length
    t_sup = int(mask[1:].sum())
    features = torch.randn(t, layers * hidden, generator=g).to(torch.bfloat16)
    features[0, :3] = torch.tensor([-0.0, 1e-40, 3.0e38])  # signed zero, subnormal, huge: bits must survive
    return CacheSample(input_ids=torch.randint(0, 512, (t,), generator=g, dtype=torch.int32),
                       loss_mask=mask, features=features,
                       last_hidden=torch.randn(t_sup, hidden, generator=g).to(torch.bfloat16),
                       sample_id=f"sample-{i}", source=i % 3, row=100 + i,
                       content_hash=hashlib.sha256(str(i).encode()).hexdigest())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def root_url(tmp_path) -> str:
    return str(tmp_path / "cache")


def test_bf16_round_trip_is_bit_exact(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    shards = {0: [make_sample(i, t) for i, t in enumerate([7, 30, 12])],
              4: [make_sample(3 + i, t) for i, t in enumerate([25, 9])]}
    for index, samples in shards.items():
        record = root.write_shard(index, samples, writer_id=f"w{index}", extra={"skipped": {"too_long": 1}})
        assert record.num_samples == len(samples)
        assert record.num_tokens == sum(len(s.input_ids) for s in samples)
        assert record.num_supervised_tokens == sum(int(s.loss_mask.sum()) for s in samples)
        assert record.num_hidden_rows == sum(len(s.last_hidden) for s in samples)
    assert len([k for k in root.record(0).object_bytes if k.startswith("features/c/")]) > 1
    assert root.record(4).extra == {"skipped": {"too_long": 1}} and root.record(4).writer_id == "w4"

    reader = CacheReader("file://" + root_url, make_fp())
    expected = shards[0] + shards[4]
    assert len(reader) == 5 and reader.shards == [0, 4] and reader.num_tokens == 83
    assert [reader.locate(i) for i in (0, 2, 3, 4)] == [(0, 0), (0, 2), (4, 0), (4, 1)]
    for i, want in enumerate(expected):
        got = reader[i]
        assert torch.equal(got.input_ids, want.input_ids) and got.input_ids.dtype == torch.int32
        assert torch.equal(got.loss_mask, want.loss_mask) and got.loss_mask.dtype == torch.uint8
        assert same_bits(got.features, want.features) and same_bits(got.last_hidden, want.last_hidden)
        assert (got.sample_id, got.source, got.row, got.content_hash) == \
               (want.sample_id, want.source, want.row, want.content_hash)
    assert [s.sample_id for s in reader.iter_samples([4])] == ["sample-3", "sample-4"]
    [(ids, mask)] = list(reader.token_arrays([4]))  # whole shard, no features read
    assert torch.equal(ids, torch.cat([s.input_ids for s in shards[4]])) and ids.dtype == torch.int32
    assert torch.equal(mask, torch.cat([s.loss_mask for s in shards[4]])) and mask.dtype == torch.uint8
    tokens = list(reader.sample_tokens([4, 0]))  # per sample, in the order asked, no features read
    assert [len(ids) for ids, _ in tokens] == [25, 9, 7, 30, 12]
    for (ids, mask), want in zip(tokens, shards[4] + shards[0]):
        assert torch.equal(ids, want.input_ids) and torch.equal(mask, want.loss_mask)
    with pytest.raises(IndexError):
        reader.sample(5)
    reader.verify_shard(0)


def test_offsets_and_stored_arrays(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    samples = [make_sample(i, t) for i, t in enumerate([5, 11, 8])]
    root.write_shard(2, samples, writer_id="w")
    group = zarr.open_group(root_url + "/shards/s000002", mode="r")
    assert group["offsets"][:].tolist() == [0, 5, 16, 24]
    t_sup = [len(s.last_hidden) for s in samples]
    assert group["sup_offsets"][:].tolist() == [0, t_sup[0], t_sup[0] + t_sup[1], sum(t_sup)]
    assert group["features"].dtype == np.uint16 and group["features"].shape == (24, W)
    assert group["features"].attrs["encoding"] == "bfloat16_bits_as_uint16"
    assert group["last_hidden"].shape == (sum(t_sup), H)
    assert group["source"][:].tolist() == [0, 1, 2] and group["row"][:].tolist() == [100, 101, 102]
    assert group.attrs["sample_ids"] == ["sample-0", "sample-1", "sample-2"]
    assert np.array_equal(group["features"][5:16], bf16_to_bits(samples[1].features))


def test_fp8_round_trip_within_e4m3_error(root_url):
    fp = make_fp(feature_dtype="fp8_e4m3")
    root = open_cache(root_url, fp, storage=SMALL)
    samples = [make_sample(i, t) for i, t in enumerate([9, 21])]
    samples[0].features[1] = 0  # an all-zero token row: scale 0, values 0
    root.write_shard(0, samples, writer_id="w")
    group = zarr.open_group(root_url + "/shards/s000000", mode="r")
    assert group["features"].dtype == np.uint8 and group["feature_scale"].dtype == np.float32
    x = torch.cat([s.features for s in samples]).float()
    scale = torch.from_numpy(group["feature_scale"][:])
    assert torch.allclose(scale, x.abs().amax(dim=1) / FP8_E4M3_MAX)
    reader = CacheReader(root_url, fp)
    got = torch.cat([reader[i].features for i in range(2)])
    assert got.dtype == torch.bfloat16 and not same_bits(got, torch.cat([s.features for s in samples]))
    # e4m3: 3 mantissa bits (relative half-ulp 2^-4), subnormal step 2^-9 * scale, then bf16 rounding.
    err = (got.float() - x).abs()
    bound = x.abs() * 2**-4 + scale[:, None] * 2**-10 + got.float().abs() * 2**-8
    assert bool((err <= bound).all()) and float(err.max()) > 0
    assert torch.equal(got[1], torch.zeros(W, dtype=torch.bfloat16))
    assert same_bits(reader[1].last_hidden, samples[1].last_hidden)


def test_zstd_compression_round_trip(root_url):
    root = open_cache(root_url, make_fp(), storage=StorageConfig(chunk_bytes=512, shard_bytes=2048,
                                                                 zstd_level=3))
    sample = make_sample(0, 40)
    sample.features[5:] = 1.0  # compressible
    root.write_shard(0, [sample], writer_id="w")
    codecs = zarr.open_group(root_url + "/shards/s000000", mode="r")["features"].metadata.codecs
    assert "zstd" in repr(codecs).lower()
    assert same_bits(CacheReader(root_url)[0].features, sample.features)


def test_nan_sample_rejected_on_write_with_its_id(root_url):
    root = open_cache(root_url, make_fp())
    bad = make_sample(1, 10)
    bad.last_hidden[2, 3] = float("nan")
    with pytest.raises(NonFiniteSampleError, match="sample-1.*last_hidden"):
        root.write_shard(0, [make_sample(0, 10), bad], writer_id="w")
    assert not root.is_committed(0) and root.shard_objects(0) == {}


def test_invalid_samples_rejected_on_write(root_url):
    root = open_cache(root_url, make_fp())
    wrong_sup = make_sample(0, 10)
    wrong_sup.last_hidden = wrong_sup.last_hidden[1:]
    with pytest.raises(InvalidSampleError, match=r"sample-0.*last_hidden must be \[6, 16\]"):
        root.write_shard(0, [wrong_sup], writer_id="w")
    wrong_dtype = make_sample(1, 10)
    wrong_dtype.input_ids = wrong_dtype.input_ids.long()
    with pytest.raises(InvalidSampleError, match="input_ids must be a torch.int32"):
        root.write_shard(0, [wrong_dtype], writer_id="w")
    with pytest.raises(InvalidSampleError, match="1..256 tokens"):
        root.write_shard(0, [make_sample(2, 257)], writer_id="w")
    with pytest.raises(InvalidSampleError, match=r"\['sample-3'\] occur more than once"):
        root.write_shard(0, [make_sample(3, 10), make_sample(3, 12)], writer_id="w")


def test_nan_detected_on_read_and_by_checksum(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    root.write_shard(0, [make_sample(i, 10) for i in range(3)], writer_id="w")
    features = zarr.open_array(root_url + "/shards/s000000/features", mode="r+")
    features[14, 0] = 0x7FC0  # bf16 NaN in sample 1 (tokens 10..19); same object size
    reader = CacheReader(root_url)
    assert reader[0].sample_id == "sample-0"
    with pytest.raises(NonFiniteSampleError, match="sample-1.*on read from shard 0"):
        reader[1]
    with pytest.raises(ChecksumMismatchError, match="array features"):
        reader.verify_shard(0)


def test_deleted_object_detected_on_read(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    root.write_shard(0, [make_sample(i, 20) for i in range(3)], writer_id="w")
    fs = LocalFileSystem()
    victim = sorted(k for k in root.record(0).object_bytes if k.startswith("features/c/"))[-1]
    fs.rm(f"{root_url}/shards/s000000/{victim}")
    with pytest.raises(MissingObjectError, match=f"object {victim} is missing"):
        CacheReader(root_url)[0]


def test_object_vanishing_after_open_raises_not_zeros(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    root.write_shard(0, [make_sample(i, 20) for i in range(3)], writer_id="w")
    reader = CacheReader(root_url)
    assert reader[0].sample_id == "sample-0"  # the shard is now open and checked
    last = sorted(k for k in root.record(0).object_bytes if k.startswith("features/c/"))[-1]
    LocalFileSystem().rm(f"{root_url}/shards/s000000/{last}")
    with pytest.raises(MissingObjectError, match="vanished"):
        reader[2]


def test_truncated_object_detected_on_read(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    root.write_shard(0, [make_sample(i, 20) for i in range(2)], writer_id="w")
    path = f"{root_url}/shards/s000000/last_hidden/c/0/0"
    fs = LocalFileSystem()
    fs.pipe_file(path, fs.cat_file(path)[:-7])
    with pytest.raises(TruncatedObjectError, match="last_hidden/c/0/0 has .* bytes"):
        CacheReader(root_url)[1]


def test_fingerprint_mismatch_refused_listing_fields(root_url):
    open_cache(root_url, make_fp())
    other = make_fp(max_length=512, target_layer_ids=(0, 2),
                    target={**make_fp().target, "config_sha256": "beef"})
    with pytest.raises(FingerprintMismatchError) as info:
        open_cache(root_url, other)
    assert info.value.differences == [("target.config_sha256", "c0ffee", "beef"),
                                      ("target_layer_ids", [0, 1, 2], [0, 2]), ("max_length", 256, 512)]
    message = str(info.value)
    assert "max_length: stored=256 expected=512" in message and "target.config_sha256" in message
    with pytest.raises(FingerprintMismatchError, match="target_layer_ids"):
        CacheReader(root_url, other)
    assert open_cache(root_url, make_fp()).fingerprint == make_fp()  # same fingerprint: accepted


def test_open_missing_cache_and_foreign_schema_version(root_url, tmp_path):
    with pytest.raises(CacheNotFoundError, match="no cache at"):
        CacheReader(root_url)
    with pytest.raises(CacheNotFoundError):
        open_cache(root_url, make_fp(), create=False)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "fingerprint.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        open_cache(root_url, make_fp())


def test_commit_record_created_only_if_absent(root_url, monkeypatch):
    root = open_cache(root_url, make_fp())
    first = root.write_shard(0, [make_sample(0, 10)], writer_id="first")
    with pytest.raises(ShardAlreadyCommittedError, match="already committed"):
        root.write_shard(0, [make_sample(1, 10)], writer_id="second")
    # A writer that missed the record (race) still cannot replace it: the create is exclusive.
    monkeypatch.setattr(type(root), "is_committed", lambda self, i: False)
    with pytest.raises(ShardAlreadyCommittedError, match="another writer"):
        root.write_shard(0, [make_sample(2, 10)], writer_id="third")
    assert root.record(0) == first and root.record(0).writer_id == "first"


def test_rewrite_of_uncommitted_shard_removes_partial_objects(root_url):
    root = open_cache(root_url, make_fp(), storage=SMALL)
    root.write_shard(0, [make_sample(i, 40) for i in range(4)], writer_id="killed")
    fs = LocalFileSystem(auto_mkdir=True)
    fs.rm(f"{root_url}/commits/s000000.json")  # as if killed before the commit
    fs.pipe_file(f"{root_url}/shards/s000000/features/c/99/0", b"stale")
    stale = set(root.shard_objects(0))
    record = root.write_shard(0, [make_sample(7, 12)], writer_id="restart")
    assert set(root.shard_objects(0)) == set(record.object_bytes)
    assert "features/c/99/0" not in record.object_bytes and len(stale) > len(record.object_bytes)
    reader = CacheReader(root_url)
    assert len(reader) == 1 and reader[0].sample_id == "sample-7"
    reader.verify_shard(0)


def test_empty_shard_commits_counts(root_url):
    root = open_cache(root_url, make_fp())
    record = root.write_shard(3, [], writer_id="w", extra={"skipped": {"too_short": 5}})
    assert (record.num_samples, record.num_tokens, record.extra) == (0, 0, {"skipped": {"too_short": 5}})
    reader = CacheReader(root_url)
    assert reader.shards == [3] and len(reader) == 0 and list(reader.iter_samples()) == []
    reader.verify_shard(3)


class _ListingCacheFS(LocalFileSystem):
    """Local disk with a directory-listing cache, as object-storage filesystems have."""

    protocol = "cachedlocal"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("cachedlocal://"))

    def ls(self, path, detail=False, **kwargs):
        path = self._strip_protocol(path)
        if path not in self.dircache:
            self.dircache[path] = super().ls(path, detail=True, **kwargs)
        entries = self.dircache[path]
        return entries if detail else [e["name"] for e in entries]

    def invalidate_cache(self, path=None):
        if path is None:
            self.dircache.clear()
            return
        path = self._strip_protocol(path)
        while path not in ("", "/"):
            self.dircache.pop(path, None)
            path = self._parent(path)


def test_stale_listing_cache_does_not_hide_commits(root_url):
    fsspec.register_implementation("cachedlocal", _ListingCacheFS, clobber=True)
    cached = open_cache("cachedlocal://" + root_url, make_fp(), storage_options={"auto_mkdir": True})
    cached.write_shard(0, [make_sample(0, 10)], writer_id="a")
    assert cached.committed_shards() == [0]  # the listing of commits/ is now cached
    open_cache(root_url, make_fp()).write_shard(1, [make_sample(1, 10)], writer_id="b")  # another process
    assert len(cached.fs.ls(root_url + "/commits")) == 1  # the cache really is stale
    assert cached.committed_shards() == [0, 1] and cached.is_committed(1)
    assert list(cached.committed_records()) == [0, 1]


def test_estimate_within_5_percent_of_actual_bytes(tmp_path):
    hidden, layers = 64, 3
    for dtype in ("bf16", "fp8_e4m3"):
        fp = make_fp(target={"hidden_size": hidden}, feature_dtype=dtype, max_length=1024)
        root = open_cache(str(tmp_path / dtype), fp, storage=StorageConfig(chunk_bytes=64 * 1024,
                                                                             shard_bytes=256 * 1024))
        records = [root.write_shard(k, [make_sample(10 * k + i, t, hidden=hidden, layers=layers)
                                        for i, t in enumerate([700, 150, 1024, 333])], writer_id="w")
                   for k in range(2)]
        tokens = sum(r.num_tokens for r in records)
        est = estimate_cache_bytes(tokens, hidden_size=hidden, num_target_layers=layers,
                                   feature_dtype=dtype, num_samples=8,
                                   supervised_fraction=sum(r.num_hidden_rows for r in records) / tokens)
        actual = sum(r.total_bytes for r in records)
        assert abs(actual - est.total_bytes) / est.total_bytes < 0.05, (dtype, actual, est)
    recipe = estimate_cache_bytes(10**9, hidden_size=2560, num_target_layers=5)
    assert recipe.bytes_per_token == 30725 and recipe.total_bytes == 30725 * 10**9


def test_fingerprint_json_round_trip_and_diff():
    fp = make_fp()
    again = Fingerprint.from_json(fp.to_json())
    assert again == fp and again.target_layer_ids == (0, 1, 2) and again.schema_version == SCHEMA_VERSION
    assert fp.diff(again) == [] and fp.digest() == again.digest() and fp.feature_width == W
    other = make_fp(render_options={"system_prompt": "drop"}, feature_dtype="fp8_e4m3")
    assert fp.diff(other) == [("render_options.system_prompt", "keep", "drop"),
                              ("render_options.thinking", False, "<absent>"),
                              ("feature_dtype", "bf16", "fp8_e4m3")]
    with pytest.raises(InvalidFingerprintError, match="final layer"):
        make_fp(target_layer_ids=(1, 3))
    with pytest.raises(InvalidFingerprintError, match="ascending"):
        make_fp(target_layer_ids=(2, 1))
    with pytest.raises(InvalidFingerprintError, match="unknown fingerprint fields"):
        Fingerprint.from_dict({**fp.to_dict(), "model_name": "qwen"})


def test_tensor_sha256_hashes_raw_bytes():
    x = torch.tensor([1.0, -2.5, 3.25], dtype=torch.bfloat16)
    assert tensor_sha256(x) == hashlib.sha256(bf16_to_bits(x).tobytes()).hexdigest()
    flipped = x.view(torch.int16).clone()
    flipped[0] ^= 1
    assert tensor_sha256(flipped.view(torch.bfloat16)) != tensor_sha256(x)
    y = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_sha256(y.t()) == hashlib.sha256(y.t().contiguous().numpy().tobytes()).hexdigest()


def test_a_shard_whose_objects_are_not_all_listed_back_is_never_committed(tmp_path, monkeypatch):
    from cache_schema import StorageUnavailableError
    from cache_schema.writer import CacheRoot

    root = open_cache(str(tmp_path / "c"), make_fp(), storage=SMALL)
    listed = CacheRoot.shard_objects

    def lose_one(self, i):  # a store that acknowledged a PUT but does not hold the object
        return {k: v for k, v in listed(self, i).items() if k != "features/c/1/0"}

    monkeypatch.setattr(CacheRoot, "shard_objects", lose_one)
    with pytest.raises(StorageUnavailableError, match="1 written objects are not listed .first features/c/1/0"):
        root.write_shard(0, [make_sample(0, 40)], writer_id="w")
    assert not root.is_committed(0)
    monkeypatch.undo()
    assert root.write_shard(0, [make_sample(0, 40)], writer_id="w").num_samples == 1  # the rerun commits it
