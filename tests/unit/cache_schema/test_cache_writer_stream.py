"""The streaming cache writer (issue #35 finding 5): a shard is held once (its ShardBuffer), the stored
bytes and the commit record are those of the previous writer (zarr's own ``create_array(data=...)`` and
``sha256(tobytes())``), and a failure mid-shard commits nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import numpy as np
import pytest
import torch
import zarr
from test_cache_schema import SMALL, make_fp, make_sample, same_bits
from zarr.codecs import ZstdCodec

import cache_schema.writer as writer_module
from cache_schema import (CacheReader, NonFiniteSampleError, ShardRecord, StorageConfig, StorageUnavailableError,
                          open_cache)
from cache_schema.layout import (ATTR_CONTENT_HASHES, ATTR_ENCODING, ATTR_SAMPLE_IDS, BF16_BITS, FP8_E4M3_BITS,
                                 SCHEMA_VERSION, bf16_to_bits, commit_key, quantize_fp8)
from paths import REPO

pytestmark = pytest.mark.gpu_path

LENGTHS = [7, 30, 12, 25, 9, 41]  # several zarr shard objects per array under SMALL, partial edge shards


def reference_write_shard(root, shard_index: int, samples, *, writer_id: str) -> ShardRecord:
    """The writer as it was before streaming (a copy of its encode and write steps): concatenate the
    samples, write each array with zarr's ``create_array(data=...)``, hash ``tobytes()``."""
    import hashlib

    fp = root.fingerprint
    cat = {"input_ids": torch.cat([s.input_ids for s in samples]).numpy(),
           "loss_mask": torch.cat([s.loss_mask for s in samples]).numpy(),
           "last_hidden": bf16_to_bits(torch.cat([s.last_hidden for s in samples])),
           "offsets": np.concatenate([[0], np.cumsum([s.num_tokens for s in samples])]).astype(np.int64),
           "sup_offsets": np.concatenate([[0], np.cumsum([s.num_hidden_rows for s in samples])]).astype(np.int64),
           "source": np.array([s.source for s in samples], np.int32),
           "row": np.array([s.row for s in samples], np.int64)}
    features = torch.cat([s.features for s in samples])
    attrs = {"last_hidden": {ATTR_ENCODING: BF16_BITS}}
    if fp.feature_dtype == "fp8_e4m3":
        cat["features"], cat["feature_scale"] = quantize_fp8(features)
        attrs["features"] = {ATTR_ENCODING: FP8_E4M3_BITS}
    else:
        cat["features"] = bf16_to_bits(features)
        attrs["features"] = {ATTR_ENCODING: BF16_BITS}
    store = root.shard_store(shard_index, read_only=False)
    zarr.create_group(store, zarr_format=3, attributes={
        "schema_version": SCHEMA_VERSION, ATTR_SAMPLE_IDS: [s.sample_id for s in samples],
        ATTR_CONTENT_HASHES: [s.content_hash for s in samples]})
    level = root.storage.zstd_level
    for name, data in cat.items():
        chunks, shards = root.storage.grid(data.shape, data.itemsize)
        zarr.create_array(store, name=name, data=data, chunks=chunks, shards=shards, zarr_format=3,
                          compressors=None if level is None else ZstdCodec(level=level),
                          attributes=attrs.get(name, {}), config={"write_empty_chunks": True})
    record = ShardRecord(
        schema_version=SCHEMA_VERSION, shard_index=shard_index, num_samples=len(samples),
        num_tokens=sum(s.num_tokens for s in samples), num_supervised_tokens=sum(s.num_supervised_tokens for s in samples),
        num_hidden_rows=sum(s.num_hidden_rows for s in samples), object_bytes=root.shard_objects(shard_index),
        checksums={k: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for k, a in cat.items()},
        fingerprint_sha256=fp.digest(), writer_id=writer_id,
        created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), extra={})
    root.fs.pipe_file(root._path(commit_key(shard_index)), record.to_json().encode())
    return record


def group_bytes(root, shard_index: int) -> dict[str, bytes]:
    group = root._path(f"shards/s{shard_index:06d}")
    return {k: root.fs.cat_file(f"{group}/{k}") for k in root.shard_objects(shard_index)}


@pytest.mark.parametrize("feature_dtype,storage", [("bf16", SMALL), ("fp8_e4m3", StorageConfig(
    chunk_bytes=512, shard_bytes=2048, zstd_level=3))], ids=["bf16", "fp8-zstd"])
def test_streamed_shard_is_byte_identical_to_the_previous_writer(tmp_path, feature_dtype, storage):
    fp = make_fp(feature_dtype=feature_dtype)
    samples = [make_sample(i, t) for i, t in enumerate(LENGTHS)]
    old = open_cache(str(tmp_path / "old"), fp, storage=storage)
    new = open_cache(str(tmp_path / "new"), fp, storage=storage)
    want = reference_write_shard(old, 3, samples, writer_id="old")

    buffer = new.new_shard([s.num_tokens for s in samples], [s.num_hidden_rows for s in samples])
    for k in sorted(range(len(samples)), key=lambda k: LENGTHS[k]):  # prefill batches arrive length-sorted
        buffer.put(k, samples[k])
    got = new.commit_shard(3, buffer, writer_id="new")

    old_bytes, new_bytes = group_bytes(old, 3), group_bytes(new, 3)
    assert len([k for k in new_bytes if k.startswith("features/c/")]) > 2
    assert sorted(new_bytes) == sorted(old_bytes)
    assert [k for k in old_bytes if old_bytes[k] != new_bytes[k]] == []
    strip = ("writer_id", "created_utc")
    assert {k: v for k, v in json.loads(got.to_json()).items() if k not in strip} == \
           {k: v for k, v in json.loads(want.to_json()).items() if k not in strip}
    assert new.record(3) == got
    back = list(CacheReader(new.url, fp).iter_samples([3]))
    assert [s.sample_id for s in back] == [s.sample_id for s in samples]
    if feature_dtype == "bf16":
        assert all(same_bits(a.features, b.features) and same_bits(a.last_hidden, b.last_hidden)
                   for a, b in zip(back, samples))


class _Injected(OSError):
    pass


def test_failure_mid_shard_commits_nothing_and_a_retry_succeeds(tmp_path, monkeypatch):
    root = open_cache(str(tmp_path / "c"), make_fp(), storage=SMALL)
    samples = [make_sample(i, t) for i, t in enumerate(LENGTHS)]
    real, calls = writer_module.zarr_shard_pieces, []

    def failing(*args):
        calls.append(args[1])
        if len(calls) == 3:  # the third zarr shard object breaks off mid-write
            yield next(real(*args))
            raise _Injected("connection reset by peer (injected)")
        yield from real(*args)

    monkeypatch.setattr(writer_module, "zarr_shard_pieces", failing)
    with pytest.raises((StorageUnavailableError, OSError)):
        root.write_shard(0, samples, writer_id="first")
    assert not root.is_committed(0) and root.committed_shards() == []
    assert root.shard_objects(0)  # the attempt left objects behind: only the commit record makes a shard

    monkeypatch.setattr(writer_module, "zarr_shard_pieces", real)
    record = root.write_shard(0, samples, writer_id="retry")
    assert root.committed_shards() == [0] and record.writer_id == "retry"
    reader = CacheReader(root.url, make_fp())
    reader.verify_shard(0)  # sizes and checksums of the rewritten objects (raises on a leftover of the attempt)
    back = list(reader.iter_samples([0]))
    assert all(same_bits(a.features, b.features) for a, b in zip(back, samples))


def test_a_non_finite_sample_is_refused_before_anything_is_written(tmp_path):
    root = open_cache(str(tmp_path / "c"), make_fp(), storage=SMALL)
    samples = [make_sample(i, t) for i, t in enumerate(LENGTHS)]
    samples[4].last_hidden[2, 5] = float("inf")
    buffer = root.new_shard([s.num_tokens for s in samples], [s.num_hidden_rows for s in samples])
    for k, s in enumerate(samples):
        buffer.put(k, s)
    with pytest.raises(NonFiniteSampleError, match=r"sample-4.*last_hidden on write to shard 1"):
        root.commit_shard(1, buffer, writer_id="w")
    assert root.shard_objects(1) == {} and not root.is_committed(1)


def test_cache_actor_overlaps_a_shard_write_with_the_next_prefill_and_propagates_errors():
    """Two concurrent calls of one prefill actor (as the cache stage runs them): shard 1's prefill runs
    while shard 0 is written, never two prefills or two writes at once, and shard 1's write error
    reaches its caller."""
    from types import SimpleNamespace

    from pipeline.stages.cache import ShardPrefillWriter

    spans: dict[tuple[str, int], list[float]] = {}

    def timed(kind, shard, fail=False):
        spans[kind, shard] = [time.perf_counter()]
        time.sleep(0.4)
        spans[kind, shard].append(time.perf_counter())
        if fail:
            raise RuntimeError(f"write of shard {shard} failed")

    def commit_shard(shard, buffer, **_):
        timed("write", shard, fail=shard == 1)
        return SimpleNamespace(num_samples=2, num_tokens=10, total_bytes=100)

    actor = object.__new__(ShardPrefillWriter)  # the target and the cache root are stand-ins
    actor.emit, actor.writer_id, actor.shard_delay_s = False, "w", 0.0
    actor._prefill_lock, actor._write_lock = threading.Lock(), threading.Lock()
    actor._fill = lambda work: timed("prefill", work["shard"])
    actor._quarantine = lambda shard, work: {}
    actor.root = SimpleNamespace(commit_shard=commit_shard, is_committed=lambda shard: False)
    results: dict[int, object] = {}

    def call(shard):
        try:
            results[shard] = actor({"shard": shard})
        except RuntimeError as exc:
            results[shard] = exc

    threads = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join(10)
    assert results[0]["error"] == "" and results[0]["num_tokens"] == 10
    assert isinstance(results[1], RuntimeError) and "shard 1" in str(results[1])
    assert spans["prefill", 1][0] < spans["write", 0][1]  # overlap: shard 1 prefills while shard 0 is written
    assert spans["prefill", 0][1] <= spans["prefill", 1][0] and spans["write", 0][1] <= spans["write", 1][0]


def test_a_retried_call_of_a_committed_shard_returns_its_record_without_a_second_prefill():
    """Ray retries a call whose actor died after the commit: the retry (already committed, or committed
    by the lost attempt between the check and the write) reports the commit record's figures instead of
    failing the stage with ShardAlreadyCommittedError, and does no second prefill."""
    from types import SimpleNamespace

    from cache_schema.errors import ShardAlreadyCommittedError
    from pipeline.stages.cache import ShardPrefillWriter

    record = SimpleNamespace(num_samples=3, num_tokens=57, total_bytes=4096)
    prefills: list[int] = []

    def commit_shard(shard, buffer, **_):
        raise ShardAlreadyCommittedError(f"shard {shard} already committed")

    actor = object.__new__(ShardPrefillWriter)
    actor.emit, actor.writer_id, actor.shard_delay_s = False, "w", 0.0
    actor._prefill_lock, actor._write_lock = threading.Lock(), threading.Lock()
    actor._fill = lambda work: prefills.append(work["shard"])
    actor._quarantine = lambda shard, work: {}
    committed = {4}
    actor.root = SimpleNamespace(commit_shard=commit_shard, is_committed=lambda shard: shard in committed,
                                 record=lambda shard: record)
    first = actor({"shard": 4})
    assert prefills == [] and first["num_tokens"] == 57 and first["bytes"] == 4096 and first["error"] == ""
    raced = actor({"shard": 5})  # not committed at the check, committed by the lost attempt before the write
    assert prefills == [5] and raced["shard"] == 5 and raced["num_samples"] == 3 and raced["busy_seconds"] == 0.0


MEMORY_SCRIPT = r"""
import hashlib, json, sys, torch
sys.path.insert(0, sys.argv[1])
from cache_schema import CacheSample, open_cache
from test_cache_schema import make_fp

def peak_kib():  # VmHWM: the resident-set high-water mark since the last reset
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])

def reset():  # writing 5 to clear_refs resets VmHWM to the current RSS
    open("/proc/self/clear_refs", "w").write("5")

def sample(i):  # finite positive bf16 bits drawn as int16 (fast): bits < 0x3E80
    bits = lambda *shape: torch.randint(0, 16000, shape, dtype=torch.int16).view(torch.bfloat16)
    mask = torch.ones(T, dtype=torch.uint8)
    mask[: T // 4] = 0
    return CacheSample(input_ids=torch.zeros(T, dtype=torch.int32), loss_mask=mask, features=bits(T, 5 * H),
                       last_hidden=bits(int(mask[1:].sum()), H), sample_id=f"s{i}", source=0, row=i,
                       content_hash=hashlib.sha256(str(i).encode()).hexdigest())

mode, H, T, N = sys.argv[2], 512, 1024, 48
fp = make_fp(target={"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 6, "vocab_size": 512,
                     "config_sha256": "c0ffee"}, target_layer_ids=(0, 1, 2, 3, 4), max_length=T)
root = open_cache(sys.argv[3], fp)
torch.set_num_threads(1)
if mode == "list":  # the caller holds the samples: the write's own memory is measured
    samples = [sample(i) for i in range(N)]
    reset(); base = peak_kib()
    record = root.write_shard(0, samples, writer_id="mem")
else:  # streaming: each 4-sample batch is put, then dropped, as the prefill actor does
    reset(); base = peak_kib()
    buffer = root.new_shard([T] * N, [T - T // 4] * N)
    for b in range(0, N, 4):
        batch = [sample(i) for i in range(b, b + 4)]
        for i, s in zip(range(b, b + 4), batch):
            buffer.put(i, s)
        del batch
    record = root.commit_shard(0, buffer, writer_id="mem")
shard_bytes = sum(record.object_bytes.values())
print(json.dumps({"ratio": (peak_kib() - base) * 1024 / shard_bytes, "shard_bytes": shard_bytes}))
"""


@pytest.mark.parametrize("mode", ["list", "stream"])
def test_writer_peak_memory_is_within_1_3x_of_the_shard(tmp_path, mode):
    """A 270 MB shard (48 samples x 1,024 tokens, 5 x 512 bf16 features) at the default StorageConfig
    (256 MiB zarr shard objects): the peak RSS increase while writing, over the shard's bytes. The
    previous writer held the concatenation, a ``tobytes`` copy and zarr's encode buffers (3x and more)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "unit" / "cache_schema")}  # test_cache_schema
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(REPO), mode, str(tmp_path / "c")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["shard_bytes"] > 250e6
    assert got["ratio"] <= 1.3, got


def test_prefill_gathers_only_real_rows_in_sample_order():
    """The CUDA path's device-side gather (before its one pinned copy): the real tokens' features and the
    supervised positions' final states of a right-padded batch equal the per-sample slices."""
    from pipeline.target_model.prefill import next_supervised_positions, real_rows

    lengths, g = [5, 9, 3], torch.Generator().manual_seed(0)
    feats, final = torch.randn(3, 9, 6, generator=g), torch.randn(3, 9, 2, generator=g)
    masks = [np.array([0, 1, 1, 0, 1]), np.array([0, 0, 0, 1, 1, 1, 1, 0, 1]), np.array([0, 1, 1])]
    real = torch.arange(9)[None] < torch.tensor(lengths)[:, None]
    sup = torch.zeros(3, 9, dtype=torch.bool)
    for i, m in enumerate(masks):
        sup[i, torch.as_tensor(next_supervised_positions(m))] = True
    got_f, got_h = real_rows(feats, final, real, sup)
    assert got_f.shape == (17, 6) and got_h.shape == (10, 2)
    assert all(torch.equal(a, feats[i, :n]) for i, (a, n) in enumerate(zip(got_f.split(lengths), lengths)))
    want_h = [final[i, torch.as_tensor(next_supervised_positions(m))] for i, m in enumerate(masks)]
    assert all(torch.equal(a, b) for a, b in zip(got_h.split([len(w) for w in want_h]), want_h))


def test_s3_writes_send_unsigned_payloads_guarded_by_a_crc32_checksum(s3_url):
    """The writer's S3 PUTs are not SHA-256-hashed for the signature (``UNSIGNED-PAYLOAD``, the
    writer's CPU on plain-HTTP endpoints) yet each carries botocore's CRC32 checksum that the server
    verifies; the shard reads back with its commit record's SHA-256 checksums."""
    from storage import configure_storage

    configure_storage()
    root = open_cache(s3_url, make_fp(), storage=SMALL)
    sent: list[tuple[str, str, bool]] = []

    def record(request, **_):
        if request.method == "PUT" and request.body:
            sha = request.headers.get("X-Amz-Content-SHA256", b"")
            sent.append((request.url, sha.decode() if isinstance(sha, bytes) else sha,
                         "x-amz-checksum-crc32" in {k.lower() for k in request.headers}))

    root.fs.connect()
    root.fs.s3.meta.events.register("before-send.s3", record)
    samples = [make_sample(i, t) for i, t in enumerate(LENGTHS)]
    root.write_shard(0, samples, writer_id="s3")
    data_puts = [s for s in sent if "/c/" in s[0]]
    assert len(data_puts) >= len(LENGTHS) // 2  # several zarr shard objects per array under SMALL
    assert all(sha == "UNSIGNED-PAYLOAD" and crc for _, sha, crc in sent), sent
    reader = CacheReader(root.url, make_fp())
    reader.verify_shard(0)
    back = list(reader.iter_samples([0]))
    assert all(same_bits(a.features, b.features) for a, b in zip(back, samples))
