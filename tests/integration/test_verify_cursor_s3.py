"""ops verify with a kept cursor on S3 (moto server): a repeat verify re-lists every shard the cursor holds and
finds objects deleted or replaced since, at no more than two storage requests per shard (the local cases:
tests/unit/ops/test_verify_cursor.py)."""
from __future__ import annotations

import json
import time

import pytest

import ops.verify
from cache_schema import open_cache
from cache_schema.layout import shard_group_key
from opscache import build, make_fp, make_sample, run
from verifycursor import OBJECT, _checks, _tiny_cache


@pytest.mark.integration
def test_an_object_deleted_on_s3_after_its_shard_was_verified_is_reported(s3_url, tmp_path, capsys):
    root = build(s3_url, {i: [make_sample(2 * i, 10), make_sample(2 * i + 1, 7)] for i in range(3)})
    cursor = tmp_path / "cursor.jsonl"
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor)
    assert code == 0 and p["verified_now"] == 3
    entry = next(e for e in map(json.loads, cursor.read_text().splitlines()[1:]) if e["shard"] == 1)
    assert len(entry["objects"][OBJECT][1]) == 32  # the S3 ETag: an MD5, quotes stripped
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor)
    assert code == 0 and (p["verified_now"], p["resumed"]) == (0, 3)
    size = entry["objects"][OBJECT][0]
    root.fs.rm(f"{root.path}/{shard_group_key(1)}/{OBJECT}")
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor)
    assert code == 1 and p["shards_with_problems"] == [1] and p["changed_since_cursor"] == [1]
    assert p["problems"] == [{"shard": 1, "sample": None, "sample_id": None, "check": "missing_object",
                              "detail": f"object {OBJECT} ({size:,} bytes) is missing"}]
    assert (p["verified_now"], p["resumed"]) == (1, 2)


@pytest.mark.integration
def test_an_object_replaced_on_s3_with_other_bytes_of_the_same_size_is_reported(s3_url, tmp_path, capsys):
    root = build(s3_url, {i: [make_sample(2 * i, 10), make_sample(2 * i + 1, 7)] for i in range(2)})
    cursor = tmp_path / "cursor.jsonl"
    assert run(capsys, "verify", s3_url, "--cursor", cursor)[0] == 0
    ours, theirs = (f"{root.path}/{shard_group_key(i)}/{OBJECT}" for i in (1, 0))
    data = root.fs.cat_file(theirs)
    assert len(data) == root.fs.size(ours) and data != root.fs.cat_file(ours)
    root.fs.pipe_file(ours, data)
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor)
    assert code == 1 and _checks(p) == [(1, "checksum"), (1, "changed_object")]


@pytest.mark.integration
def test_a_repeat_verify_on_s3_makes_at_most_two_requests_per_shard(s3_server, s3_url, tmp_path):
    n, local = 50, str(tmp_path / "cache")
    _tiny_cache(local, n)
    open_cache(s3_url, make_fp()).fs.put(f"{local}/", f"{s3_url.removeprefix('s3://')}/", recursive=True)
    cursor, proxy = str(tmp_path / "c.jsonl"), s3_server["proxy"]
    report, code = ops.verify.verify(s3_url, cursor=cursor, progress=False)
    assert code == 0 and report["verified_now"] == n
    proxy.reset_stats()
    t0 = time.perf_counter()
    report, code = ops.verify.verify(s3_url, cursor=cursor, progress=False)
    seconds, requests = time.perf_counter() - t0, dict(proxy.reset_stats().requests)
    assert code == 0 and (report["verified_now"], report["resumed"]) == (0, n)
    print(f"repeat verify of {n} S3 shards: {sum(requests.values())} requests {requests}, {seconds:.2f} s")
    # one listing (LIST) and one commit-record read (GET) per shard; the fingerprint and commits/ listing
    assert requests.get("LIST") == n + 1 and n <= requests.get("GET", 0) <= n + 2 and requests.get("HEAD", 0) <= 2
    assert sum(requests.values()) <= 2 * n + 5
