"""ops verify with a kept cursor: a repeat verify re-lists every shard the cursor holds and finds objects
deleted, truncated or replaced since (it used to trust the cursor and report such a cache clean), at no
more than two storage requests per shard; old cursors without listings still load."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import fsspec.implementations.local as fs_local
import pytest

import ops.verify
from cache_schema import open_cache
from cache_schema.layout import shard_group_key
from ops.__main__ import main
from opscache import build, make_sample, run
from verifycursor import OBJECT, SHARDS, _checks, _tiny_cache, interrupting


def _cache(url: str) -> None:
    build(url, {i: [make_sample(2 * i, 10), make_sample(2 * i + 1, 7)] for i in range(SHARDS)})


def _object(url: str, shard: int, key: str = OBJECT) -> Path:
    return Path(url) / shard_group_key(shard) / key


@pytest.fixture
def verified(tmp_path, capsys) -> tuple[str, Path]:
    """A local cache of 4 committed shards, verified once (clean) with its cursor kept."""
    url, cursor = str(tmp_path / "run" / "cache"), tmp_path / "cursor.jsonl"
    _cache(url)
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 0 and (p["verified_now"], p["resumed"]) == (SHARDS, 0)
    return url, cursor


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """Shards read in full (``verify_shard`` calls) from now on."""
    calls, real = [], ops.verify.verify_shard
    monkeypatch.setattr(ops.verify, "verify_shard", lambda r, i: calls.append(i) or real(r, i))
    return calls


def test_an_untouched_cache_verified_again_is_relisted_not_reread(verified, reads, capsys):
    url, cursor = verified
    header, *entries = [json.loads(line) for line in cursor.read_text().splitlines()]
    entries = {e["shard"]: e for e in entries}
    assert header["cursor_version"] == 2 and sorted(entries) == list(range(SHARDS))
    listing = entries[0]["objects"]
    assert listing[OBJECT][0] == _object(url, 0).stat().st_size and listing[OBJECT][1]  # size and a token
    assert set(listing) == set(open_cache(url, create=False).record(0).object_bytes)
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 0 and p["ok"] and reads == [] and p["bytes_read_now"] == 0
    assert (p["verified_now"], p["resumed"], p["relisted"], p["changed_since_cursor"], p["samples"]) == \
        (0, SHARDS, SHARDS, [], 2 * SHARDS)
    assert main(["verify", url, "--cursor", str(cursor)]) == 0
    assert capsys.readouterr().out.strip() == \
        "verified 4 shards (0 read now, 4 re-listed against the cursor), 8 samples: no problems"


def test_an_object_deleted_after_its_shard_was_verified_is_reported(verified, reads, capsys):
    url, cursor = verified
    size = _object(url, 2).stat().st_size
    _object(url, 2).unlink()
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 1 and not p["ok"] and reads == [2] and p["shards_with_problems"] == [2]
    assert (p["verified_now"], p["resumed"], p["relisted"], p["changed_since_cursor"]) == (1, 3, 4, [2])
    assert p["problems"] == [{"shard": 2, "sample": None, "sample_id": None, "check": "missing_object",
                              "detail": f"object {OBJECT} ({size:,} bytes) is missing"}]
    assert main(["verify", url, "--cursor", str(cursor)]) == 1  # the damaged listing keeps its verdict
    out = capsys.readouterr().out
    assert f"missing_object  object {OBJECT} ({size:,} bytes) is missing" in out
    assert out.strip().endswith("verified 4 shards (0 read now, 4 re-listed against the cursor), "
                                "8 samples: 1 problem in shard 2")


def test_an_object_truncated_after_its_shard_was_verified_is_reported(verified, reads, capsys):
    url, cursor = verified
    path = _object(url, 1)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    assert main(["verify", url, "--cursor", str(cursor)]) == 1
    out = capsys.readouterr().out
    assert f"truncated_object  object {OBJECT} has {len(data) - 100:,} bytes, its record says {len(data):,}" in out
    assert out.strip().endswith("verified 4 shards (1 read now, 3 re-listed against the cursor; shard 1 read "
                                "again: its objects changed since the cursor), 8 samples: 1 problem in shard 1")
    assert reads == [1]


def test_an_object_replaced_by_another_shards_object_of_the_same_size_is_reported(verified, reads, capsys):
    url, cursor = verified
    ours, theirs = _object(url, 3).read_bytes(), _object(url, 0).read_bytes()
    assert len(ours) == len(theirs) and ours != theirs  # only the content (and the token) can tell
    _object(url, 3).write_bytes(theirs)
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 1 and reads == [3] and p["shards_with_problems"] == [3] and p["changed_since_cursor"] == [3]
    assert _checks(p) == [(3, "checksum"), (3, "changed_object")]
    assert p["problems"][0]["detail"] == "array features does not match its checksum"
    assert p["problems"][1]["detail"].startswith(f"object {OBJECT} was replaced since verify last read the shard")


def test_an_object_rewritten_with_its_own_bytes_is_read_again_and_passes(verified, reads, capsys):
    url, cursor = verified
    path = _object(url, 0)
    path.write_bytes(path.read_bytes())  # same size and bytes, new mtime: a re-upload, a restore
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 0 and reads == [0] and (p["verified_now"], p["resumed"], p["changed_since_cursor"]) == (1, 3, [0])
    reads.clear()
    code, p = run(capsys, "verify", url, "--cursor", cursor)  # its new listing is in the cursor now
    assert code == 0 and reads == [] and p["resumed"] == SHARDS


def test_an_old_cursor_without_listings_is_read_once_then_relisted(verified, reads, capsys):
    url, cursor = verified
    header, *entries = [json.loads(line) for line in cursor.read_text().splitlines()]
    old = [{k: v for k, v in e.items() if k != "objects"} for e in entries]  # a version 1 cursor
    ops.verify.write_cursor(cursor, {**header, "cursor_version": 1}, old)
    assert ops.verify.load_cursor(cursor, header) == {e["shard"]: e for e in old}
    _object(url, 1).unlink()
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 1 and sorted(reads) == list(range(SHARDS)) and _checks(p) == [(1, "missing_object")]
    assert (p["verified_now"], p["resumed"], p["relisted"]) == (SHARDS, 0, 0)
    reads.clear()
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 1 and reads == [] and (p["verified_now"], p["resumed"]) == (0, SHARDS)


def test_listing_changes_and_change_tokens():
    from ops.verify import change_token, listing_changes

    before = {"a": [3, "x"], "b": [4, "y"], "c": [5, "z"], "d": [6, "w"]}
    now = {"a": [3, "x"], "b": [2, "y"], "c": [5, "z2"], "e": [1, "v"]}
    assert listing_changes(before, before) == {}
    assert listing_changes(before, now) == {"missing": ["d"], "added": ["e"], "resized": ["b"], "replaced": ["c"]}
    assert change_token({"ETag": '"9b2cf535f27731c974343645a3985328"', "LastModified": "t"}) == \
        "9b2cf535f27731c974343645a3985328"
    assert change_token({"mtime": 1.5, "created": 2.25, "ino": 7, "size": 3}) == "1.5/2.25/7"
    assert change_token({"size": 3}) == ""


# ---- request counts ---------------------------------------------------------------------------

LOCAL_CALLS = ("ls", "find", "walk", "info", "exists", "isdir", "isfile", "glob", "cat_file", "_open")


@pytest.fixture
def local_calls(monkeypatch) -> dict[str, int]:
    """Storage calls of the local filesystem from now on, by method; a call made inside another counted
    call (``find`` walking its folders, ``cat_file`` opening its file) is part of that one."""
    counts: dict[str, int] = {}
    depth, lock = threading.local(), threading.Lock()

    def wrap(name, real):
        def counted(self, *args, **kwargs):
            outer = getattr(depth, "n", 0) == 0
            if outer:
                with lock:
                    counts[name] = counts.get(name, 0) + 1
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return real(self, *args, **kwargs)
            finally:
                depth.n -= 1
        return counted

    for name in LOCAL_CALLS:
        monkeypatch.setattr(fs_local.LocalFileSystem, name, wrap(name, getattr(fs_local.LocalFileSystem, name)))
    return counts


def test_a_repeat_verify_makes_at_most_two_local_calls_per_shard(tmp_path, local_calls):
    n, url, cursor = 50, str(tmp_path / "cache"), str(tmp_path / "c.jsonl")
    _tiny_cache(url, n)
    report, code = ops.verify.verify(url, cursor=cursor, progress=False)
    assert code == 0 and report["verified_now"] == n
    local_calls.clear()
    report, code = ops.verify.verify(url, cursor=cursor, progress=False)
    assert code == 0 and (report["verified_now"], report["resumed"]) == (0, n)
    print(f"repeat verify of {n} local shards: {sum(local_calls.values())} calls {local_calls}")
    # one listing and one commit-record read per shard; the root's fingerprint and commits/ listing
    assert local_calls.get("find") == n and local_calls.get("cat_file") == n + 1 and local_calls.get("ls") == 1
    assert sum(local_calls.values()) <= 2 * n + 4


def test_an_interrupted_verify_resumes_and_still_finds_damage_to_finished_shards(tmp_path, capsys, monkeypatch):
    url, cursor, calls, real = str(tmp_path / "cache"), tmp_path / "c.jsonl", [], ops.verify.verify_shard
    build(url, {i: [make_sample(i, 12)] for i in range(5)})

    monkeypatch.setattr(ops.verify, "verify_shard", interrupting(real, calls))
    assert main(["verify", url, "--cursor", str(cursor), "--workers", "1"]) == 130
    assert "interrupted after 2 of 5 shards; rerun the same command" in capsys.readouterr().err
    _object(url, 0, "input_ids/c/0").unlink()  # a shard finished before the interrupt, damaged since
    calls.clear()
    monkeypatch.setattr(ops.verify, "verify_shard", lambda r, i: calls.append(i) or real(r, i))
    code, p = run(capsys, "verify", url, "--cursor", cursor, "--workers", "1")
    assert code == 1 and sorted(calls) == [0, 2, 3, 4] and _checks(p) == [(0, "missing_object")]
    assert (p["resumed"], p["verified_now"], p["relisted"], p["changed_since_cursor"], p["samples"]) == \
        (1, 4, 2, [0], 5)
    calls.clear()
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 1 and calls == [] and (p["resumed"], p["verified_now"]) == (5, 0)
