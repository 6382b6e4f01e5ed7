"""The cache stage submitted with `ray job submit` to a user's `ray start --head` (127.0.0.1), started as a
user starts it: discoverable in Ray's default temp dir (moved under a private RAY_TMPDIR)."""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.cluster import local_head, submit
from pipeline.run import DEFAULT_CONFIG

pytestmark = pytest.mark.integration


def test_cache_stage_via_ray_job_submit(tiny_target_dir, input_cases, tmp_path):
    run_dir = tmp_path / "run"
    entry = [sys.executable, "-m", "pipeline.run", "+stage=cache", str(DEFAULT_CONFIG),
             f"target.path={tiny_target_dir}", f"run_dir={run_dir}", "generate.enabled=false",
             f"data.train_files=[{input_cases}/chats/sharegpt.jsonl]", "data.min_loss_tokens=1",
             "cache.rows_per_shard=3"]
    root = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(root)}
    try:
        with local_head(num_cpus=2, env=env, discoverable=True) as (ray_bin, address, env):
            assert (root / "ray" / "ray_current_cluster").is_file()  # where a plain ray.init() looks
            r = submit(ray_bin, address, env, entry, timeout_s=400)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    summary = json.loads((run_dir / "cache" / "summary.json").read_text())
    assert summary["shards"] == 2 and summary["samples"] == 4  # s1 s2 s3 s6
    assert summary["skipped_rows"] == {"no_user_turn": 1, "unknown_role": 1}
    assert 0 < summary["object_store_peak_bytes"] <= summary["object_store_capacity_bytes"]  # the head's store
