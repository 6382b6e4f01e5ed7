"""Which Ray cluster a run lands on (issue #37 item 5), stages submitted with ``ray job submit``, and
the cache stage under a bounded object store (item 6).

A user's ``ray start --head`` is reproduced as Ray discovers it: started without ``--temp-dir``, it
records its GCS address in ``ray_current_cluster`` of Ray's default temp dir, which a plain
``ray.init()`` reads and joins. ``RAY_TMPDIR`` (the root of that default) is set to a private folder
for the head and the runs alike, so the test neither sees nor disturbs other Ray users of the machine.
One such head serves the module: runs that must leave it alone, a run asked to join it, and the
stages submitted to its job server (the cache stage, and online training with the run on S3).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from chatgen import write_chats
from pipeline.cluster import head_counts, local_head, submit
from pipeline.run import DEFAULT_CONFIG
from paths import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def user_head(s3_server):
    """A user's ``ray start --head`` (2 CPUs), discoverable in Ray's default temp dir under a private
    ``RAY_TMPDIR``, started after the S3 server (its jobs inherit the AWS_* variables, as a cluster
    node's do); yields its ``env`` (for the runs: RAY_TMPDIR set, RAY_ADDRESS unset), ``gcs`` (the
    address it recorded), ``ray_bin`` and ``address`` (its job server, for ``ray job submit``)."""
    root = Path(tempfile.mkdtemp(prefix="ru", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(root), RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO))
    try:
        with local_head(num_cpus=2, env=env, discoverable=True) as (ray_bin, address, env):
            record = root / "ray" / "ray_current_cluster"  # where a plain ray.init() looks
            yield SimpleNamespace(env=env, gcs=record.read_text().strip(), ray_bin=ray_bin, address=address)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _cache_stage(run_dir: Path, target: str, cases: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.run", "+stage=cache", str(DEFAULT_CONFIG), f"target.path={target}",
         f"run_dir={run_dir}", "generate.enabled=false", f"data.train_files=[{cases}/chats/sharegpt.jsonl]",
         "data.min_loss_tokens=1", "cache.rows_per_shard=3", "cache.num_workers=1", *extra],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    return out


def _checksums(run_dir: Path) -> dict[str, dict[str, str]]:
    """The committed shards' array checksums (SHA-256 of the stored bytes), by commit record."""
    return {p.name: json.loads(p.read_text())["checksums"] for p in sorted((run_dir / "cache" / "commits").glob("*.json"))}


def test_runs_leave_a_users_ray_start_cluster_alone_unless_asked(user_head, tiny_target_dir, input_cases, tmp_path):
    before = head_counts(user_head.gcs)
    assert before["alive_nodes"] == 1
    # two concurrent runs without an address, each with its own run_dir: each starts a private instance
    a, b = (_cache_stage(tmp_path / name, tiny_target_dir, input_cases, user_head.env, "ray.num_cpus=2")
            for name in ("a", "b"))
    outs = [_finish(a), _finish(b)]
    assert head_counts(user_head.gcs) == before, "a run without ray.address joined the user's cluster"
    assert not any("Connecting to existing Ray cluster" in out for out in outs)
    lone = _checksums(tmp_path / "a")
    assert len(lone) == 2 and _checksums(tmp_path / "b") == lone  # 2 shards: s1 s2 s3 | s6
    # asked to join: the user's head runs it (one more job there), with the same committed shards
    _finish(_cache_stage(tmp_path / "c", tiny_target_dir, input_cases, user_head.env, "ray.address=auto"))
    after = head_counts(user_head.gcs)
    assert after["jobs"] == before["jobs"] + 1 and after["alive_nodes"] == 1
    assert _checksums(tmp_path / "c") == lone


def test_cache_stage_with_more_actors_than_cores_under_a_bounded_object_store(tiny_target_dir, tmp_path):
    """3 prefill actors on a 2-core machine (3 logical CPUs), a 256 MiB object store, 12 shards."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: " + "why " * (i % 7)},
        {"role": "assistant", "content": f"Answer {i} " + "because " * (5 + i % 11)}]}) + "\n" for i in range(48)))
    store = 256 * 2**20
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.run", "+stage=cache", str(DEFAULT_CONFIG), f"target.path={tiny_target_dir}",
         f"run_dir={tmp_path / 'run'}", "generate.enabled=false", f"data.train_files=[{data}]",
         "data.min_loss_tokens=1", "cache.rows_per_shard=4", "cache.num_workers=3", "ray.num_cpus=3",
         f"ray.object_store_memory={store}"],
        env={**env, "RAY_AUTH_MODE": "disabled"}, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "cache" / "summary.json").read_text())
    assert s["shards"] == s["shards_written"] == 12 and s["samples"] == 48
    assert s["object_store_capacity_bytes"] == store
    assert 0 < s["object_store_peak_bytes"] <= store
    assert s["object_store_spilled_bytes"] == 0 and s["object_store_fallback_peak_bytes"] == 0


def test_cache_stage_via_ray_job_submit(user_head, tiny_target_dir, input_cases, tmp_path):
    """``ray job submit`` of the cache stage to the user's head: the job's driver joins it
    (``$RAY_ADDRESS``), and the summary's object-store figures are the head's."""
    run_dir = tmp_path / "run"
    entry = [sys.executable, "-m", "pipeline.run", "+stage=cache", str(DEFAULT_CONFIG),
             f"target.path={tiny_target_dir}", f"run_dir={run_dir}", "generate.enabled=false",
             f"data.train_files=[{input_cases}/chats/sharegpt.jsonl]", "data.min_loss_tokens=1",
             "cache.rows_per_shard=3"]
    r = submit(user_head.ray_bin, user_head.address, user_head.env, entry, timeout_s=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    summary = json.loads((run_dir / "cache" / "summary.json").read_text())
    assert summary["shards"] == 2 and summary["samples"] == 4  # s1 s2 s3 s6
    assert summary["skipped_rows"] == {"no_user_turn": 1, "unknown_role": 1}
    assert 0 < summary["object_store_peak_bytes"] <= summary["object_store_capacity_bytes"]  # the head's store


def test_online_train_via_ray_job_submit_with_the_run_on_s3(user_head, tiny_target_dir, s3_url, tmp_path):
    """``ray job submit``: +stage=train with train.features=online, run_dir on the local S3 server.
    Nothing but the drafter's checkpoints and metrics lands under the run."""
    import s3fs

    data = tmp_path / "chats.jsonl"
    write_chats(data, 120)
    entry = [sys.executable, "-m", "pipeline.run", "+stage=train", str(DEFAULT_CONFIG), f"target.path={tiny_target_dir}",
             f"run_dir={s3_url}", f"data.train_files=[{data}]", "generate.enabled=false", "cache.rows_per_shard=16",
             "data.min_loss_tokens=1", "train.num_anchors=8", "train.drafters.dspark.markov_rank=8",
             "train.drafters.dspark.num_layers=1", "~train.drafters.dflash", "~train.drafters.eagle3",
             "train.num_workers=1", "train.concurrent_drafters=1", "train.heldout_shards=1", "train.validation_shards=1",
             "train.validate_every_steps=4", "train.micro_batch_samples=4", "train.global_batch_samples=4",
             "train.lr=3e-3", "cache.num_workers=1", "train.checkpoint_every_steps=100",
             "train.features=online", "train.epochs=1", "train.max_steps=6"]
    r = submit(user_head.ray_bin, user_head.address, user_head.env, entry, timeout_s=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    fs = s3fs.S3FileSystem()
    root = s3_url.removeprefix("s3://")
    result = json.loads(fs.cat_file(f"{root}/train/dspark/result.json"))
    assert result["features"] == "online" and result["steps"] == 6 and result["stream"]["rows"] >= 24
    assert {p.removeprefix(root + "/").split("/")[0] for p in fs.find(root)} == {"train"}
    state = json.loads(fs.cat_file(f"{root}/train/dspark/checkpoints/step-000006/COMMITTED.json"))
    assert state["features"] == "online" and state["consumed"][0]["samples"] == 24
