"""Cache contract against a real S3 API (moto server): round trip, damage detection, commit protocol."""
from __future__ import annotations

import boto3
import pytest
import torch

from cache_schema import (CacheReader, CacheSample, Fingerprint, MissingObjectError,
                          ShardAlreadyCommittedError, StorageConfig, TruncatedObjectError, open_cache)

pytestmark = pytest.mark.integration

H = 16
SMALL = StorageConfig(chunk_bytes=512, shard_bytes=2048)  # several zarr shard objects per array


def make_fp(**changes) -> Fingerprint:
    return Fingerprint(**{"target": {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 4},
                          "embed_hash": "e", "lm_head_hash": "f", "tokenizer_hash": "a",
                          "chat_template_hash": "b", "target_layer_ids": (0, 2), "max_length": 64,
                          "min_loss_tokens": 1, **changes})


def make_sample(i: int, t: int) -> CacheSample:
    g = torch.Generator().manual_seed(i)
    mask = (torch.arange(t) >= t // 3).to(torch.uint8)
    return CacheSample(input_ids=torch.randint(0, 512, (t,), generator=g, dtype=torch.int32),
                       loss_mask=mask, features=torch.randn(t, 2 * H, generator=g).to(torch.bfloat16),
                       last_hidden=torch.randn(int(mask[1:].sum()), H, generator=g).to(torch.bfloat16),
                       sample_id=f"sample-{i}", source=0, row=i, content_hash=f"{i:08x}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _bucket_key(url: str, key: str) -> tuple[str, str]:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    return bucket, f"{prefix}/{key}"


def test_s3_round_trip_bf16_and_fp8(s3_url):
    for dtype, sub in (("bf16", "/bf16"), ("fp8_e4m3", "/fp8")):
        url, fp = s3_url + sub, make_fp(feature_dtype=dtype)
        root = open_cache(url, fp, storage=SMALL)
        samples = [make_sample(i, t) for i, t in enumerate([17, 60, 9])]
        root.write_shard(1, samples[:2], writer_id="a")
        root.write_shard(0, samples[2:], writer_id="b")
        assert len([k for k in root.record(1).object_bytes if k.startswith("features/c/")]) > 1
        reader = CacheReader(url, fp)
        assert reader.shards == [0, 1] and len(reader) == 3
        got = [reader[i] for i in range(3)]
        for g, want in zip(got, samples[2:] + samples[:2]):
            assert g.sample_id == want.sample_id and torch.equal(g.input_ids, want.input_ids)
            assert torch.equal(g.loss_mask, want.loss_mask) and same_bits(g.last_hidden, want.last_hidden)
            if dtype == "bf16":
                assert same_bits(g.features, want.features)
            else:
                x = want.features.float()
                scale = x.abs().amax(dim=1, keepdim=True) / 448
                assert bool(((g.features.float() - x).abs() <= x.abs() * 2**-4 + scale * 2**-10
                             + g.features.float().abs() * 2**-8).all())
        reader.verify_shard(1)


def test_s3_missing_and_truncated_objects_detected(s3_url):
    root = open_cache(s3_url, make_fp(), storage=SMALL)
    root.write_shard(0, [make_sample(i, 20) for i in range(3)], writer_id="w")
    s3 = boto3.client("s3")
    victim = sorted(k for k in root.record(0).object_bytes if k.startswith("features/c/"))[-1]
    s3.delete_object(**dict(zip(("Bucket", "Key"), _bucket_key(s3_url, f"shards/s000000/{victim}"))))
    with pytest.raises(MissingObjectError, match=f"object {victim} is missing"):
        CacheReader(s3_url)[0]

    root.write_shard(1, [make_sample(5, 20)], writer_id="w")
    bucket, key = _bucket_key(s3_url, "shards/s000001/input_ids/c/0")
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=body[:-3])
    reader = CacheReader(s3_url)
    with pytest.raises(TruncatedObjectError, match="input_ids/c/0"):
        reader.sample(reader.records[0].num_samples)


def test_s3_commit_is_exclusive_and_rewrite_cleans_up(s3_url, monkeypatch):
    root = open_cache(s3_url, make_fp(), storage=SMALL)
    first = root.write_shard(0, [make_sample(i, 30) for i in range(3)], writer_id="first")
    monkeypatch.setattr(type(root), "is_committed", lambda self, i: False)
    with pytest.raises(ShardAlreadyCommittedError, match="another writer"):
        root.write_shard(0, [make_sample(9, 30)], writer_id="second")
    assert root.record(0).writer_id == "first" and root.record(0).checksums != {}
    monkeypatch.undo()

    boto3.client("s3").delete_object(**dict(zip(("Bucket", "Key"),
                                                 _bucket_key(s3_url, "commits/s000000.json"))))
    assert not root.is_committed(0)
    record = root.write_shard(0, [make_sample(7, 12)], writer_id="restart")
    assert set(root.shard_objects(0)) == set(record.object_bytes)
    assert len(record.object_bytes) < len(first.object_bytes)
    reader = CacheReader(s3_url)
    assert [s.sample_id for s in reader.iter_samples()] == ["sample-7"]
    reader.verify_shard(0)


def test_s3_stale_listing_cache_does_not_hide_commits(s3_url):
    root = open_cache(s3_url, make_fp(), storage=StorageConfig())
    root.write_shard(0, [make_sample(0, 10)], writer_id="a")
    assert root.committed_shards() == [0]  # s3fs now caches the listing of commits/
    other = open_cache(s3_url, make_fp(), storage_options={"skip_instance_cache": True})
    assert other.fs is not root.fs
    other.write_shard(1, [make_sample(1, 10)], writer_id="b")
    assert len(root.fs.ls(f"{root.path}/commits")) == 1  # the cached listing really is stale
    assert root.committed_shards() == [0, 1] and root.is_committed(1)
    assert len(CacheReader(s3_url)) == 2
