"""ops tools against a real S3 API (moto server): verify finds damage and resumes, gc, diff, errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import zarr

import ops.verify
from cache_schema import open_cache
from cache_schema.layout import shard_group_key
from ops.__main__ import main
from opscache import SMALL, build, commit, crash, make_fp, make_sample, run
from paths import REPO
from verifycursor import interrupting

pytestmark = pytest.mark.integration


def _object(root, shard: int, prefix: str) -> str:
    """Full path of the first object of a shard whose key starts with ``prefix``."""
    key = sorted(k for k in root.record(shard).object_bytes if k.startswith(prefix))[0]
    return f"{root.path}/{shard_group_key(shard)}/{key}"


def _found(problems: list[dict]) -> list[tuple]:
    return sorted((p["shard"], p["check"], -1 if p["sample"] is None else p["sample"]) for p in problems)


def test_verify_reports_each_kind_of_damage_with_its_shard_and_sample(s3_url, tmp_path, capsys):
    root = build(s3_url, {i: [make_sample(3 * i + k, 20 + k) for k in range(3)] for i in range(4)})
    # shard 4 repeats sample "0-1" (id and source/row, shard 0 sample 1) and the source/row of "0-6"
    commit(root, 4, [make_sample(1, 20), make_sample(40, 9, row=6, sid="copy")])
    root.fs.rm(_object(root, 1, "features/c/"))                       # a deleted object
    truncated = _object(root, 2, "last_hidden/c/")
    root.fs.pipe_file(truncated, root.fs.cat_file(truncated)[:-100])  # a truncated object
    sizes = root.shard_objects(3)
    features = zarr.open_array(root.shard_store(3, read_only=False), path="features", mode="r+",
                               config={"write_empty_chunks": True})
    features[20 + 21 + 5, 7] = 0x7F80                                 # +inf bits in shard 3 sample 2
    assert root.shard_objects(3) == sizes  # same sizes: only the checksum and the values can tell

    code, p = run(capsys, "verify", s3_url, "--cursor", tmp_path / "cursor.jsonl", "--workers", "3")
    assert code == 1 and p["shards"] == 5 and p["shards_with_problems"] == [0, 1, 2, 3, 4]
    assert _found(p["problems"]) == [
        (0, "duplicate_provenance", 1), (0, "duplicate_sample_id", 1),
        (1, "missing_object", -1),
        (2, "duplicate_provenance", 0), (2, "truncated_object", -1),
        (3, "checksum", -1), (3, "non_finite", 2),
        (4, "duplicate_provenance", 0), (4, "duplicate_provenance", 1), (4, "duplicate_sample_id", 0)]
    by = {(q["shard"], q["check"], q["sample"]): q for q in p["problems"]}
    assert by[(3, "non_finite", 2)]["sample_id"] == "0-11" and "features" in by[(3, "non_finite", 2)]["detail"]
    assert by[(0, "duplicate_sample_id", 1)]["detail"] == "sample id 0-1 also at shard 4 sample 0"
    assert by[(4, "duplicate_provenance", 1)]["detail"] == "source/row (0, 6) also at shard 2 sample 0"
    assert truncated.rsplit("/", 3)[-3] in by[(2, "truncated_object", None)]["detail"]
    assert main(["verify", s3_url, "--cursor", str(tmp_path / "c2.jsonl")]) == 1
    assert "10 problems in shards 0, 1, 2, 3, 4" in capsys.readouterr().out


def test_interrupted_verify_resumes_and_relists_finished_shards(s3_url, tmp_path, capsys, monkeypatch):
    root = build(s3_url, {i: [make_sample(i, 12)] for i in range(5)})
    cursor, calls, real = tmp_path / "cursor.jsonl", [], ops.verify.verify_shard

    monkeypatch.setattr(ops.verify, "verify_shard", interrupting(real, calls))
    assert main(["verify", s3_url, "--cursor", str(cursor), "--workers", "1"]) == 130
    assert "interrupted after 2 of 5 shards; rerun the same command" in capsys.readouterr().err
    saved = [json.loads(line) for line in cursor.read_text().splitlines()]
    assert saved[0]["url"] == root.url and [e["shard"] for e in saved[1:]] == [0, 1]
    assert saved[1]["ids"] == ["0-0"] and saved[1]["provenance"] == [[0, 0]]
    # damage a finished shard: the resumed verify re-lists it, sees the change and reads it again
    root.fs.rm(_object(root, 0, "input_ids/c/"))
    calls.clear()
    monkeypatch.setattr(ops.verify, "verify_shard", lambda r, i: calls.append(i) or real(r, i))
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor, "--workers", "1")
    assert code == 1 and sorted(calls) == [0, 2, 3, 4] and (p["resumed"], p["verified_now"], p["samples"]) == (1, 4, 5)
    assert _found(p["problems"]) == [(0, "missing_object", -1)] and p["changed_since_cursor"] == [0]
    calls.clear()  # a completed verify keeps its cursor: the next one only re-lists the finished shards
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor)
    assert code == 1 and calls == [] and (p["resumed"], p["verified_now"]) == (5, 0)
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor, "--restart")  # re-reads all: finds the damage
    assert code == 1 and _found(p["problems"]) == [(0, "missing_object", -1)]
    # --restart ignores saved progress
    ops.verify.write_cursor(cursor, {"cursor_version": 1, "url": root.url, "fingerprint_sha256": make_fp().digest()},
                            [saved[2]])
    calls.clear()
    code, p = run(capsys, "verify", s3_url, "--cursor", cursor, "--restart")
    assert sorted(calls) == [0, 1, 2, 3, 4] and p["resumed"] == 0


def test_gc_removes_only_uncommitted_objects(s3_url, tmp_path, capsys):
    root = build(s3_url, {0: [make_sample(0, 10)], 1: [make_sample(1, 14)]})
    crash(root, 2, [make_sample(2, 9)])
    quarantine = f"{root.path}/quarantine/s000002.jsonl"
    root.fs.pipe_file(quarantine, b'{"reason": "invalid_json"}\n')
    committed = {i: root.shard_objects(i) for i in (0, 1)}
    code, p = run(capsys, "gc", s3_url)
    assert code == 0 and p["shards"][0]["action"].startswith("kept: written")  # a writer may be running
    code, p = run(capsys, "gc", s3_url, "--min-age", "0")
    assert code == 1 and p["deleted"] == 0 and [r["shard"] for r in p["shards"]] == [2]
    assert p["objects"] == len(root.shard_objects(2)) + 1 and root.fs.exists(quarantine)
    code, p = run(capsys, "gc", s3_url, "--min-age", "0", "--yes")
    assert code == 0 and p["deleted"] == 1 and p["shards"][0]["action"] == "deleted"
    assert root.shard_objects(2) == {} and not root.fs.exists(quarantine)
    assert {i: root.shard_objects(i) for i in (0, 1)} == committed and root.committed_shards() == [0, 1]
    assert main(["verify", s3_url, "--no-progress", "--cursor", str(tmp_path / "c.jsonl")]) == 0


def test_diff_of_a_killed_and_resumed_cache_against_an_uninterrupted_one(s3_url, capsys):
    plan = {i: [make_sample(3 * i + k, 10 + 3 * k) for k in range(3)] for i in range(4)}
    build(f"{s3_url}/full", plan)
    killed = open_cache(f"{s3_url}/killed", make_fp(), storage=SMALL)
    for i in (0, 1):
        commit(killed, i, plan[i])
    crash(killed, 2, plan[2][:1])  # the killed writer got one sample of shard 2 out, no commit
    code, p = run(capsys, "diff", f"{s3_url}/full", f"{s3_url}/killed")
    assert code == 1 and p["only_in_a"] == ["0-10", "0-11", "0-6", "0-7", "0-8", "0-9"]
    assert p["shards_only_in_a"] == [2, 3] and p["only_in_b"] == []
    for i, samples in plan.items():  # the rerun: skip committed shards, rewrite the others
        if not killed.is_committed(i):
            commit(killed, i, samples, writer="rerun")
    code, p = run(capsys, "diff", f"{s3_url}/full", f"{s3_url}/killed")
    assert code == 0 and p["identical"] and p["differences"] == [] and p["samples_a"] == p["samples_b"] == 12
    assert run(capsys, "gc", f"{s3_url}/killed", "--min-age", "0")[1]["shards"] == []


def test_s3_errors_are_one_line_and_never_show_secrets(s3_url, s3_server, capsys):
    assert main(["stat", s3_url]) == 2  # an empty prefix is not a cache
    err = capsys.readouterr().err
    assert err == f"error: no cache at {s3_url} (no fingerprint.json); check the URL or run the cache stage\n"
    assert main(["du", "s3://no-such-bucket-anywhere/cache"]) == 2
    assert "no cache at s3://no-such-bucket-anywhere/cache" in capsys.readouterr().err
    # no credentials: a fresh process (s3fs caches clients) whose environment has none
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=s3_server["endpoint"], AWS_DEFAULT_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_CONFIG_FILE="/nonexistent")
    out = subprocess.run([sys.executable, "-m", "ops", "ls", s3_url], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"error: no credentials for {s3_url}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                          "or AWS_PROFILE (or the backend's own credentials)\n")
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in out.stderr + err
