"""Cache stage end to end on a real local Ray: counts, quarantine, resume, kill, S3, fingerprint."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cache_schema import CacheReader, FingerprintMismatchError
from pipeline.stages.cache import cache_url, plan, run_cache
from pipeline.errors import ShardPlanMismatchError
from pipeline.run import DEFAULT_CONFIG, load_config

pytestmark = pytest.mark.integration


def _cfg(target, run_dir, cases, *extra):
    files = f"[{cases}/chats/openai.jsonl,{cases}/chats/sharegpt.jsonl]"
    return load_config(DEFAULT_CONFIG, [f"target.path={target}", f"run_dir={run_dir}",
                                        f"data.train_files={files}", "generate.enabled=false",
                                        "cache.rows_per_shard=4", "data.min_loss_tokens=1", *extra])


def _hash_map(url):
    r = CacheReader(url)
    return {s.sample_id: s.content_hash for s in r.iter_samples()}


def test_cache_stage_counts_quarantine_and_resume(ray_local, tiny_target_dir, input_cases, tmp_path):
    cfg = _cfg(tiny_target_dir, tmp_path / "run", input_cases)
    assert len(plan(cfg)) == 8  # 21 + 6 lines in spans of 4 rows
    s = run_cache(cfg)
    assert s["shards"] == 8 and s["shards_written"] == 8
    assert abs(s["bytes"] - s["estimate_bytes"]) <= 0.05 * s["bytes"]  # the estimate printed before prefill
    assert s["samples"] == 13  # o1 o2 o3 o4 o13 o14 o16 o18 o20 + s1 s2 s3 s6 (o19 too long at 512)
    assert s["skipped_rows"] == {"bad_type": 1, "empty_answer": 2, "empty_conversation": 1, "invalid_json": 1,
                                 "invalid_utf8": 1, "no_answer": 1, "no_supervised_tokens": 1,
                                 "no_user_turn": 2, "not_a_chat": 1, "unknown_role": 2}
    quarantine = [json.loads(line) for p in sorted((tmp_path / "run/cache/quarantine").glob("*.jsonl"))
                  for line in p.read_text().splitlines()]
    assert len(quarantine) == 13
    by_id = {q["id"]: q for q in quarantine}
    assert by_id["o5"]["line"] == 5 and by_id["o5"]["source"].endswith("openai.jsonl")
    assert by_id["s5"]["reason"] == "unknown_role" and by_id["s5"]["line"] == 5
    assert any(q["line"] == 11 and q["reason"] == "invalid_json" for q in quarantine)
    reader = CacheReader(cache_url(cfg))
    ids = sorted(s.sample_id for s in reader.iter_samples())
    assert "0-16" in ids and "0-0" in ids  # o16 duplicates o1 with distinct provenance
    by_sid = {s.sample_id: s for s in reader.iter_samples()}
    assert by_sid["0-0"].content_hash == by_sid["0-16"].content_hash
    assert by_sid["0-0"].features.shape == (by_sid["0-0"].num_tokens, 3 * 64)
    # resume: nothing left to do, quickly, same content
    t0 = time.time()
    again = run_cache(cfg)
    assert again["shards_written"] == 0 and again["shards_already_committed"] == 8
    assert time.time() - t0 < 10
    assert again["samples"] == 13
    # a different fingerprint (other layers) is refused, listing the field
    other = _cfg(tiny_target_dir, tmp_path / "run", input_cases, "target.target_layer_ids=[0,2]", "~train.drafters.eagle3")
    with pytest.raises(FingerprintMismatchError, match="target_layer_ids"):
        run_cache(other)
    # other shard boundaries would silently skip or repeat rows: refused before any work
    with pytest.raises(ShardPlanMismatchError, match="committed shard 0 holds rows 0-4 of input file 0, but this "
                       "run plans rows 0-3 .*cache.rows_per_shard"):
        run_cache(_cfg(tiny_target_dir, tmp_path / "run", input_cases, "cache.rows_per_shard=3"))
    assert run_cache(_cfg(tiny_target_dir, tmp_path / "run", input_cases, "cache.max_rows=10"))["shards"] == 8
    assert sorted(p.name for p in (tmp_path / "run/cache/commits").iterdir()) == [f"s{i:06d}.json" for i in range(8)]


def test_storage_budget_stops_before_prefill(ray_local, tiny_target_dir, input_cases, tmp_path):
    from pipeline.stages.cache import StorageBudgetError

    cfg = _cfg(tiny_target_dir, tmp_path / "run", input_cases, "cache.storage_budget_bytes=1000")
    with pytest.raises(StorageBudgetError, match="storage_budget_bytes=1,000"):
        run_cache(cfg)
    assert not list((tmp_path / "run/cache").glob("commits/*"))


def test_cache_on_s3(ray_local, tiny_target_dir, input_cases, s3_url, tmp_path):
    cfg = _cfg(tiny_target_dir, s3_url, input_cases, "cache.max_rows=8")
    s = run_cache(cfg)
    assert s["shards"] == 2 and s["samples"] == 4  # o1 o2 o3 o4
    local = _cfg(tiny_target_dir, tmp_path / "local", input_cases, "cache.max_rows=8")
    run_cache(local)
    assert _hash_map(cache_url(cfg)) == _hash_map(cache_url(local))
    a, b = CacheReader(cache_url(cfg)), CacheReader(cache_url(local))
    for i in range(len(a)):
        assert torch.equal(a.sample(i).features, b.sample(i).features)
    assert "testing-secret" not in json.dumps(s)


def _write_chats(path: Path, n: int):
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "messages": [
                {"role": "user", "content": f"Question {i}: " + "why " * (i % 7)},
                {"role": "assistant", "content": f"Answer {i} " + "because " * (5 + i % 11)}]}) + "\n")


def test_kill_and_rerun_is_exactly_once(ray_local, tiny_target_dir, tmp_path):
    """SIGKILL the CLI after some shards commit; the rerun ends with the uninterrupted cache's samples
    (the uninterrupted run in this process, on the session's Ray: the same stage code)."""
    data = tmp_path / "chats.jsonl"
    _write_chats(data, 120)
    args = ["+stage=cache", str(DEFAULT_CONFIG), f"target.path={tiny_target_dir}", f"data.train_files=[{data}]",
            "generate.enabled=false", "cache.rows_per_shard=4", "cache.num_workers=1", "data.min_loss_tokens=1",
            "ray.num_cpus=2"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}

    def cli(run_dir, **kw):
        return subprocess.Popen([sys.executable, "-m", "pipeline.run", *args, f"run_dir={run_dir}"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **kw)

    killed = tmp_path / "killed"
    p = cli(killed)
    commits = killed / "cache" / "commits"
    deadline = time.time() + 240
    while time.time() < deadline and len(list(commits.glob("*.json"))) < 5:
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    n_before = len(list(commits.glob("*.json")))
    assert 5 <= n_before < 30, "the kill must land mid-run"
    assert cli(killed).wait(timeout=300) == 0
    full = tmp_path / "full"
    run_cache(load_config(DEFAULT_CONFIG, [*args[2:], f"run_dir={full}"]))
    a, b = _hash_map(str(killed / "cache")), _hash_map(str(full / "cache"))
    assert len(a) == 120 and a == b
    summary = json.loads((killed / "cache" / "summary.json").read_text())
    assert summary["shards_already_committed"] >= n_before and summary["samples"] == 120
