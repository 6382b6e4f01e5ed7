"""Object storage as it behaves under load: the test S3 server behind ``tests/support/faultproxy.py`` answers
a seeded share of requests 503 SlowDown or 500, resets connections mid-body, holds responses past the
client's read timeout and loses PUTs after their body was sent. The product's retry policy
(``storage``) must make every result identical to a fault-free run; past the budget a stage
must stop with one ``error:`` line, commit nothing partial, and a rerun must finish exactly once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs

from cache_schema import CacheReader, StorageUnavailableError, open_cache
from faultproxy import NO_FAULTS, Faults
from ops import compare, verify
from pipeline.run import DEFAULT_CONFIG, load_config, run_stages
from storage import RetryPolicy, configure_storage, read_json, retry_budget_s
from opscache import SMALL, make_fp, make_sample
from paths import REPO

pytestmark = pytest.mark.integration

# short timeouts so that a held response costs about a second, not a minute
POLICY = ["storage.max_attempts=6", "storage.body_attempts=3", "storage.connect_timeout_s=2",
          "storage.read_timeout_s=1"]
LOAD = Faults(slowdown=0.05, reset=0.01, timeout=0.01, put_lost=0.01, seed=19, delay_s=1.5)


def _policy(*overrides: str) -> RetryPolicy:
    return load_config(DEFAULT_CONFIG, [*POLICY, *overrides]).storage


@pytest.fixture
def proxy(s3_server):
    """The session's proxy with this test's retry policy in force; faults off again afterwards."""
    configure_storage(_policy())
    s3fs.S3FileSystem.clear_instance_cache()  # clients made under another policy
    p = s3_server["proxy"]
    p.reset_stats()
    yield p
    p.set_faults(NO_FAULTS)
    configure_storage()
    s3fs.S3FileSystem.clear_instance_cache()


def _shard(i: int) -> list:
    return [make_sample(3 * i + k, 14 + 5 * k) for k in range(3)]


def test_writes_reads_and_verify_survive_every_kind_of_fault(proxy, s3_url, tmp_path):
    """Every kind of fault served for certain: shard 0's first PUT lost after its body, the seeded mix over
    shard 1's write and the verify, the read's first GET held past the read timeout. (A seeded mix alone
    missed the rarer kinds in some runs: its draws follow the requests' interleaving, which varies.)"""
    clean = open_cache(f"{s3_url}/clean", make_fp())
    for i in range(2):
        clean.write_shard(i, _shard(i), writer_id="w")
    faulty = open_cache(f"{s3_url}/faulty", make_fp())
    proxy.reset_stats()
    proxy.set_faults(Faults(put_lost=1.0, match=r"^PUT ", limit=1))
    faulty.write_shard(0, _shard(0), writer_id="w")
    proxy.set_faults(Faults(slowdown=0.03, error500=0.03, reset=0.04, timeout=0.02, put_lost=0.04, seed=3,
                            delay_s=1.5))
    faulty.write_shard(1, _shard(1), writer_id="w")
    report, code = verify.verify(f"{s3_url}/faulty", workers=2, cursor=str(tmp_path / "c.jsonl"), progress=False)
    proxy.set_faults(Faults(timeout=1.0, match=r"^GET ", limit=proxy.stats.retries_forced + 1, delay_s=1.5))
    first = CacheReader(f"{s3_url}/faulty")[0]
    stats = proxy.reset_stats()
    proxy.set_faults(NO_FAULTS)
    print(f"faults served over {stats.total} requests: {dict(stats.faults)}")
    assert code == 0 and report["ok"] and report["samples"] == 6 and first.sample_id == "0-0"
    assert set(stats.faults) == {"slowdown", "error500", "reset", "timeout", "put_lost"}
    assert compare.diff(f"{s3_url}/clean", f"{s3_url}/faulty")[0]["identical"]


def test_a_commit_put_lost_after_its_body_is_not_a_collision_with_itself(proxy, s3_url):
    root = open_cache(s3_url, make_fp(), storage=SMALL)
    proxy.set_faults(Faults(put_lost=1.0, match=r"^PUT .*/commits/", limit=1))
    record = root.write_shard(0, [make_sample(0, 20)], writer_id="w")
    assert proxy.stats.faults == {"put_lost": 1}  # stored, answered 500; the retry found its own record
    assert root.record(0) == record


def test_spent_budget_is_one_error_naming_the_url_and_nothing_is_committed(proxy, s3_url):
    configure_storage(_policy("storage.max_attempts=2", "storage.body_attempts=1"))
    s3fs.S3FileSystem.clear_instance_cache()
    root = open_cache(s3_url, make_fp(), storage=SMALL)
    proxy.set_faults(Faults(slowdown=1.0, match=r"^PUT .*/s000001/"))
    root.write_shard(0, [make_sample(0, 20)], writer_id="w")
    with pytest.raises(StorageUnavailableError) as info:
        root.write_shard(1, [make_sample(1, 20)], writer_id="w")
    message = str(info.value)
    assert f"writing shard 1 to {s3_url}/shards/s000001 failed" in message and "reduce your request rate" in message
    assert "\n" not in message and proxy.stats.faults["slowdown"] == 2  # two attempts, no more
    assert root.committed_shards() == [0]
    assert retry_budget_s(_policy()) == pytest.approx(3 * (1 + 2 + 4 + 8 + 16) + 0.1 + 0.17 + 0.289)


def _chats(path: Path, n: int) -> None:
    words = "the of and to in is for return def self if else value list dict none true false data file".split()
    with path.open("w") as f:
        for i in range(n):
            answer = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12 + i % 9))
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i} {words[i % 20]}"},
                                                            {"role": "assistant", "content": answer}]}) + "\n")


TINY = ["cache.rows_per_shard=4", "cache.num_workers=1", "data.min_loss_tokens=1", "generate.rows_per_shard=8",
        "generate.max_new_tokens=8", "generate.batch_size=8", "train.num_anchors=8", "train.drafters.dspark.markov_rank=8",
        "train.drafters.dspark.num_layers=1", "~train.drafters.dflash", "~train.drafters.eagle3", "train.num_workers=1",
        "train.concurrent_drafters=1", "train.heldout_shards=1", "train.validation_shards=0", "train.epochs=1",
        "train.micro_batch_samples=4", "train.global_batch_samples=4", "train.checkpoint_every_steps=2"]


def _tiny(target: str, run_dir: str, data: Path, stage: str, *extra: str):
    return load_config(DEFAULT_CONFIG, [f"stage={stage}", f"target.path={target}", f"run_dir={run_dir}",
                                        f"data.train_files=[{data}]", *TINY, *POLICY, *extra])


def _losses(run_dir: str) -> list[float]:
    from storage import filesystem

    fs, path = filesystem(f"{run_dir}/train/dspark/metrics.jsonl")
    return [json.loads(line)["loss"] for line in fs.cat_file(path).decode().splitlines()]


def test_tiny_run_under_faults_is_identical_to_a_fault_free_one(ray_local, proxy, tiny_target_dir, s3_url, tmp_path):
    """generate, cache, train (with checkpoints) and ops verify, all on S3, with and without faults."""
    data = tmp_path / "chats.jsonl"
    _chats(data, 20)
    runs = {}
    for name, faults in (("clean", NO_FAULTS), ("faulty", LOAD)):
        run_dir = f"{s3_url}/{name}"
        proxy.reset_stats()
        proxy.set_faults(faults)
        for stage in ("generate", "cache", "train"):
            run_stages(_tiny(tiny_target_dir, run_dir, data, stage))
        report, code = verify.verify(f"{run_dir}/cache", cursor=str(tmp_path / f"{name}.jsonl"), progress=False)
        proxy.set_faults(NO_FAULTS)
        runs[name] = {"stats": proxy.reset_stats(), "verify": (code, report["samples"]), "losses": _losses(run_dir),
                      "generate": read_json(f"{run_dir}/generate/summary.json")}
    stats = runs["faulty"]["stats"]
    print(f"faulty run: {stats.total} requests, faults served (one retry each) {dict(stats.faults)}")
    assert stats.faults["slowdown"] >= 10 and stats.faults["reset"] + stats.faults["timeout"] >= 3
    assert runs["faulty"]["verify"] == runs["clean"]["verify"] and runs["clean"]["verify"][0] == 0
    assert compare.diff(f"{s3_url}/clean/cache", f"{s3_url}/faulty/cache")[0]["identical"]
    assert len(runs["clean"]["losses"]) >= 3 and runs["faulty"]["losses"] == runs["clean"]["losses"]
    gen = [{k: runs[n]["generate"][k] for k in ("rows_kept", "new_tokens", "turns_generated")} for n in runs]
    assert gen[0] == gen[1]


def test_cache_stage_past_the_budget_stops_with_one_error_line_then_a_rerun_finishes_once(
        ray_local, proxy, tiny_target_dir, s3_url, tmp_path):
    data = tmp_path / "chats.jsonl"
    _chats(data, 12)
    args = ["+stage=cache", str(DEFAULT_CONFIG), f"target.path={tiny_target_dir}", f"data.train_files=[{data}]",
            "generate.enabled=false", *TINY, *POLICY, "storage.max_attempts=2", "storage.body_attempts=1",
            "ray.num_cpus=2", f"run_dir={s3_url}/broken"]
    proxy.set_faults(Faults(slowdown=1.0, match=r"^PUT .*/shards/s000001/"))
    out = subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=300)
    proxy.set_faults(NO_FAULTS)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert len(errors) == 1 and f"{s3_url}/broken/cache/shards/s000001" in errors[0], out.stderr[-3000:]
    assert "1 of 3 shards were not written" in errors[0] and "reduce your request rate" in errors[0]
    assert open_cache(f"{s3_url}/broken/cache").committed_shards() == [0, 2]
    run_stages(_tiny(tiny_target_dir, f"{s3_url}/broken", data, "cache", "generate.enabled=false"))
    run_stages(_tiny(tiny_target_dir, f"{s3_url}/clean", data, "cache", "generate.enabled=false"))
    summary = read_json(f"{s3_url}/broken/cache/summary.json")
    assert (summary["shards_written"], summary["shards_already_committed"], summary["samples"]) == (1, 2, 12)
    assert compare.diff(f"{s3_url}/clean/cache", f"{s3_url}/broken/cache")[0]["identical"]
